"""Error types shared by every layer.

`InvalidInput` is the caller's fault (HTTP 400 in the endpoint): it names the offending item and
the reason, and it never takes down an actor or another request. Everything else is ours.
"""


class RaypipeError(Exception):
    """Base class for errors raised by raypipe."""


class InvalidInput(RaypipeError, ValueError):
    """A request, image or parameter that cannot be served as given.

    `item` names what was wrong (e.g. "images[2]", "sampling_params.top_p") so a client with many
    inputs can find it; `code` is a short machine-readable reason for API error bodies.
    """

    def __init__(self, message: str, *, item: str | None = None, code: str = "invalid_input"):
        self.item = item
        self.code = code
        self.reason = message
        super().__init__(f"{item}: {message}" if item else message)

    def __reduce__(self):
        # Keep item/code when the error crosses a Ray process boundary.
        return (_rebuild_invalid_input, (type(self), self.reason, self.item, self.code))


def _rebuild_invalid_input(cls, message, item, code):
    return cls(message, item=item, code=code)


class CapacityError(RaypipeError):
    """The system cannot take the request now (e.g. queue full); the caller may retry later."""


class QueueFull(CapacityError):
    """The decode engine already holds `max_num_seqs` running plus `max_num_waiting` waiting requests."""


class EngineClosed(CapacityError):
    """The decode engine was shut down; the request may be retried on another one."""


class GroupFailed(CapacityError):
    """A rank of a tensor-parallel decode group failed; the group restarts whole and the request may be retried."""

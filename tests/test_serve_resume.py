"""`serve.resume.ResumableStream` with fake decoder calls: what is resumed, from where, and when it gives up.

The Serve tests kill real replicas (test_serve_routing: one of two; test_serve_api: the only one, restarted); these
cover what they cannot make happen on cue: a resumed call that dies too, the limit, and failures that are no
replica death.
"""

from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import ActorDiedError, RayTaskError

from raypipe.decode.resume import Resume
from raypipe.decode.sequence import RequestDelta
from raypipe.errors import InvalidInput
from raypipe.serve import resume as resume_module
from raypipe.serve.resume import MAX_RESUMES, ResumableStream


class FakeCall:
    """A decoder call's stream: its items, then `error` raised (or the end)."""

    def __init__(self, items, error: BaseException | None = None):
        self.items, self.error, self.cancelled = list(items), error, False

    async def __anext__(self):
        if self.items:
            return self.items.pop(0)
        if self.error is not None:
            raise self.error
        raise StopAsyncIteration

    def cancel(self):
        self.cancelled = True


def delta(ids, text, cached=0, finish=None):
    return RequestDelta("r", list(ids), text, finish, None, cached)


@pytest.fixture(autouse=True)
def no_pauses(monkeypatch):
    monkeypatch.setattr(resume_module, "RESUME_PAUSES_S", (0.0,) * MAX_RESUMES)


def drain(calls: list[FakeCall]):
    asked, resumed = [], []

    def start(resume):
        asked.append(resume)
        return calls[len(asked) - 1]

    stream = ResumableStream(start, lambda: resumed.append(1))

    async def go():
        return [item async for item in stream]
    return asyncio.run(go()), asked, len(resumed)


def test_a_dead_replica_is_resumed_from_what_the_stream_delivered():
    calls = [FakeCall([delta([1, 2], "ab", cached=16), delta([3], "")], ActorDiedError()),
             FakeCall([], ActorDiedError()),  # sent to the dead replica again: the router had not noticed
             FakeCall([delta([4, 5], "cde", cached=40), delta([6], "f", cached=40, finish="length")])]
    items, asked, resumed = drain(calls)
    assert asked == [None, Resume((1, 2, 3), 2), Resume((1, 2, 3), 2)] and resumed == 2
    assert [t for d in items for t in d.token_ids] == [1, 2, 3, 4, 5, 6]
    assert {d.num_cached_tokens for d in items} == {16}  # the prompt's hit on the first replica, as usage reports


def test_a_replica_lost_before_the_first_token_is_the_request_sent_again():
    items, asked, _ = drain([FakeCall([], ActorDiedError()), FakeCall([delta([7], "x", finish="stop")])])
    assert asked == [None, None] and [d.token_ids for d in items] == [[7]]


def test_resumes_are_bounded_then_the_replica_error_reaches_the_client():
    calls = [FakeCall([delta([1], "a")], ActorDiedError())] + [FakeCall([], ActorDiedError())] * MAX_RESUMES
    with pytest.raises(ActorDiedError):
        drain(calls)


@pytest.mark.parametrize("error", [RuntimeError("engine failed"), InvalidInput("bad", code="invalid_value"),
                                   RayTaskError("generate", "traceback", ValueError("boom"))])
def test_what_is_no_replica_death_is_never_resumed(error):
    with pytest.raises(type(error)):
        drain([FakeCall([delta([1], "a")], error), FakeCall([delta([2], "b", finish="stop")])])

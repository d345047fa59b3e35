"""Strings that stand for a visual item's bytes: `data:` URLs, and allow-listed `http(s)://` / `file://` URLs.

Shared by every visual kind (images, videos) so both accept and refuse URLs the same way; only the
kind's name in messages and error codes differs (`invalid_image_url`, `video_fetch_failed`, ...).
A `data:` URL's scheme may be in any case and its base64 may be line-wrapped as `base64.encodebytes`
writes it. Network and file URLs are refused unless their prefix is explicitly allowed.
"""

from __future__ import annotations

import base64
import binascii
import urllib.parse
import urllib.request

from raypipe.errors import InvalidInput


def read_url(url: str, *, kind: str, allowed_prefixes: tuple[str, ...], timeout_s: float, max_bytes: int,
             item: str) -> bytes:
    """The bytes `url` stands for; at most `max_bytes + 1` are fetched, so the caller can tell "too large"."""
    if url[:5].lower() == "data:":
        return decode_data_url(url, kind=kind, item=item)
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme not in ("http", "https", "file"):
        raise InvalidInput(f"{kind} string must be a data: URL (or an allowed http(s)/file URL)", item=item,
                           code=f"invalid_{kind}_url")
    if not any(url.startswith(prefix) for prefix in allowed_prefixes):
        raise InvalidInput(f"{scheme}:// {kind} URLs are not allowed on this server; send a data: URL",
                           item=item, code="url_not_allowed")
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 (allow-listed)
            return response.read(max_bytes + 1)
    except (OSError, ValueError) as exc:
        raise InvalidInput(f"could not fetch {kind} URL ({exc})", item=item, code=f"{kind}_fetch_failed") from None


def decode_data_url(url: str, *, kind: str, item: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise InvalidInput("malformed data: URL (no comma)", item=item, code=f"invalid_{kind}_url")
    if not header.lower().endswith(";base64"):
        raise InvalidInput(f"data: URL must be base64-encoded (data:{kind}/...;base64,...)", item=item,
                           code=f"invalid_{kind}_url")
    try:
        # Line-wrapped base64 (MIME, `base64.encodebytes`) is still base64; any other stray byte is not.
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidInput("data: URL payload is not valid base64", item=item, code="invalid_base64") from None

"""Header fields every frame kind validates the same way: ints, ids, names, times, the kind itself.
Parsers raise ProtocolError naming the frame and the field (`where`)."""

from __future__ import annotations

import math
from typing import Any

from p2pk3.params import SamplingParams, TokenLogprob

from ..codec import Frame, ProtocolError


class ErrorCode:
    """`code` of an `error` frame."""

    BAD_FRAME = "bad_frame"  # malformed frame or protocol violation; the connection is closed
    NOT_ENTRY = "not_entry"  # a client request sent to a slot without the entry role
    BAD_REQUEST = "bad_request"  # a well-formed request with invalid contents (names the field)
    BUSY = "busy"  # no room for the session and the entry's queue is full: retry after `retry_after` s
    QUEUE_TIMEOUT = "queue_timeout"  # waited the whole queue timeout without a free session (`retry_after`)
    FAILED = "failed"  # the request failed in the ring (message says where and why)
    UNAVAILABLE = "unavailable"  # a slot of the ring is down; message names it
    CANCELLED = "cancelled"  # the request was cancelled
    PREFIX_MISS = "prefix_miss"  # a stage no longer holds the cached prefix a segment named: the entry retries
    LOST_STATE = "lost_state"  # a stage holds no state for the session (freed, or new there): the entry replays it


MAX_SESSION_ID = 256
MAX_NAME = 256  # slot and node ids


def name(v: Any, where: str) -> str:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_NAME:
        raise ProtocolError(f"{where} must be a non-empty string of at most {MAX_NAME} characters, got {brief(v)}")
    return v


def count(v: Any, where: str) -> int:
    if not is_int(v) or v < 0:
        raise ProtocolError(f"{where} must be a non-negative integer, got {brief(v)}")
    return v


def brief(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def unix_time(v: Any, where: str) -> float | None:
    # shown with a date format later: a string / nan / 1e300 would raise there
    if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e11):
        raise ProtocolError(f"{where} must be a unix time or nil, got {brief(v)}")
    return v


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_session(v: Any, where: str) -> None:
    if not ((isinstance(v, str) and 0 < len(v) <= MAX_SESSION_ID) or is_int(v)):
        raise ProtocolError(f"{where}: session id must be a non-empty string (<= {MAX_SESSION_ID} chars) or an integer")


def finite(p: SamplingParams) -> SamplingParams:
    """SamplingParams.from_wire takes any float; NaN / inf make the sampler fail (or divide by zero).
    (The agent fields are checked finite by from_wire itself.)"""
    for k in ("temperature", "top_p"):
        v = getattr(p, k)
        if not math.isfinite(v):
            raise ValueError(f"sampling parameter {k!r} must be finite, got {v}")
    return p


def sampling(d: Any, where: str) -> SamplingParams:
    try:
        return finite(SamplingParams.from_wire(d))
    except (ValueError, TypeError) as e:
        raise ProtocolError(f"{where}: {e}") from None


def expect(frame: Frame, kind: str) -> dict[str, Any]:
    if frame.kind != kind:
        raise ProtocolError(f"expected a {kind} frame, got {frame.kind!r}")
    return frame.header


def logprob_list(v: Any, where: str, limit: int) -> tuple[TokenLogprob, ...]:
    """A list of logprob entries (at most `limit`)."""
    if not isinstance(v, (list, tuple)) or len(v) > limit:
        raise ProtocolError(f"{where}: must be a list of at most {limit} logprob entries")
    return tuple(logprob_entry(e, f"{where}[{i}]") for i, e in enumerate(v))


def logprob_entry(v: Any, where: str) -> TokenLogprob:
    try:
        return TokenLogprob.from_wire(v)
    except ValueError as e:
        raise ProtocolError(f"{where}: {e}") from None

"""Client frames (any authenticated peer <-> the entry): `generate` -> `token`* -> `done` | `error`;
`cancel` (stop a running request); `status` (request and reply); `error` (any side, any time)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2pk3.params import SamplingParams, TokenLogprob

from ..codec import Frame, ProtocolError
from .fields import brief, check_session, count, expect, finite, is_int, logprob_entry, logprob_list

MAX_PROMPT = 1 << 20


@dataclass
class GenerateRequest:
    """`generate`: run `prompt` (token ids) and stream the continuation. `logits`: return every
    position's logits instead of sampling (with max_tokens 0: scoring). `incremental`: feed the prompt
    one token per step (the decode path). `max_queue` / `queue_timeout` (optional): the most requests this
    one may find waiting before it, and the most seconds it waits in the entry's queue (node/admission.py);
    they only tighten the entry's own bounds. `generated`: the last `generated` ids of the prompt are output
    of an earlier run of this request (a client resuming it at a new entry): the grammar and the
    penalties count them as output, and prompt logprobs cover only the ids before them."""

    request_id: int
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    logits: bool = False
    incremental: bool = False
    max_queue: int | None = None
    queue_timeout: float | None = None
    generated: int = 0

    def frame(self) -> Frame:
        queue = {"max_queue": self.max_queue, "queue_timeout": self.queue_timeout}
        extra = {k: v for k, v in queue.items() if v is not None}
        if self.generated:
            extra["generated"] = int(self.generated)
        return Frame.make(
            "generate",
            request_id=self.request_id,
            prompt=[int(t) for t in self.prompt],
            params=self.params.to_wire(),
            logits=self.logits,
            incremental=self.incremental,
            **extra,
        )

    @classmethod
    def parse(cls, frame: Frame, vocab_size: int) -> "GenerateRequest":
        """Raises ProtocolError for a malformed frame and ValueError (-> bad_request) for invalid contents."""
        h = expect(frame, "generate")
        rid = h.get("request_id", 0)
        if not is_int(rid):
            raise ProtocolError("generate frame: request_id must be an integer")
        prompt = h.get("prompt")
        if (
            not isinstance(prompt, list)
            or not prompt
            or len(prompt) > MAX_PROMPT
            or not all(is_int(t) and 0 <= t < vocab_size for t in prompt)
        ):
            raise ValueError(
                f"prompt must be a non-empty list of at most {MAX_PROMPT} token ids in 0..{vocab_size - 1}"
            )
        params = finite(SamplingParams.from_wire(h.get("params") or {}))
        bad = [t for t, _ in params.logit_bias if t >= vocab_size]
        if bad:
            raise ValueError(f"logit_bias token ids {bad[:5]} are outside the vocabulary 0..{vocab_size - 1}")
        flags = {k: h.get(k, False) for k in ("logits", "incremental")}
        for k, v in flags.items():
            if not isinstance(v, bool):
                raise ValueError(f"{k} must be a bool")
        max_queue, timeout = h.get("max_queue"), h.get("queue_timeout")
        if max_queue is not None and not (is_int(max_queue) and max_queue >= 0):
            raise ValueError(f"max_queue must be an integer >= 0, got {brief(max_queue)}")
        if timeout is not None and not (
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < 1e7
        ):
            raise ValueError(f"queue_timeout must be a number of seconds > 0, got {brief(timeout)}")
        gen = h.get("generated", 0)
        if not is_int(gen) or not 0 <= gen < len(prompt):
            raise ValueError(f"generated must be an integer in 0..{len(prompt) - 1} (the prompt has {len(prompt)} ids)")
        return cls(rid, prompt, params, flags["logits"], flags["incremental"], max_queue, timeout, gen)


def token_frame(request_id: int, session: str, token: int, logprob: TokenLogprob | None = None) -> Frame:
    """One generated token; with `logprob` when the request asked for logprobs."""
    extra = {"logprob": logprob.to_wire()} if logprob is not None else {}
    return Frame.make("token", request_id=request_id, session=session, token=int(token), **extra)


def parse_token(frame: Frame) -> tuple[int, str | int, int]:
    """(request_id, session, token). The logprob, when there is one: `parse_token_logprob`."""
    h = expect(frame, "token")
    check_session(h.get("session"), "token frame")
    return _request_id(h, "token frame"), h["session"], count(h.get("token"), "token frame: token")


def parse_token_logprob(frame: Frame) -> TokenLogprob | None:
    """The token's logprob entry (None when the request did not ask for logprobs)."""
    v = expect(frame, "token").get("logprob")
    return None if v is None else logprob_entry(v, "token frame: logprob")


@dataclass
class Done:
    """A parsed `done`: every generated token, the request's `stats` and the entry's status
    (`stage_stats`); the logits, when asked, stay in the frame (`frame.array("logits")`).
    `prompt_logprobs` (when the request asked): one entry per prompt token (the first has logprob None)."""

    request_id: int
    session: str | int
    tokens: list[int]
    stats: dict
    stage_stats: dict
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None


def done_frame(
    request_id: int,
    session: str,
    tokens: list[int],
    stats: dict,
    stage_stats: dict,
    logits: Any = None,
    prompt_logprobs: list[TokenLogprob] | None = None,
) -> Frame:
    tensors = [("logits", logits)] if logits is not None else None
    extra = {"prompt_logprobs": [e.to_wire() for e in prompt_logprobs]} if prompt_logprobs is not None else {}
    return Frame.make(
        "done",
        tensors,
        request_id=request_id,
        session=session,
        tokens=[int(t) for t in tokens],
        stats=stats,
        stage_stats=stage_stats,
        **extra,
    )


def parse_done(frame: Frame) -> Done:
    h = expect(frame, "done")
    w = "done frame"
    check_session(h.get("session"), w)
    tokens = h.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) and t >= 0 for t in tokens):
        raise ProtocolError(f"{w}: tokens must be a list of non-negative token ids")
    stats, stage = h.get("stats", {}), h.get("stage_stats", {})
    if not isinstance(stats, dict) or not isinstance(stage, dict):
        raise ProtocolError(f"{w}: stats and stage_stats must be maps")
    if frame.has("logits") and frame.desc("logits")["dtype"] != "float32":
        raise ProtocolError(f"{w}: logits must be float32, not {frame.desc('logits')['dtype']}")
    plp = h.get("prompt_logprobs")
    plp = None if plp is None else logprob_list(plp, f"{w}: prompt_logprobs", MAX_PROMPT)
    return Done(_request_id(h, w), h["session"], tokens, stats, stage, plp)


def cancel_frame(request_id: int) -> Frame:
    return Frame.make("cancel", request_id=int(request_id))


def parse_cancel(frame: Frame) -> int:
    rid = expect(frame, "cancel").get("request_id")
    if not is_int(rid):
        raise ProtocolError("cancel frame: request_id must be an integer")
    return rid


def status_frame(**fields: Any) -> Frame:
    """A status request (no fields) or reply (the node's public statistics)."""
    return Frame.make("status", **fields)


def parse_status(frame: Frame) -> dict[str, Any]:
    """A status reply -> the node's public statistics (ProtocolError for another kind: a probe that gets a
    token or an error frame instead says so)."""
    return dict(expect(frame, "status"))


def error_frame(code: str, message: str, **ctx: Any) -> Frame:
    """code: an ErrorCode (or auth_failed during the handshake); message: for humans; ctx: request_id,
    session, fatal (the sender closes the connection), retry_after (seconds; `busy` / `queue_timeout`), ..."""
    return Frame.make("error", code=code, message=message, **ctx)


@dataclass(frozen=True)
class ErrorReply:
    """A parsed `error`: `code` (an ErrorCode, or a handshake code), `message`, and the `request_id` it
    answers (None: the connection's, not a request's); `fatal`: the sender closes the connection."""

    code: str
    message: str
    request_id: int | str | None = None
    fatal: bool = False
    retry_after: int | None = None  # seconds after which a retry may succeed (busy, queue_timeout)


def parse_error(frame: Frame) -> ErrorReply:
    h = expect(frame, "error")
    code, msg, rid, fatal = h.get("code"), h.get("message"), h.get("request_id"), h.get("fatal", False)
    if not isinstance(code, str) or not isinstance(msg, str):
        raise ProtocolError("error frame: code and message must be strings")
    if not (rid is None or isinstance(rid, str) or is_int(rid)) or not isinstance(fatal, bool):
        raise ProtocolError("error frame: request_id must be a string, an integer or nil, and fatal a bool")
    retry = h.get("retry_after")
    if retry is not None and not (is_int(retry) and 0 <= retry <= 86400):
        raise ProtocolError(f"error frame: retry_after must be whole seconds in 0..86400, got {brief(retry)}")
    return ErrorReply(code, msg, rid, fatal, retry)


def _request_id(h: dict, where: str) -> int:
    rid = h.get("request_id")
    if not is_int(rid):
        raise ProtocolError(f"{where}: request_id must be an integer, got {brief(rid)}")
    return rid

"""POST /v1/messages: the Anthropic Messages API, translated onto the same generation path as the OpenAI chat route.

    parse_messages_request(body, context_len) -> GenRequest    # Anthropic's fields, errors naming them
    await messages(request)                                     # the route: a message, or its event stream

The request: `model`, `max_tokens` (both required, as Anthropic requires them), `messages` (user / assistant
turns whose content is a string or blocks: `text`, `tool_use` {id, name, input} in assistant turns,
`tool_result` {tool_use_id, content, is_error} in user turns, `thinking` in assistant turns), `system` (a
string or text blocks), `stop_sequences`, `temperature` [0, 1], `top_p`, `top_k`, `stream`, `tools`
({name, description, input_schema}), `tool_choice` ({"type": "auto" | "any" | "tool" | "none"}, `name`,
`disable_parallel_tool_use`), `thinking` ({"type": "enabled" | "adaptive" | "disabled"}) and
`output_config.effort` (low ... max) as the chat template's `reasoning_effort` ("disabled": "none"; thinking
without an effort: "high"; "max": "xhigh"); `metadata` is accepted and ignored. Images, documents and server tools
are refused (400). The turns become the chat template's messages as the OpenAI route gives them (a
tool_result block is a `role: "tool"` message, a tool_use block an assistant tool call with its input as
JSON arguments), so a conversation means the same prompt by either API.

The answer (api/answer.py) becomes content blocks: `thinking` (the reasoning, an empty signature), `text`,
`tool_use` (input: the parsed arguments); stop_reason `end_turn`, `max_tokens`, `stop_sequence` (with
`stop_sequence` set) or `tool_use`; usage `input_tokens` / `output_tokens`. Streamed as Anthropic streams it:
`message_start`, per block `content_block_start` / `content_block_delta` (text_delta, thinking_delta,
input_json_delta) / `content_block_stop`, then `message_delta` (stop_reason, output usage) and
`message_stop`; a cluster failure mid-stream is an `error` event. The API key may come as `x-api-key` (what
Anthropic's clients send) or as `Authorization: Bearer`; errors are in Anthropic's shape
`{"type": "error", "error": {"type", "message"}}` (`error_response`).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

from aiohttp import web

from p2pk3.frontends.prompt import SamplingOverrides
from p2pk3.params import MAX_SEED

from .answer import AnswerShaper
from .context import CONFIG, METRICS, PROMPTS, check_model, json_body, start_generation
from .errors import ApiError, bad_param
from .generation import Generation
from .schema import MAX_STOP_LEN, GenRequest
from .sse import SSE

__all__ = ["messages", "parse_messages_request", "error_response", "ERROR_TYPES"]

# HTTP status -> Anthropic error type
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
MAX_STOP_SEQUENCES = 16
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "xhigh"}  # -> reasoning_effort


def error_body(e: ApiError) -> dict:
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def error_response(e: ApiError) -> web.Response:
    return web.json_response(error_body(e), status=e.status)


# ---------------------------------------------------------------- the request
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _text_of(v: Any, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        out = []
        for i, b in enumerate(v):
            if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise bad_param(f"{where}[{i}]", 'must be a text block {"type": "text", "text": ...}')
            out.append(b["text"])
        return "".join(out)
    raise bad_param(where, f"must be a string or a list of text blocks, got {type(v).__name__}")


def _turn(m: Any, where: str) -> list[dict]:
    """One Anthropic turn -> chat-template messages (a user turn's tool_result blocks become tool messages)."""
    if not isinstance(m, dict):
        raise bad_param(where, f"must be an object, got {type(m).__name__}")
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise bad_param(f"{where}.role", f'must be "user" or "assistant", got {role!r}'[:300])
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_param(f"{where}.content", "is required: a string or a list of content blocks")
    text, thinking, calls, results = [], [], [], []
    for i, b in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise bad_param(at, "a tool_use block needs a string id and name")
            if not isinstance(b.get("input", {}), dict):
                raise bad_param(f"{at}.input", "must be an object")
            args = json.dumps(b.get("input", {}), ensure_ascii=False)
            calls.append({"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": args}})
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise bad_param(f"{at}.tool_use_id", "is required (the id of the tool_use this result answers)")
            out = _text_of(b.get("content", ""), f"{at}.content")
            if b.get("is_error"):
                out = f"Error: {out}"
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": out})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            if isinstance(b.get("thinking"), str):
                thinking.append(b["thinking"])
        else:
            raise bad_param(at, f"a {kind or 'malformed'} block is not supported in a {role} turn"[:300])
    if role == "user":
        return results + ([{"role": "user", "content": "".join(text)}] if text or not results else [])
    msg: dict = {"role": "assistant", "content": "".join(text)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    return [msg]


def _tools(v: Any) -> list[dict] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad_param("tools", "must be a list of {name, description, input_schema}")
    out = []
    for i, t in enumerate(v):
        if not isinstance(t, dict) or t.get("type") not in (None, "custom"):
            kind = t.get("type") if isinstance(t, dict) else None
            raise bad_param(f"tools[{i}]", f"only client tools {{name, input_schema}} are supported, got {kind!r}")
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad_param(f"tools[{i}].name", "is required (a non-empty string)")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_param(f"tools[{i}].input_schema", "is required (a JSON schema object)")
        fn = {"name": t["name"]}  # in OpenAI's order: the template renders the tools as JSON
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": {**fn, "parameters": schema}})
    names = [t["function"]["name"] for t in out]
    if len(set(names)) < len(names):
        raise bad_param("tools", f"tool names must be unique, got {names}")
    return out or None


def _tool_choice(v: Any, tools: list[dict] | None) -> tuple[str | dict, bool]:
    """(OpenAI tool_choice, parallel_tool_calls) of Anthropic's tool_choice."""
    if v is None:
        return ("auto" if tools else "none"), True
    kind = v.get("type") if isinstance(v, dict) else None
    parallel = not (isinstance(v, dict) and v.get("disable_parallel_tool_use"))
    if kind == "none":
        return "none", parallel
    if kind not in ("auto", "any", "tool"):
        raise bad_param("tool_choice", f'must be {{"type": "auto" | "any" | "tool" | "none"}}, got {v!r}'[:300])
    if not tools:
        raise bad_param("tool_choice", f"{kind!r} needs a non-empty tools list")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    name = v.get("name")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_param("tool_choice.name", f"names {name!r}, which is not among the tools")
    return {"type": "function", "function": {"name": name}}, parallel


def _effort(body: dict) -> str | None:
    """The chat template's reasoning_effort from `thinking` and `output_config.effort` (None: neither)."""
    kinds = ("enabled", "adaptive", "disabled")
    thinking = _opt(body, "thinking", lambda v: isinstance(v, dict) and v.get("type") in kinds,
                    " or ".join(f'{{"type": "{k}"}}' for k in kinds))  # fmt: skip
    oc = _opt(body, "output_config", lambda v: isinstance(v, dict), "an object") or {}
    if oc.get("format") is not None:
        raise bad_param("output_config.format", "structured outputs are not supported on /v1/messages")
    effort = oc.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad_param("output_config.effort", f"must be one of {', '.join(EFFORTS)}, got {effort!r}"[:300])
    if thinking is not None and thinking["type"] == "disabled":
        return "none"
    if effort is not None:
        return EFFORTS[effort]
    return "high" if thinking is not None else None


def _opt(body: dict, key: str, check, what: str):
    v = body.get(key)
    if v is not None and not check(v):
        raise bad_param(key, f"must be {what}, got {v!r}"[:300])
    return v


def parse_messages_request(body: Any, max_tokens_limit: int) -> GenRequest:
    """The validated Messages request as the chat route's GenRequest; ApiError 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_param("body", f"the request body must be a JSON object, got {type(body).__name__}")
    req = GenRequest("chat")
    req.model = _opt(body, "model", lambda v: isinstance(v, str), "a string")
    if req.model is None:
        raise bad_param("model", "is required: the id of the model to use (GET /v1/models lists it)")
    max_tokens = _opt(body, "max_tokens", _is_int, "an integer")
    if max_tokens is None:
        raise bad_param("max_tokens", "is required: the most tokens to generate")
    if not 1 <= max_tokens <= max_tokens_limit:
        raise bad_param("max_tokens", f"must be in [1, {max_tokens_limit}], got {max_tokens}")
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise bad_param("messages", "is required: a non-empty list of {role, content}")
    msgs = [m for i, t in enumerate(turns) for m in _turn(t, f"messages[{i}]")]
    system = body.get("system")
    if system is not None:
        msgs.insert(0, {"role": "system", "content": _text_of(system, "system")})
    req.messages = msgs
    req.tools = _tools(body.get("tools"))
    req.tool_choice, req.parallel_tool_calls = _tool_choice(body.get("tool_choice"), req.tools)
    req.reasoning_effort = _effort(body)
    stops = _opt(body, "stop_sequences", lambda v: isinstance(v, list) and all(isinstance(s, str) for s in v),
                 "a list of strings")
    if stops is not None:
        if len(stops) > MAX_STOP_SEQUENCES or any(not s or len(s) > MAX_STOP_LEN for s in stops):
            raise bad_param("stop_sequences", f"at most {MAX_STOP_SEQUENCES} of 1..{MAX_STOP_LEN} characters each")
        req.stop = list(dict.fromkeys(stops))
    req.stream = bool(_opt(body, "stream", lambda v: isinstance(v, bool), "true or false"))
    top_k = _opt(body, "top_k", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    req.sampling = SamplingOverrides(
        max_tokens=max_tokens,
        temperature=_opt(body, "temperature", lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
        top_p=_opt(body, "top_p", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
        top_k=top_k,
        seed=_opt(body, "seed", lambda v: _is_int(v) and 0 <= v <= MAX_SEED, f"an integer in [0, {MAX_SEED}]"),
    )
    return req


# ---------------------------------------------------------------- the answer
def _stop_reason(gen: Generation, shape: AnswerShaper, streamed: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    finish = shape.finish_reason(gen.finish_reason, streamed=streamed)
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    if gen.matcher.stopped is not None:
        return "stop_sequence", gen.matcher.stopped
    return "end_turn", None


def _blocks(shape: AnswerShaper) -> list[dict]:
    out: list[dict] = []
    if shape.reasoning_content is not None:
        out.append({"type": "thinking", "thinking": shape.reasoning_content, "signature": ""})
    if shape.content:
        out.append({"type": "text", "text": shape.content})
    for c in shape.tool_calls:
        fn = c["function"]
        out.append({"type": "tool_use", "id": c["id"], "name": fn["name"], "input": json.loads(fn["arguments"])})
    return out


class _BlockStream:
    """The answer's OpenAI deltas -> Anthropic's content-block events (start, deltas, stop per block)."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None  # the open block: thinking | text | tool_use

    def _open(self, block: dict) -> list[tuple[str, dict]]:
        ev = self.close()
        self.index += 1
        self.kind = block["type"]
        return ev + [("content_block_start", {"type": "content_block_start", "index": self.index, "content_block": block})]

    def _delta(self, delta: dict) -> tuple[str, dict]:
        return "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}

    def close(self) -> list[tuple[str, dict]]:
        if self.kind is None:
            return []
        self.kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def events(self, d: dict) -> list[tuple[str, dict]]:
        ev: list[tuple[str, dict]] = []
        if "reasoning_content" in d:
            if self.kind != "thinking":
                ev += self._open({"type": "thinking", "thinking": "", "signature": ""})
            ev.append(self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
        elif "content" in d:
            if self.kind != "text":
                ev += self._open({"type": "text", "text": ""})
            ev.append(self._delta({"type": "text_delta", "text": d["content"]}))
        for c in d.get("tool_calls", ()):
            if "id" in c:
                ev += self._open({"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": {}})
            if c["function"].get("arguments"):
                ev.append(self._delta({"type": "input_json_delta", "partial_json": c["function"]["arguments"]}))
        return ev


async def messages(request: web.Request) -> web.StreamResponse:
    t_arrival = time.perf_counter()
    app = request.app
    cfg = app[CONFIG]
    req = parse_messages_request(await json_body(request), app[PROMPTS].context_len)
    check_model(cfg, req.model)
    gen, shape = await start_generation(request, req, t_arrival)
    meta = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": cfg.model_name}
    app[METRICS].in_flight.inc()
    try:
        async with gen:
            if req.stream:
                return await _stream(request, gen, shape, meta)
            async for piece in gen.pieces():
                shape.feed(piece)
            shape.finish()
            reason, seq = _stop_reason(gen, shape, streamed=False)
            usage = {"input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens}
            body = {**meta, "content": _blocks(shape), "stop_reason": reason, "stop_sequence": seq, "usage": usage}
            return web.json_response(body)
    finally:
        app[METRICS].in_flight.dec()


async def _stream(request: web.Request, gen: Generation, shape: AnswerShaper, meta: dict) -> web.StreamResponse:
    pieces = gen.pieces()
    blocks = _BlockStream()
    try:
        sse, first = await SSE.after_first(request, pieces)
        start = {**meta, "content": [], "stop_reason": None, "stop_sequence": None}
        start["usage"] = {"input_tokens": gen.prompt_tokens, "output_tokens": 0}
        await sse.send({"type": "message_start", "message": start}, "message_start")

        async def send(deltas: list[dict]) -> None:
            for d in deltas:
                for name, ev in blocks.events(d):
                    await sse.send(ev, name)

        try:
            await send(shape.feed(first or ""))
            async for piece in pieces:
                await send(shape.feed(piece))
        except ApiError as e:  # the cluster failed mid-stream: an error event, as Anthropic sends one
            await sse.send(error_body(e), "error")
            await sse.end()
            return sse.response
        await send(shape.finish())
        for name, ev in blocks.close():
            await sse.send(ev, name)
        reason, seq = _stop_reason(gen, shape, streamed=True)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq}}
        delta["usage"] = {"output_tokens": gen.completion_tokens}
        await sse.send(delta, "message_delta")
        await sse.send({"type": "message_stop"}, "message_stop")
        await sse.end()
        return sse.response
    finally:
        await pieces.aclose()

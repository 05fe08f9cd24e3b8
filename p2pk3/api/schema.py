"""Validation of OpenAI request bodies (`/v1/chat/completions`, `/v1/completions`) into `GenRequest`.

Every mistake is an `ApiError` 400 whose `param` names the field (`messages[1].role`, `temperature`, ...).
Accepted: `model` (required, as OpenAI requires it), `messages` / `prompt`, `stream`, `stream_options.include_usage`, `max_tokens` /
`max_completion_tokens`, `temperature` [0, 2], `top_p` (0, 1], `seed`, `stop` (string or list of up to 4),
`n` (1 only), `user`; extensions as vLLM names them: `top_k`, `ignore_eos`; p2pk3's own: `speculate`,
`draft_tokens`. Agents' fields: `tools` (functions with JSON-schema `parameters`), `tool_choice` ("auto",
"none", "required" or {"type": "function", "function": {"name"}}; the default is "auto" with tools, "none"
without), `parallel_tool_calls` (default true), `reasoning_effort` (passed to the chat template), and the
messages agents send back: assistant `tool_calls` (content may then be null) and `reasoning_content`,
`role: "tool"` results with their `tool_call_id`. The sampling fields land in `GenRequest.sampling` (a
`SamplingOverrides`: unset fields take the checkpoint's generation_config defaults,
p2pk3/frontends/prompt.py) with the ranges the CLI options have (p2pk3/params.py).

Issue 24's sampling fields (`_agent_sampling`): `frequency_penalty`, `presence_penalty` [-2, 2],
`logit_bias` ({"id": bias in [-100, 100]}), vLLM's `repetition_penalty` (> 0) and `min_p` [0, 1];
`response_format` (text, json_object, json_schema with `strict`: the grammar the last stage masks with);
chat `logprobs` (bool) + `top_logprobs` [0, 20]; completions `logprobs` (int [0, 20]) and `echo` (the
prompt in the text, and its tokens' logprobs with `logprobs`). Fields that would change the output in a
way this server does not implement (`suffix`, `best_of` > 1) are refused rather than ignored. Other
unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from p2pk3.frontends.prompt import SamplingOverrides
from p2pk3.params import (
    DEFAULT_DRAFT,
    LOGIT_BIAS_LIMIT,
    MAX_DRAFT,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_SEED,
    MAX_TEMPERATURE,
    SPEC_METHODS,
)

from .errors import bad_param

ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_STOPS = 4
MAX_STOP_LEN = 256


@dataclass
class GenRequest:
    kind: str  # "chat" | "completion"
    model: str | None = None
    messages: list[dict] | None = None  # chat: normalised messages (role, content: str, [name])
    tools: list[dict] | None = None
    tool_choice: str | dict = "none"  # "auto" | "none" | "required" | {"type": "function", "function": {...}}
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None  # a chat template variable when given
    prompt: str | list[int] | None = None  # completion: text, or token ids
    stream: bool = False
    include_usage: bool = False
    sampling: SamplingOverrides = field(default_factory=SamplingOverrides)  # max_tokens, temperature, ...
    max_tokens_field: str = "max_tokens"  # the name the request gave it (chat: or max_completion_tokens)
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # top N per generated token (chat: top_logprobs when logprobs is true)
    echo: bool = False  # completions: the prompt in the text (and its logprobs with `logprobs`)
    response_format: dict | None = None  # json_object / json_schema (None: text)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(body: dict, key: str, check, what: str):
    v = body.get(key)
    if v is None:
        return None
    if not check(v):
        raise bad_param(key, f"must be {what}, got {v!r}"[:300])
    return v


def _content(v: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts ({"type": "text", "text": ...})."""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        out = []
        for i, part in enumerate(v):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_param(f"{where}[{i}]", 'only text parts are supported ({"type": "text", "text": ...})')
            out.append(part["text"])
        return "".join(out)
    raise bad_param(where, f"must be a string or a list of text parts, got {type(v).__name__}")


def _messages(v: Any) -> list[dict]:
    if v is None:
        raise bad_param("messages", "is required (a non-empty list of {role, content})")
    if not isinstance(v, list) or not v:
        raise bad_param("messages", "must be a non-empty list of {role, content}")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_param(where, f"must be an object, got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise bad_param(f"{where}.role", f"must be one of {', '.join(ROLES)}, got {role!r}"[:300])
        content = m.get("content")
        if content is None and not (role == "assistant" and m.get("tool_calls")):
            raise bad_param(f"{where}.content", "is required")
        msg = {
            "role": "system" if role == "developer" else role,
            "content": "" if content is None else _content(content, f"{where}.content"),
        }
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise bad_param(f"{where}.name", "must be a string")
            msg["name"] = name
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad_param(f"{where}.tool_call_id", "is required (the id of the call this result answers)")
            msg["tool_call_id"] = m["tool_call_id"]
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        if role == "assistant" and m.get("reasoning_content") is not None:
            if not isinstance(m["reasoning_content"], str):
                raise bad_param(f"{where}.reasoning_content", "must be a string")
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    return out


def _tool_calls(v: Any, where: str) -> list[dict]:
    """An assistant message's tool_calls: [{id, type: function, function: {name, arguments: JSON text}}]."""
    if not isinstance(v, list):
        raise bad_param(where, "must be a list of tool calls")
    out = []
    for i, c in enumerate(v):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_param(f"{where}[{i}]", 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            raise bad_param(f"{where}[{i}].function.arguments", "must be a string (the arguments as JSON text)")
        call_id = c.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_param(f"{where}[{i}].id", "must be a string")
        out.append({"id": call_id or f"functions.{fn['name']}:{i}", "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _tools(v: Any) -> list[dict] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad_param("tools", "must be a list of {type: function, function: {name, parameters}}")
    for i, t in enumerate(v):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_param(f"tools[{i}]", 'must be {"type": "function", "function": {"name", "parameters"}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_param(f"tools[{i}].function.name", "is required (a non-empty string)")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_param(f"tools[{i}].function.parameters", "must be a JSON schema object")
    names = [t["function"]["name"] for t in v]
    if len(set(names)) < len(names):
        raise bad_param("tools", f"function names must be unique, got {names}")
    return v or None


def _tool_choice(v: Any, tools: list[dict] | None) -> str | dict:
    if v is None:
        return "auto" if tools else "none"
    if v in ("auto", "none", "required") or (
        isinstance(v, dict) and v.get("type") == "function" and isinstance((v.get("function") or {}).get("name"), str)
    ):
        if v != "none" and not tools:
            raise bad_param("tool_choice", f"{v!r} needs a non-empty tools list")
        if isinstance(v, dict) and v["function"]["name"] not in {t["function"]["name"] for t in tools}:
            raise bad_param("tool_choice", f"names {v['function']['name']!r}, which is not among the tools")
        return v
    what = '"auto", "none", "required" or {"type": "function", "function": {"name": ...}}'
    raise bad_param("tool_choice", f"must be {what}, got {v!r}"[:300])


def _prompt(v: Any) -> str | list[int]:
    if v is None:
        raise bad_param("prompt", "is required (a string or a list of token ids)")
    if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
        v = v[0]  # a batch of one prompt
    if isinstance(v, str):
        if not v:
            raise bad_param("prompt", "is empty")
        return v
    if isinstance(v, list) and v and all(_is_int(t) and t >= 0 for t in v):
        return list(v)
    if isinstance(v, list) and len(v) > 1 and all(isinstance(t, (str, list)) for t in v):
        raise bad_param("prompt", "one prompt per request (batches of prompts are not supported)")
    raise bad_param("prompt", "must be a non-empty string or a non-empty list of token ids")


def _stop(v: Any) -> list[str]:
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_param("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOPS:
        raise bad_param("stop", f"at most {MAX_STOPS} stop sequences, got {len(stops)}")
    if any(not s or len(s) > MAX_STOP_LEN for s in stops):
        raise bad_param("stop", f"stop sequences must be 1..{MAX_STOP_LEN} characters")
    return list(dict.fromkeys(stops))


def _refuse_unsupported(body: dict, kind: str) -> None:
    if kind == "completion":
        if body.get("suffix") is not None:
            raise bad_param("suffix", "suffix is not supported by this server")
        if body.get("best_of") not in (None, 1):
            raise bad_param("best_of", "only best_of = 1 is supported")


def _logit_bias(v) -> tuple[tuple[int, float], ...]:
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise bad_param("logit_bias", 'must be an object mapping token ids to biases, e.g. {"50256": -100}')
    if len(v) > MAX_LOGIT_BIAS:
        raise bad_param("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
    out = []
    for k, b in v.items():
        try:
            t = int(k)
        except (TypeError, ValueError):
            raise bad_param("logit_bias", f"key {k!r} is not a token id (an integer as a string)"[:300]) from None
        if t < 0:
            raise bad_param("logit_bias", f"token id {t} is negative")
        if not _is_num(b) or not -LOGIT_BIAS_LIMIT <= b <= LOGIT_BIAS_LIMIT:
            raise bad_param("logit_bias", f"the bias of {k} must be a number in [-100, 100], got {b!r}"[:300])
        out.append((t, float(b)))
    return tuple(out)


def _response_format(v) -> dict | None:
    if v is None:
        return None
    from p2pk3.agent.grammar import GrammarError, response_format_schema  # torch: only when one is asked

    try:
        schema, _ = response_format_schema(v)
    except GrammarError as e:
        raise bad_param("response_format", str(e)[:300]) from None
    return None if schema is None else dict(v)


def _agent_sampling(body: dict, kind: str, req: GenRequest) -> dict:
    """The issue-24 fields: penalties, logit_bias, response_format, logprobs / echo (SamplingOverrides kw)."""
    num = {
        "frequency_penalty": (lambda v: _is_num(v) and -2 <= v <= 2, "a number in [-2, 2]"),
        "presence_penalty": (lambda v: _is_num(v) and -2 <= v <= 2, "a number in [-2, 2]"),
        "repetition_penalty": (lambda v: _is_num(v) and 0 < v <= 1e6, "a number > 0 (1: off)"),
        "min_p": (lambda v: _is_num(v) and 0 <= v <= 1, "a number in [0, 1]"),
    }
    kw = {k: _opt(body, k, ok, what) for k, (ok, what) in num.items()}
    kw["logit_bias"] = _logit_bias(body.get("logit_bias"))
    req.response_format = _response_format(body.get("response_format"))
    kw["grammar"] = req.response_format
    if kind == "chat":
        lp = _opt(body, "logprobs", lambda v: isinstance(v, bool), "true or false")
        top = _opt(
            body, "top_logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]"
        )
        if top is not None and not lp:
            raise bad_param("top_logprobs", "needs logprobs: true")
        req.logprobs = (top or 0) if lp else None
    else:
        req.logprobs = _opt(
            body, "logprobs", lambda v: _is_int(v) and 0 <= v <= MAX_LOGPROBS, f"an integer in [0, {MAX_LOGPROBS}]"
        )
        req.echo = bool(_opt(body, "echo", lambda v: isinstance(v, bool), "true or false"))
    kw["logprobs"] = req.logprobs
    kw["prompt_logprobs"] = req.logprobs if req.echo else None
    return kw


def parse_request(body: Any, kind: str, max_tokens_limit: int) -> GenRequest:
    """The validated request (kind "chat" or "completion"); raises ApiError 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_param("body", f"the request body must be a JSON object, got {type(body).__name__}")
    _refuse_unsupported(body, kind)
    req = GenRequest(kind)
    req.model = _opt(body, "model", lambda v: isinstance(v, str), "a string")
    if req.model is None:  # OpenAI requires it
        raise bad_param("model", "required: the id of the model to use (GET /v1/models lists it)")
    if kind == "chat":
        req.messages = _messages(body.get("messages"))
        req.tools = _tools(body.get("tools"))
        req.tool_choice = _tool_choice(body.get("tool_choice"), req.tools)
        ptc = _opt(body, "parallel_tool_calls", lambda v: isinstance(v, bool), "true or false")
        req.parallel_tool_calls = True if ptc is None else ptc
        req.reasoning_effort = _opt(
            body, "reasoning_effort", lambda v: v in REASONING_EFFORTS, " or ".join(f'"{e}"' for e in REASONING_EFFORTS)
        )
    else:
        req.prompt = _prompt(body.get("prompt"))
    n = _opt(body, "n", _is_int, "an integer")
    if n is not None and n != 1:
        raise bad_param("n", f"only n = 1 is supported, got {n}")
    req.stream = bool(_opt(body, "stream", lambda v: isinstance(v, bool), "true or false"))
    so = _opt(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if so is not None:
        if not req.stream:
            raise bad_param("stream_options", "is only allowed when stream is true")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise bad_param("stream_options.include_usage", "must be true or false")
        req.include_usage = bool(iu)
    max_tokens = None
    for k in ["max_completion_tokens", "max_tokens"] if kind == "chat" else ["max_tokens"]:
        v = _opt(body, k, _is_int, "an integer")
        if v is not None:
            if not 1 <= v <= max_tokens_limit:
                raise bad_param(k, f"must be in [1, {max_tokens_limit}], got {v}")
            max_tokens, req.max_tokens_field = v, k
            break
    top_k = _opt(body, "top_k", lambda v: _is_int(v) and v >= -1, "an integer >= -1 (-1 or 0: off)")
    spec = _opt(body, "speculate", lambda v: v in SPEC_METHODS, " or ".join(f'"{m}"' for m in SPEC_METHODS))
    draft = _opt(body, "draft_tokens", lambda v: _is_int(v) and 1 <= v <= MAX_DRAFT, f"an integer in [1, {MAX_DRAFT}]")
    req.sampling = SamplingOverrides(
        max_tokens=max_tokens,
        temperature=_opt(
            body,
            "temperature",
            lambda v: _is_num(v) and 0 <= v <= MAX_TEMPERATURE,
            f"a number in [0, {MAX_TEMPERATURE:g}]",
        ),
        top_p=_opt(body, "top_p", lambda v: _is_num(v) and 0 < v <= 1, "a number in (0, 1]"),
        top_k=None if top_k is None else max(top_k, 0),
        seed=_opt(body, "seed", lambda v: _is_int(v) and 0 <= v <= MAX_SEED, f"an integer in [0, {MAX_SEED}]"),
        ignore_eos=bool(_opt(body, "ignore_eos", lambda v: isinstance(v, bool), "true or false")),
        speculate=spec or "off",
        draft_tokens=DEFAULT_DRAFT if draft is None else draft,
        **_agent_sampling(body, kind, req),
    )
    req.stop = _stop(body.get("stop"))
    return req

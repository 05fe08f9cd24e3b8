"""The OpenAI-compatible HTTP API (aiohttp): routes, auth, errors, SSE streaming.

    GET  /v1/models             the one model this cluster serves
    POST /v1/chat/completions   chat (messages -> the checkpoint's chat template), streaming or not
    POST /v1/completions        plain completion of a prompt (text after BOS, or token ids)
    POST /v1/messages           the Anthropic Messages API (api/anthropic.py), on the same generation path
    GET  /metrics               Prometheus metrics (no auth: scrapers rarely carry keys; no secrets in it)
    GET  /health                200 while the server runs

Prompts and sampling defaults come from p2pk3/frontends/prompt.py, as in every front end; requests become
generations in api/context.py. A chat answer's thinking and tool calls are shaped by api/answer.py
(`reasoning_content`, `tool_calls`, finish_reason "tool_calls"); tool_choice "required" / named is enforced
by a grammar the last stage samples under.

With an API key every /v1 route needs `Authorization: Bearer KEY` or `x-api-key: KEY` (401 otherwise).
Errors are in OpenAI's shape `{"error": {"message", "type", "param", "code"}}` (on /v1/messages in
Anthropic's, api/anthropic.py): 400 invalid body (param names the field), 401, 404 unknown model or route,
429 the cluster is busy, 503 a stage is down or no entry answers.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import time

from aiohttp import web

from p2pk3.frontends.prompt import PromptBuilder

from . import anthropic
from .answer import AnswerFormats, AnswerShaper
from .context import (
    CLUSTER,
    CONFIG,
    FORMATS,
    METRICS,
    PROMPTS,
    STARTED,
    ApiConfig,
    check_model,
    json_body,
    route_of,
    start_generation,
)
from .errors import ApiError, bad_param
from .generation import Generation
from .metrics import ApiMetrics
from .schema import GenRequest, parse_request
from .sse import SSE

log = logging.getLogger("p2pk3.api")

MAX_BODY = 16 << 20
VOCAB = web.AppKey("vocab", object)  # api/logprobs.Vocab, made on the first request with logprobs


@web.middleware
async def _errors_and_metrics(request: web.Request, handler):
    app = request.app
    route = route_of(request)
    shape = anthropic.error_response if request.path == "/v1/messages" else ApiError.response
    try:
        cfg: ApiConfig = app[CONFIG]
        if cfg.api_key is not None and request.path.startswith("/v1/"):
            _check_key(request, cfg.api_key)
        resp = await handler(request)
    except (ConnectionResetError, asyncio.CancelledError):  # the client went away (the request is cancelled)
        app[METRICS].requests.labels(route, "499").inc()
        raise
    except ApiError as e:
        resp = shape(e)
    except web.HTTPException as e:  # aiohttp's own (404 route, 405 method, 413 body too large)
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        resp = shape(
            ApiError(
                e.status,
                e.reason if e.status != 404 else f"no route {request.method} {request.path}",
                type=kind,
                code=str(e.status),
            )
        )
    except Exception:  # a bug of ours: 500 in the API's error shape, the server keeps running
        log.exception("unexpected error serving %s %s", request.method, request.path)
        resp = shape(ApiError(500, "internal server error (see the server's log)", type="server_error"))
    app[METRICS].requests.labels(route, str(resp.status)).inc()
    return resp


def _check_key(request: web.Request, key: str) -> None:
    """`Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's)."""
    auth = request.headers.get("Authorization", "")
    given = request.headers.get("x-api-key")
    if given is None:
        if not auth:
            raise ApiError(
                401,
                "missing API key: send `Authorization: Bearer YOUR_KEY` (or `x-api-key: YOUR_KEY`)",
                code="invalid_api_key",
            )
        scheme, _, given = auth.partition(" ")
        if scheme.lower() != "bearer":
            given = ""
    if not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "incorrect API key provided", code="invalid_api_key")


async def models(request: web.Request) -> web.Response:
    cfg: ApiConfig = request.app[CONFIG]
    return web.json_response({"object": "list", "data": [_model_card(cfg, request.app[STARTED])]})


def _model_card(cfg: ApiConfig, created: int) -> dict:
    return {"id": cfg.model_name, "object": "model", "created": created, "owned_by": "p2pk3"}


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "pid": os.getpid()})  # pid: whose API answers (background.py)


async def metrics(request: web.Request) -> web.Response:
    entry_status = getattr(request.app[CLUSTER], "entry_status", None)  # the entry's queue, if it answers
    if entry_status is not None:
        request.app[METRICS].observe_entry(await entry_status())
    body, ctype = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": ctype})


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    t_arrival = time.perf_counter()
    app = request.app
    cfg: ApiConfig = app[CONFIG]
    req = parse_request(await json_body(request), kind, app[PROMPTS].context_len)
    check_model(cfg, req.model)
    if req.stream and req.echo and req.logprobs is not None:
        raise bad_param("echo", "echo with logprobs is not supported when streaming (prompt logprobs come at the end)")
    gen, shape = await start_generation(request, req, t_arrival)
    meta = {
        "id": ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12),
        "created": int(time.time()),
        "model": cfg.model_name,
    }
    app[METRICS].in_flight.inc()
    try:
        async with gen:
            if req.stream:
                return await _stream(request, req, gen, shape, meta)
            async for piece in gen.pieces():
                if shape is not None:
                    shape.feed(piece)
            if shape is not None:
                shape.finish()
            return web.json_response(_full_response(kind, gen, shape, meta, req, app))
    finally:
        app[METRICS].in_flight.dec()


def _lp_fmt():
    from . import logprobs  # torch (agent/logprobs.py): loaded for the first request with logprobs only

    return logprobs


def _vocab(app):
    if VOCAB not in app:
        app[VOCAB] = _lp_fmt().Vocab.of(app[PROMPTS].tok)
    return app[VOCAB]


def _prompt_text(app, req: GenRequest) -> str:
    if isinstance(req.prompt, str):
        return req.prompt
    return app[PROMPTS].tok.decode(list(req.prompt))


def _full_response(kind: str, gen: Generation, shape: AnswerShaper | None, meta: dict, req: GenRequest, app) -> dict:
    if kind == "chat":
        choice = {
            "index": 0,
            "message": shape.message(),
            "logprobs": _lp_fmt().chat_choice(gen, _vocab(app)) if req.logprobs is not None else None,
            "finish_reason": shape.finish_reason(gen.finish_reason),
        }
        obj = "chat.completion"
    else:
        prompt = _prompt_text(app, req) if req.echo or req.logprobs is not None else ""
        lps = None
        if req.logprobs is not None:
            lps = _lp_fmt().completion_choice(gen, _vocab(app), req.echo, 0 if req.echo else len(prompt))
        text = prompt + gen.text if req.echo else gen.text
        choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": gen.finish_reason}
        obj = "text_completion"
    return {**meta, "object": obj, "choices": [choice], "usage": gen.usage(), "system_fingerprint": None}


async def _stream(
    request: web.Request, req: GenRequest, gen: Generation, shape: AnswerShaper | None, meta: dict
) -> web.StreamResponse:
    chat = req.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if req.include_usage else {}
    offset = [len(_prompt_text(request.app, req))] if not chat and req.logprobs is not None else [0]

    def logprobs(text: str | None):
        """The logprobs of the tokens not yet sent (the chunk that goes out now carries them)."""
        if req.logprobs is None:
            return None
        entries = gen.take_logprobs()
        if text is None and not entries:
            return None
        if chat:
            return _lp_fmt().chat_delta(entries, _vocab(request.app))
        d = _lp_fmt().completion_delta(entries, _vocab(request.app), offset[0])
        offset[0] += len(text or "")
        return d

    def chunk(delta: dict | str | None, finish: str | None = None, first: bool = False) -> dict:
        if chat:
            lps = None if first else logprobs(delta.get("content", "") if delta else None)
            c = {"index": 0, "delta": delta or {}, "logprobs": lps, "finish_reason": finish}
        else:
            c = {"index": 0, "text": delta or "", "logprobs": logprobs(delta), "finish_reason": finish}
        return {**meta, "object": obj, "system_fingerprint": None, "choices": [c], **extra}

    def chunks(piece: str) -> list[dict]:
        if not chat:
            return [chunk(piece)] if piece else []
        return [chunk(d) for d in shape.feed(piece)]

    pieces = gen.pieces()
    try:
        sse, first = await SSE.after_first(request, pieces)
        if chat:
            await sse.send(chunk({"role": "assistant", "content": ""}, first=True))
        elif req.echo:
            await sse.send(chunk(_prompt_text(request.app, req)))
        try:
            for c in chunks(first or ""):
                await sse.send(c)
            async for piece in pieces:
                for c in chunks(piece):
                    await sse.send(c)
        except ApiError as e:  # the cluster failed mid-stream: an error event (as OpenAI does), then the end
            await sse.send(e.body())
            await sse.done()
            return sse.response
        if chat:
            for d in shape.finish():
                await sse.send(chunk(d))
        finish = shape.finish_reason(gen.finish_reason, streamed=True) if chat else gen.finish_reason
        await sse.send(chunk(None, finish))
        if req.include_usage:
            await sse.send({**meta, "object": obj, "system_fingerprint": None, "choices": [], "usage": gen.usage()})
        await sse.done()
        return sse.response
    finally:
        await pieces.aclose()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


def create_app(cluster, prompts: PromptBuilder, config: ApiConfig) -> web.Application:
    """The aiohttp application. `cluster`: an object with `async generate(prompt, params, on_token)`
    (p2pk3.api.cluster.Cluster); `prompts`: the model's PromptBuilder (its context length bounds requests)."""
    app = web.Application(middlewares=[_errors_and_metrics], client_max_size=MAX_BODY)
    app[CONFIG], app[CLUSTER], app[PROMPTS] = config, cluster, prompts
    app[FORMATS] = AnswerFormats(prompts.tok)
    app[METRICS] = ApiMetrics()
    app[STARTED] = int(time.time())
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", anthropic.messages)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app

"""The OpenAI-compatible HTTP API (aiohttp): routes, auth, errors, SSE streaming.

    GET  /v1/models             the one model this cluster serves
    POST /v1/chat/completions   chat (messages -> the checkpoint's chat template), streaming or not
    POST /v1/completions        plain completion of a prompt (text after BOS, or token ids)

Prompts and sampling defaults come from p2pk3/frontends/prompt.py, as in every front end.
    GET  /metrics               Prometheus metrics (no auth: scrapers rarely carry keys; no secrets in it)
    GET  /health                200 while the server runs

With an API key every /v1 route needs `Authorization: Bearer KEY` (401 otherwise). Errors are in OpenAI's
shape `{"error": {"message", "type", "param", "code"}}`: 400 invalid body (param names the field), 401,
404 unknown model or route, 429 the cluster is busy, 503 a stage is down or no entry answers.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass

from aiohttp import web

from p2pk3.frontends.prompt import Prompt, PromptBuilder, PromptError

from .errors import ApiError, bad_param
from . import logprobs as lp_fmt
from .generation import Generation
from .metrics import ApiMetrics
from .schema import GenRequest, parse_request
from .sse import SSE

log = logging.getLogger("p2pk3.api")

MAX_BODY = 16 << 20


@dataclass
class ApiConfig:
    model_name: str
    api_key: str | None = None


CONFIG = web.AppKey("config", ApiConfig)
CLUSTER = web.AppKey("cluster", object)
PROMPTS = web.AppKey("prompts", PromptBuilder)
METRICS = web.AppKey("metrics", ApiMetrics)
STARTED = web.AppKey("started", int)
VOCAB = web.AppKey("vocab", object)  # lp_fmt.Vocab, made on the first request with logprobs
GRAMMAR = web.AppKey("grammar", object)  # the GrammarTokenizer checking response_format, made on first use


def _route_of(request: web.Request) -> str:
    info = request.match_info
    route = getattr(info, "route", None)
    res = getattr(route, "resource", None)
    return res.canonical if res is not None else "unmatched"


@web.middleware
async def _errors_and_metrics(request: web.Request, handler):
    app = request.app
    route = _route_of(request)
    try:
        cfg: ApiConfig = app[CONFIG]
        if cfg.api_key is not None and request.path.startswith("/v1/"):
            _check_key(request, cfg.api_key)
        resp = await handler(request)
    except (ConnectionResetError, asyncio.CancelledError):  # the client went away (the request is cancelled)
        app[METRICS].requests.labels(route, "499").inc()
        raise
    except ApiError as e:
        resp = e.response()
    except web.HTTPException as e:  # aiohttp's own (404 route, 405 method, 413 body too large)
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        resp = ApiError(
            e.status,
            e.reason if e.status != 404 else f"no route {request.method} {request.path}",
            type=kind,
            code=str(e.status),
        ).response()
    except Exception:  # a bug of ours: 500 in OpenAI's shape, the server keeps running
        log.exception("unexpected error serving %s %s", request.method, request.path)
        resp = ApiError(500, "internal server error (see the server's log)", type="server_error").response()
    app[METRICS].requests.labels(route, str(resp.status)).inc()
    return resp


def _check_key(request: web.Request, key: str) -> None:
    auth = request.headers.get("Authorization", "")
    if not auth:
        raise ApiError(401, "missing API key: send `Authorization: Bearer YOUR_KEY`", code="invalid_api_key")
    scheme, _, given = auth.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise ApiError(401, "incorrect API key provided", code="invalid_api_key")


async def _json_body(request: web.Request):
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


async def models(request: web.Request) -> web.Response:
    cfg: ApiConfig = request.app[CONFIG]
    return web.json_response({"object": "list", "data": [_model_card(cfg, request.app[STARTED])]})


def _model_card(cfg: ApiConfig, created: int) -> dict:
    return {"id": cfg.model_name, "object": "model", "created": created, "owned_by": "p2pk3"}


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "pid": os.getpid()})  # pid: whose API answers (background.py)


async def metrics(request: web.Request) -> web.Response:
    body, ctype = request.app[METRICS].render()
    return web.Response(body=body, headers={"Content-Type": ctype})


def _prompt(app, req: GenRequest) -> Prompt:
    """The request's prompt ids and sampling parameters, through the path every front end takes."""
    prompts: PromptBuilder = app[PROMPTS]
    try:
        if req.kind == "chat":
            return prompts.chat(req.messages, req.sampling, tools=req.tools)
        if isinstance(req.prompt, str):
            return prompts.text(req.prompt, req.sampling)
        return prompts.tokens(req.prompt, req.sampling)
    except PromptError as e:
        if e.field == "prompt":
            raise bad_param("messages" if req.kind == "chat" else "prompt", str(e)) from None
        if e.field == "max_tokens":
            raise bad_param(req.max_tokens_field, str(e)) from None
        raise bad_param(e.field, str(e)) from None


async def _generate(request: web.Request, kind: str) -> web.StreamResponse:
    t_arrival = time.perf_counter()
    app = request.app
    cfg: ApiConfig = app[CONFIG]
    req = parse_request(await _json_body(request), kind, app[PROMPTS].context_len)
    if req.model is not None and req.model != cfg.model_name:
        raise ApiError(
            404,
            f"the model `{req.model}` does not exist (this server has `{cfg.model_name}`)",
            param="model",
            code="model_not_found",
        )
    p = _prompt(app, req)
    _check_grammar(app, req)
    if req.stream and req.echo and req.logprobs is not None:
        raise bad_param("echo", "echo with logprobs is not supported when streaming (prompt logprobs come at the end)")
    route = _route_of(request)
    gen = Generation(app[CLUSTER], app[PROMPTS].tok, p.ids, p.params, req.stop, app[METRICS], route, t_arrival)
    meta = {
        "id": ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12),
        "created": int(time.time()),
        "model": cfg.model_name,
    }
    app[METRICS].in_flight.inc()
    try:
        async with gen:
            if req.stream:
                return await _stream(request, req, gen, meta)
            async for _ in gen.pieces():
                pass
            return web.json_response(_full_response(kind, gen, meta, req, app))
    finally:
        app[METRICS].in_flight.dec()


def _vocab(app) -> lp_fmt.Vocab:
    if VOCAB not in app:
        app[VOCAB] = lp_fmt.Vocab.of(app[PROMPTS].tok)
    return app[VOCAB]


def _check_grammar(app, req: GenRequest) -> None:
    """response_format compiled here once, so a schema the engine refuses is a 400 naming the field."""
    if req.response_format is None:
        return
    from p2pk3.agent.grammar import GrammarError, GrammarMatcher, GrammarTokenizer

    if GRAMMAR not in app:
        app[GRAMMAR] = GrammarTokenizer(app[PROMPTS].tok)
    try:
        GrammarMatcher(app[GRAMMAR], req.response_format)
    except GrammarError as e:
        raise bad_param("response_format", str(e)[:500]) from None


def _prompt_text(app, req: GenRequest) -> str:
    if isinstance(req.prompt, str):
        return req.prompt
    return app[PROMPTS].tok.decode(list(req.prompt))


def _full_response(kind: str, gen: Generation, meta: dict, req: GenRequest, app) -> dict:
    if kind == "chat":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": gen.text},
            "logprobs": lp_fmt.chat_choice(gen, _vocab(app)) if req.logprobs is not None else None,
            "finish_reason": gen.finish_reason,
        }
        obj = "chat.completion"
    else:
        prompt = _prompt_text(app, req) if req.echo or req.logprobs is not None else ""
        lps = None
        if req.logprobs is not None:
            lps = lp_fmt.completion_choice(gen, _vocab(app), req.echo, 0 if req.echo else len(prompt))
        text = prompt + gen.text if req.echo else gen.text
        choice = {"index": 0, "text": text, "logprobs": lps, "finish_reason": gen.finish_reason}
        obj = "text_completion"
    return {**meta, "object": obj, "choices": [choice], "usage": gen.usage(), "system_fingerprint": None}


async def _stream(request: web.Request, req: GenRequest, gen: Generation, meta: dict) -> web.StreamResponse:
    chat = req.kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    extra = {"usage": None} if req.include_usage else {}

    offset = [len(_prompt_text(request.app, req))] if not chat and req.logprobs is not None else [0]

    def logprobs(piece: str | None):
        if req.logprobs is None:
            return None
        entries = gen.take_logprobs()
        if piece is None and not entries:
            return None
        if chat:
            return lp_fmt.chat_delta(entries, _vocab(request.app))
        d = lp_fmt.completion_delta(entries, _vocab(request.app), offset[0])
        offset[0] += len(piece or "")
        return d

    def chunk(piece: str | None, finish: str | None = None, first: bool = False) -> dict:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else ({} if piece is None else {"content": piece})
            c = {"index": 0, "delta": delta, "logprobs": logprobs(piece), "finish_reason": finish}
        else:
            c = {"index": 0, "text": piece or "", "logprobs": logprobs(piece), "finish_reason": finish}
        return {**meta, "object": obj, "system_fingerprint": None, "choices": [c], **extra}

    pieces = gen.pieces()
    try:
        return await _send_stream(request, req, gen, pieces, chunk, meta, obj)
    finally:
        await pieces.aclose()


async def _send_stream(request, req: GenRequest, gen: Generation, pieces, chunk, meta: dict, obj: str):
    chat = req.kind == "chat"
    try:
        first = await pieces.__anext__()  # errors before the first token are still a plain HTTP error
    except StopAsyncIteration:
        first = None
    sse = SSE(request)
    await sse.open()
    if chat:
        await sse.send(chunk(None, first=True))
    elif req.echo:
        await sse.send(chunk(_prompt_text(request.app, req)))
    try:
        if first:
            await sse.send(chunk(first))
        async for piece in pieces:
            if piece:
                await sse.send(chunk(piece))
    except ApiError as e:  # the cluster failed mid-stream: an error event (as OpenAI does), then the end
        await sse.send(e.body())
        await sse.done()
        return sse.response
    await sse.send(chunk(None, gen.finish_reason))
    if req.include_usage:
        await sse.send({**meta, "object": obj, "system_fingerprint": None, "choices": [], "usage": gen.usage()})
    await sse.done()
    return sse.response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


def create_app(cluster, prompts: PromptBuilder, config: ApiConfig) -> web.Application:
    """The aiohttp application. `cluster`: an object with `async generate(prompt, params, on_token)`
    (p2pk3.api.cluster.Cluster); `prompts`: the model's PromptBuilder (its context length bounds requests)."""
    app = web.Application(middlewares=[_errors_and_metrics], client_max_size=MAX_BODY)
    app[CONFIG], app[CLUSTER], app[PROMPTS] = config, cluster, prompts
    app[METRICS] = ApiMetrics()
    app[STARTED] = int(time.time())
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    return app

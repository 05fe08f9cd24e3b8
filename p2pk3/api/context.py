"""What the API's routes share: the application's keys (config, cluster, prompts, answer formats, metrics),
the JSON body, the model check, and `start_generation`: a validated request (`schema.GenRequest`) -> the
`Generation` that runs it and, for chat, the `AnswerShaper` of its answer. The OpenAI routes (app.py) and
the Anthropic Messages route (anthropic.py) both generate through it, so a request means the same prompt,
sampling and grammar whichever API it came by."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from aiohttp import web

from p2pk3.frontends.prompt import Prompt, PromptBuilder, PromptError

from .answer import AnswerFormats, AnswerShaper, with_grammar
from .errors import ApiError, bad_param
from .generation import Generation
from .metrics import ApiMetrics
from .schema import GenRequest

__all__ = [
    "ApiConfig",
    "CONFIG",
    "CLUSTER",
    "PROMPTS",
    "FORMATS",
    "METRICS",
    "STARTED",
    "route_of",
    "json_body",
    "check_model",
    "start_generation",
]


@dataclass
class ApiConfig:
    model_name: str
    api_key: str | None = None


CONFIG = web.AppKey("config", ApiConfig)
CLUSTER = web.AppKey("cluster", object)
PROMPTS = web.AppKey("prompts", PromptBuilder)
FORMATS = web.AppKey("formats", AnswerFormats)
METRICS = web.AppKey("metrics", ApiMetrics)
STARTED = web.AppKey("started", int)


def route_of(request: web.Request) -> str:
    info = request.match_info
    route = getattr(info, "route", None)
    res = getattr(route, "resource", None)
    return res.canonical if res is not None else "unmatched"



async def json_body(request: web.Request):
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None



def prompt_of(app, req: GenRequest) -> Prompt:
    """The request's prompt ids and sampling parameters, through the path every front end takes."""
    prompts: PromptBuilder = app[PROMPTS]
    try:
        if req.kind == "chat":
            template_vars = {"reasoning_effort": req.reasoning_effort} if req.reasoning_effort else None
            return prompts.chat(req.messages, req.sampling, tools=req.tools, template_vars=template_vars)
        if isinstance(req.prompt, str):
            return prompts.text(req.prompt, req.sampling)
        return prompts.tokens(req.prompt, req.sampling)
    except PromptError as e:
        if e.field == "prompt":
            raise bad_param("messages" if req.kind == "chat" else "prompt", str(e)) from None
        if e.field == "max_tokens":
            raise bad_param(req.max_tokens_field, str(e)) from None
        raise bad_param(e.field, str(e)) from None


def check_model(cfg: ApiConfig, model: str | None) -> None:
    if model is not None and model != cfg.model_name:
        raise ApiError(
            404,
            f"the model `{model}` does not exist (this server has `{cfg.model_name}`)",
            param="model",
            code="model_not_found",
        )


async def start_generation(
    request: web.Request, req: GenRequest, t_arrival: float
) -> tuple[Generation, AnswerShaper | None]:
    """The request's Generation (not started) and, for chat, the shaper of its answer. tool_choice required /
    named becomes the grammar the last stage samples under (instead of a response_format's); a grammar is
    compiled here first, so one that cannot be enforced (no tool-call tokens, a schema the engine refuses) is
    a 400 naming tool_choice or response_format."""
    app = request.app
    p = prompt_of(app, req)
    params, shape, lark = p.params, None, None
    if req.kind == "chat":
        formats = app[FORMATS]
        shape = formats.shaper(req.tools, req.tool_choice, p.ids, req.parallel_tool_calls)
        try:
            lark = formats.forced_grammar(
                req.tools, req.tool_choice, req.parallel_tool_calls, p.ids, req.reasoning_effort
            )
        except ValueError as e:  # GrammarError
            raise bad_param("tool_choice", str(e)) from None
        if lark is not None:  # the answer is the calls: a response_format applies to content, which has none
            params = with_grammar(params, lark)
    if params.grammar is not None:
        field = "tool_choice" if req.kind == "chat" and lark is not None else "response_format"
        try:
            await asyncio.to_thread(app[FORMATS].check_grammar, params.grammar)
        except ValueError as e:  # GrammarError: a schema the engine refuses
            raise bad_param(field, str(e)[:500]) from None
    gen = Generation(
        app[CLUSTER],
        app[PROMPTS].tok,
        p.ids,
        params,
        req.stop,
        app[METRICS],
        route_of(request),
        t_arrival,
        keep_ids=shape.keep_ids if shape else frozenset(),
    )
    return gen, shape

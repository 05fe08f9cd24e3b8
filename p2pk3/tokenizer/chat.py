"""The chat front end of a checkpoint: its tokenizer, its own chat template, its stop ids, its defaults.

    tok = ChatTokenizer.from_pretrained(model_dir)           # prefer="tiktoken" | "hf" as load_tokenizer
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tools=None)   # -> list[int]
    text = tok.render(messages, add_generation_prompt=True, tools=None)              # -> str
    tok.encode(text), tok.decode(ids, skip_special=False)
    tok.stop_ids                  # tuple[int, ...]: generation_config eos ids, eos_token, end-of-turn token
    tok.generation_defaults       # GenerationDefaults (generation_config.json; built-in when missing)
    dec = tok.stream_decoder()    # StreamDecoder: push(id) -> complete text only, flush() -> rest

`messages` are dicts (`role`, `content`, optionally `name`, `tool_calls`, `reasoning_content`, ...),
`tools` None or a list of JSON-schema dicts; extra keyword arguments (e.g. `thinking=True`) become
template variables. Both methods take `template_name=` to pick one of several named templates.

The template is the checkpoint's own, found as transformers finds it: `chat_template.jinja` (plus named
ones in `additional_chat_templates/*.jinja`) if present, else `chat_template` of `tokenizer_config.json`
(a string, or a list of {"name", "template"}); with several, "tool_use" when tools are given, else
"default". Only a checkpoint with none gets the built-in K3 template (`bpe.CHAT_TEMPLATE`). It is rendered
as transformers' `apply_chat_template` renders it: `ImmutableSandboxedEnvironment(trim_blocks=True,
lstrip_blocks=True)` with the loopcontrols extension and the `{% generation %}` tag, transformers'
`tojson` filter (no HTML escaping, ensure_ascii=False by default), the `raise_exception` and
`strftime_now` globals, variables `messages`, `tools`, `documents` (None), `add_generation_prompt` and
the named special tokens of tokenizer_config (`bos_token`, `eos_token`, `unk_token`, `sep_token`,
`pad_token`, `cls_token`, `mask_token`; strings or {"content": ...} dicts). As transformers 5 does,
message keys whose value is None are dropped and `reasoning_content` / `thinking` / `reasoning` are
aliased to each other. `render` returns exactly transformers' string; a template that fails (syntax,
`raise_exception`, ...) raises ChatTemplateError naming the file.

Ids: the rendered text is split at the special tokens the *template* wrote; those become their ids and the
text between is encoded as plain text. Special-token strings inside the caller's strings (message
contents, tools, extra variables) stay plain text (`sanitize=True`, the default; transformers'
`sanitize_control_tokens` idea): they are wrapped in private-use marker characters before rendering and
recognised afterwards, so a user cannot inject `<|im_end|>`. `sanitize=False` gives transformers'
default (every special-token string in the rendered text is a special token). Limitation: a template that
serialises user strings with `tojson(ensure_ascii=True)` escapes the markers, so special-token strings
there are treated as special tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from .bpe import CHAT_TEMPLATE, IM_END
from .detok import StreamDecoder
from .generation import GenerationDefaults, load_generation_defaults

__all__ = ["ChatTokenizer", "ChatTemplateError", "compile_chat_template", "BUILTIN_TEMPLATE_SOURCE"]

BUILTIN_TEMPLATE_SOURCE = "built-in K3 template (p2pk3.tokenizer.bpe.CHAT_TEMPLATE)"
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Private-use characters around special-token strings found in the caller's strings (see the module doc).
_MARK_START, _MARK_END = "\U000f0d70", "\U000f0d71"


class ChatTemplateError(ValueError):
    """A chat template that does not compile or fails while rendering; the message names its file."""


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: plain json.dumps (jinja's own tojson HTML-escapes and takes only indent)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


_ENV = None


def _env():
    global _ENV
    if _ENV is None:
        import jinja2
        import jinja2.ext
        from jinja2 import nodes
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class GenerationTag(jinja2.ext.Extension):
            """`{% generation %}...{% endgeneration %}` (transformers marks assistant tokens with it): the body."""

            tags = {"generation"}

            def parse(self, parser):
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

            def _body(self, caller):
                return caller()

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = _strftime_now
        _ENV = env
    return _ENV


def compile_chat_template(source: str, origin: str = "chat template"):
    """A jinja2 Template of `source` in the transformers-compatible sandbox. `origin` names the file in
    errors."""
    import jinja2

    try:
        return _env().from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"{origin}: chat template does not compile (template line {e.lineno}): {e.message}"
        ) from e


def _token_str(v) -> str | None:
    """A special token of tokenizer_config: a string or an AddedToken dict {"content": ...}."""
    if isinstance(v, Mapping):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _load_templates(d: Path, config: dict) -> dict[str, tuple[str, str]]:
    """name -> (template source, origin), in transformers' order of precedence (see the module doc)."""
    out: dict[str, tuple[str, str]] = {}
    f = d / "chat_template.jinja"
    if f.is_file():
        out["default"] = (f.read_text(encoding="utf-8"), str(f))
    extra = d / "additional_chat_templates"
    if extra.is_dir():
        for g in sorted(extra.glob("*.jinja")):
            out[g.name.removesuffix(".jinja")] = (g.read_text(encoding="utf-8"), str(g))
    if out:
        return out
    ct = config.get("chat_template")
    origin = str(d / "tokenizer_config.json")
    if isinstance(ct, str):
        return {"default": (ct, origin)}
    if isinstance(ct, list):
        for i, t in enumerate(ct):
            if not (isinstance(t, Mapping) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)):
                raise ChatTemplateError(f"{origin}: chat_template[{i}] must be {{'name': str, 'template': str}}")
            out[t["name"]] = (t["template"], f"{origin} (chat_template {t['name']!r})")
        return out
    if isinstance(ct, Mapping):
        return {k: (v, f"{origin} (chat_template {k!r})") for k, v in ct.items()}
    if ct is not None:
        raise ChatTemplateError(
            f"{origin}: chat_template must be a string or a list of templates, got {type(ct).__name__}"
        )
    return {"default": (CHAT_TEMPLATE, BUILTIN_TEMPLATE_SOURCE)}


def _mark(obj, pattern: re.Pattern):
    """Copy of obj with every special-token string in its strings wrapped in the private markers (markers
    already in the strings are removed first, so they cannot be forged). Dict keys are left alone."""
    if isinstance(obj, str):
        obj = obj.replace(_MARK_START, "").replace(_MARK_END, "")
        return pattern.sub(lambda m: _MARK_START + m.group(0) + _MARK_END, obj)
    if isinstance(obj, Mapping):
        return {k: _mark(v, pattern) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_mark(v, pattern) for v in obj]
    return obj


def _normalize_messages(messages: Sequence[Mapping]) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTokenizer:
    """A checkpoint's tokenizer with its chat template, stop ids and generation defaults (module doc)."""

    def __init__(
        self,
        tokenizer,
        templates: dict[str, tuple[str, str]],
        special_tokens: dict[str, str],
        generation_defaults: GenerationDefaults | None = None,
        extra_stop_ids: Sequence[int] = (),
    ):
        """tokenizer: a `p2pk3.tokenizer.Tokenizer`; templates: name -> (source, origin);
        special_tokens: template variables such as {"bos_token": "[BOS]"}."""
        self.tokenizer = tokenizer
        self.templates = dict(templates)
        self._compiled = {n: compile_chat_template(s, o) for n, (s, o) in self.templates.items()}
        self.special_tokens = dict(special_tokens)
        self.generation_defaults = generation_defaults or GenerationDefaults()
        sp = tokenizer.special
        alts = "|".join(re.escape(s) for s in sorted(sp, key=len, reverse=True)) or "(?!)"
        self._special_re = re.compile(alts)
        self._split_re = re.compile(f"{_MARK_START}({alts}){_MARK_END}|[{_MARK_START}{_MARK_END}]|({alts})")
        self.end_of_turn = self._find_end_of_turn()
        stop: list[int] = list(self.generation_defaults.eos_token_id)
        eos = sp.get(self.special_tokens.get("eos_token", ""))
        stop += [eos] if eos is not None else []
        stop += [sp[self.end_of_turn]] if self.end_of_turn else []
        stop += [int(i) for i in extra_stop_ids]
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys(stop))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, prefer: str | None = None) -> ChatTokenizer:
        """Tokenizer (as `load_tokenizer`), chat template(s), special tokens, generation_config.json of a
        model directory."""
        from . import load_tokenizer

        return cls.for_tokenizer(load_tokenizer(Path(model_dir), prefer=prefer))

    @classmethod
    def for_tokenizer(cls, tok) -> ChatTokenizer:
        """The ChatTokenizer of a loaded `Tokenizer`: the chat template(s), special tokens and
        generation_config.json of its directory."""
        d = Path(tok.directory)
        config = tok.config
        special_tokens = {k: s for k in NAMED_SPECIAL_TOKENS if (s := _token_str(config.get(k))) is not None}
        extra = config.get("stop_token_ids") or []  # p2pk3's own tokenizer_config field (bpe._config)
        if not (isinstance(extra, list) and all(isinstance(i, int) for i in extra)):
            raise ValueError(f"{d / 'tokenizer_config.json'}: stop_token_ids must be a list of ints, got {extra!r}")
        return cls(tok, _load_templates(d, config), special_tokens, load_generation_defaults(d), extra)

    # -- plain tokenizer ---------------------------------------------------------------------------------
    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, allow_special=allow_special)

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special=skip_special)

    def stream_decoder(self, skip_special: bool = True, keep: Collection[int] = ()) -> StreamDecoder:
        """A fresh StreamDecoder over this tokenizer (special tokens dropped from the text by default, except
        the ids in `keep`: the markers an answer parser reads, p2pk3/api/answer.py)."""
        tok = self.tokenizer
        if not skip_special or not keep:
            return StreamDecoder(lambda ids: tok.decode(ids, skip_special=skip_special))
        keep, specials = frozenset(keep), tok.id_to_special
        return StreamDecoder(lambda ids: tok.decode([i for i in ids if i in keep or i not in specials]))

    @property
    def special(self) -> dict[str, int]:
        return self.tokenizer.special

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def bos_id(self) -> int | None:
        return self.tokenizer.bos_id

    @property
    def eos_id(self) -> int | None:
        return self.tokenizer.eos_id

    @property
    def eos_ids(self) -> frozenset[int]:
        """`stop_ids` as a set (the name `Tokenizer` uses)."""
        return frozenset(self.stop_ids)

    # -- chat template -----------------------------------------------------------------------------------
    def template_for(self, tools=None, template_name: str | None = None) -> tuple[str, str]:
        """(name, origin) of the template used for these arguments, chosen as transformers chooses."""
        names = self.templates
        if template_name is not None:
            if template_name not in names:
                raise ValueError(f"no chat template named {template_name!r}; this checkpoint has {sorted(names)}")
            name = template_name
        elif len(names) == 1:
            name = next(iter(names))
        elif tools is not None and "tool_use" in names:
            name = "tool_use"
        elif "default" in names:
            name = "default"
        else:
            raise ValueError(
                f"this checkpoint has several chat templates and none is 'default'; pass "
                f"template_name= one of {sorted(names)}"
            )
        return name, names[name][1]

    def _render(self, messages, add_generation_prompt, tools, template_name, template_kwargs, mark: bool) -> str:
        if tools is not None and (isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence)):
            raise TypeError(f"tools must be None or a list of JSON-schema dicts, got {type(tools).__name__}")
        name, origin = self.template_for(tools, template_name)
        msgs = _normalize_messages(messages)
        tools = None if tools is None else list(tools)
        if mark:
            msgs, tools, template_kwargs = (_mark(x, self._special_re) for x in (msgs, tools, template_kwargs))
        variables = {**self.special_tokens, **template_kwargs}
        try:
            return self._compiled[name].render(
                messages=msgs, tools=tools, documents=None, add_generation_prompt=add_generation_prompt, **variables
            )
        except Exception as e:
            import jinja2

            kind = "raised" if type(e) is jinja2.TemplateError else f"failed ({type(e).__name__})"
            raise ChatTemplateError(f"{origin}: chat template {kind}: {e}") from e

    def render(
        self,
        messages: Sequence[Mapping],
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
        template_name: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text, exactly as transformers' `apply_chat_template(..., tokenize=False)`."""
        return self._render(messages, add_generation_prompt, tools, template_name, template_kwargs, mark=False)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping],
        add_generation_prompt: bool = True,
        tools: Sequence[dict] | None = None,
        template_name: str | None = None,
        sanitize: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """The prompt ids (see the module doc for how special tokens are told apart)."""
        text = self._render(messages, add_generation_prompt, tools, template_name, template_kwargs, mark=sanitize)
        return self._encode_rendered(text)

    def _encode_rendered(self, text: str) -> list[int]:
        ids: list[int] = []
        buf: list[str] = []
        pos = 0

        def flush():
            if buf:
                ids.extend(self.tokenizer.encode("".join(buf)))
                buf.clear()

        for m in self._split_re.finditer(text):
            buf.append(text[pos : m.start()])
            if m.group(1) is not None:  # a marked special-token string from the caller: text
                buf.append(m.group(1))
            elif m.group(2) is not None:  # a special token the template wrote
                flush()
                ids.append(self.tokenizer.special[m.group(2)])
            # else a lone marker (the template cut a marked string apart): dropped
            pos = m.end()
        buf.append(text[pos:])
        flush()
        return ids

    def _find_end_of_turn(self) -> str | None:
        """The special token the template writes right after an assistant reply (`<|im_end|>`,
        `<|eot_id|>`, ...): render a probe conversation and look. Falls back to `<|im_end|>` when the
        probe cannot be rendered and the template text contains it."""
        reply = "p2pk3 probe reply"
        probe = [{"role": "user", "content": "p2pk3 probe question"}, {"role": "assistant", "content": reply}]
        try:
            text = self.render(probe, add_generation_prompt=False)
        except Exception:
            text = None
        if text is not None and reply in text:
            after = text[text.rindex(reply) + len(reply) :]
            m = self._special_re.search(after)
            if m and not after[: m.start()].strip():
                return m.group(0)
            return None
        if IM_END in self.special and any(IM_END in s for s, _ in self.templates.values()):
            return IM_END
        return None

    def __repr__(self) -> str:
        return (
            f"<ChatTokenizer {self.tokenizer.backend} vocab={self.vocab_size} templates={sorted(self.templates)} "
            f"stop_ids={self.stop_ids}>"
        )

"""`tool_choice` "required" / a named function, enforced: a grammar of the checkpoint's own tool-call section.

    lark = tool_call_grammar(fmt, tools, tool_choice, special=gtok.special, parallel_tool_calls=True)
    m = GrammarMatcher(gtok, lark=lark, what="tool_choice")     # then as any matcher: apply, advance, ...

With `tool_choice` "required" the output must be one tool-call section (or, with `parallel_tool_calls`,
one or more calls) of the request's tools; with {"type": "function", "function": {"name": N}} every call is
N. Each call is written in the checkpoint's format (`toolcalls.ToolCallFormat`): call begin,
`functions.NAME:IDX`, argument begin, the arguments as JSON that follows that tool's `parameters` schema
(laid out as `json.dumps` writes it: ", " and ": " and no other whitespace), call end, all inside the
section markers when the format has them. Markers that are special tokens are matched as those token ids
(`<[id]>` in llguidance's Lark), so the text of a marker cannot stand in for it; markers that are plain
text are literals. After the section only a stop token may follow. "auto" and
"none" need no grammar (None). The output then parses with `toolcalls.parse_tool_calls` into valid calls.

A checkpoint that thinks (`reasoning`, a `reasoning.ReasoningFormat`) may think before it calls: with
`starts_inside` (the prompt opened the thinking section) the output is free text up to the end marker, then
the section; otherwise an optional begin ... end section may come first. The thinking text is not
constrained (only the end marker and what follows it are).

Called by the API (p2pk3/api/answer.py), when a request has tools and tool_choice required / named; the
grammar travels as SamplingParams.grammar {"type": "lark"} to the last stage.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from .grammar import GrammarError
from .toolcalls import ToolCallFormat

__all__ = ["tool_call_grammar", "chosen_tools"]


def chosen_tools(tools: Sequence[Mapping] | None, tool_choice) -> list[Mapping] | None:
    """The function objects a tool_choice forces (None: nothing forced, i.e. "auto", "none" or absent)."""
    if tool_choice in (None, "auto", "none"):
        return None
    fns = [t["function"] for t in tools or () if isinstance(t, Mapping) and isinstance(t.get("function"), Mapping)]
    if not fns:
        raise GrammarError(f"tool_choice {tool_choice!r} needs a non-empty tools list of functions")
    if tool_choice == "required":
        return fns
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        named = [f for f in fns if f.get("name") == name]
        if not named:
            raise GrammarError(
                f"tool_choice names {name!r}, which is not among the tools {[f.get('name') for f in fns]}"
            )
        return named[:1]
    raise GrammarError(
        f'tool_choice must be "auto", "none", "required" or {{"type": "function", "function": '
        f'{{"name": ...}}}}, got {tool_choice!r}'
    )


def _marker(text: str, special: Mapping[str, int]) -> str:
    return f"<[{special[text]}]>" if text in special else json.dumps(text)


def tool_call_grammar(
    fmt: ToolCallFormat,
    tools: Sequence[Mapping] | None,
    tool_choice,
    special: Mapping[str, int],
    parallel_tool_calls: bool = True,
    reasoning=None,
    starts_inside: bool = False,
) -> str | None:
    """The Lark grammar (llguidance dialect) of a forced tool-call section (module doc); None if nothing is
    forced. special: the tokenizer's special-token text -> id; reasoning: the checkpoint's ReasoningFormat
    (None: it does not think); starts_inside: the prompt ends with its begin marker."""
    if not fmt:
        raise GrammarError(f"tool_choice cannot be enforced: {fmt.reason}")
    fns = chosen_tools(tools, tool_choice)
    if fns is None:
        return None
    rules, alts = [], []
    for k, fn in enumerate(fns):
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError(f"tool {k} has no function name")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise GrammarError(f"tool {name!r}: parameters must be a JSON schema object")
        strict = bool(fn.get("strict", True))
        # the arguments in json.dumps's layout (", " and ": ", no other whitespace): what templates render
        # and clients send back, and a bound on a call's tokens (free whitespace let a model pad each gap)
        layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        schema = dict(params, **{"x-guidance": {**layout, "lenient": not strict}})
        rules.append(f"args_{k}: %json {json.dumps(schema)}")
        alts.append(f'"functions." {json.dumps(name)} ":" IDX {_marker(fmt.argument_begin, special)} args_{k}')
    body = " | ".join(f"({a})" for a in alts)
    call = f"call: {_marker(fmt.call_begin, special)} ({body}) {_marker(fmt.call_end, special)}"
    calls = "call+" if parallel_tool_calls else "call"
    section = (
        f"section: {_marker(fmt.section_begin, special)} {calls} {_marker(fmt.section_end, special)}"
        if fmt.section_begin
        else f"section: {calls}"
    )
    if reasoning is None:
        start = "start: section"
    elif starts_inside:
        start = f"start: THOUGHT {_marker(reasoning.end, special)} section"
    else:
        start = f"start: ({_marker(reasoning.begin, special)} THOUGHT {_marker(reasoning.end, special)})? section"
    thought = ["THOUGHT: /(?s:.*)/"] if reasoning is not None else []
    return "\n".join([start, section, call, "IDX: /[0-9]{1,4}/", *thought, *rules]) + "\n"

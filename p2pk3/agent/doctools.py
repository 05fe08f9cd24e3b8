"""The two documentation tools of the demo model: `python_doc(name)` and `man_page(name)`.

    tools = DocTools.load(model_dir)        # reads doc_index.json shipped beside the weights
    tools.schemas                           # the OpenAI `tools` list of the two functions
    tools.call("python_doc", '{"name": "os.path.join"}')   # -> the entry's text (or why there is none)

The index holds, per tool, a short entry for each name the documents define: a Python object's or
module's first paragraph (`python_doc`), a manual page's one-line summary and first DESCRIPTION paragraph
(`man_page`, keyed by page name; a name with pages in several sections answers with all of them, so the
caller needs no section number). The training conversations of tools/train_docs.py show the tool results
this class returns, and `p2pk3 chat --tools docs` answers the model's calls with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DocTools", "INDEX_FILE", "SCHEMAS", "MAX_RESULT_CHARS"]

INDEX_FILE = "doc_index.json"
MAX_RESULT_CHARS = 600

SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": "python_doc",
            "description": "Look up a Python name in the Python documentation.",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "man_page",
            "description": "Read a Linux manual page.",
            "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        },
    },
]


@dataclass
class DocTools:
    """Answers `python_doc` / `man_page` calls from an index {tool: {name: text}} (module doc)."""

    index: dict[str, dict[str, str]]

    @classmethod
    def load(cls, model_dir: str | Path) -> "DocTools":
        path = Path(model_dir) / INDEX_FILE
        if not path.is_file():
            raise FileNotFoundError(
                f"{path}: this model ships no documentation index, so --tools docs cannot answer "
                "(the embedded k3-docs model has one; pass --model-dir of a model that has doc_index.json)"
            )
        return cls(json.loads(path.read_text()))

    @property
    def schemas(self) -> list[dict]:
        return SCHEMAS

    def lookup(self, tool: str, name: str) -> str:
        """The entry text for `name` (exact, then case-insensitive, then the last dotted part), or a
        sentence saying there is none (the model sees that as the tool's result)."""
        table = self.index.get(tool)
        if table is None:
            return f"error: unknown tool {tool!r} (tools: {', '.join(sorted(self.index))})"
        name = name.strip().strip("`").removesuffix("()")
        if name in table:
            return table[name][:MAX_RESULT_CHARS]
        low = {k.lower(): k for k in table}
        if name.lower() in low:
            return table[low[name.lower()]][:MAX_RESULT_CHARS]
        tail = [k for k in table if k.rsplit(".", 1)[-1] == name]
        if len(tail) == 1:
            return table[tail[0]][:MAX_RESULT_CHARS]
        return f"No entry for {name!r}."

    def call(self, tool: str, arguments: str | dict) -> str:
        """Run one call: `arguments` the JSON object text the model wrote (or a parsed dict)."""
        try:
            args = json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
        except json.JSONDecodeError as e:
            return f"error: the arguments are not JSON ({e.msg} at {e.pos})"
        if not isinstance(args, dict) or not isinstance(args.get("name"), str):
            return 'error: call with {"name": "..."}'
        return self.lookup(tool, args["name"])

"""A copy of the embedded model that has the tool-call and thinking tokens of a Kimi checkpoint.

    model_dir = agent_checkpoint(tmp_path)      # weights linked, tokenizer and template rewritten

The embedded model's tokenizer names Kimi's tool-call section / call / argument tokens and `<think>`
`</think>` at Kimi's offsets (p2pk3.tokenizer.bpe; a checkpoint from before they were named has reserved
slots there, which the copy renames), and its template renders tools, tool calls and results, but its
generation prompt never opens a thinking section. The copy's template is the same plus that: the generation
prompt opens `<think>` when `reasoning_effort` asks for thinking. The weights are the embedded model's
(linked, not copied); it was never taught to think, and tests that need a tool call force it with
tool_choice required / named rather than rely on what it learned.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from p2pk3.engine.reference import default_model_dir

SB, SE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
THINK, UNTHINK = "<think>", "</think>"
RENAMED = {11: SB, 12: SE, 13: CB, 14: AB, 15: CE, 22: THINK, 23: UNTHINK}  # special slot -> name (Kimi's)

TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if m.get('reasoning_content') -%}<think>{{ m['reasoning_content'] }}</think>{%- endif -%}"
    "{{ m.get('content') or '' }}"
    "{%- if m.get('tool_calls') -%}<|tool_calls_section_begin|>{%- for tc in m['tool_calls'] -%}"
    "<|tool_call_begin|>{{ tc['id'] }}<|tool_call_argument_begin|>{{ tc['function']['arguments'] }}"
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>"
    "{%- elif m['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>## Return of {{ m['tool_call_id'] }}\n"
    "{{ m['content'] }}<|im_end|>"
    "{%- elif m['role'] == 'system' -%}<|im_system|>system<|im_middle|>{{ m['content'] }}<|im_end|>"
    "{%- else -%}<|im_user|>user<|im_middle|>{{ m['content'] }}<|im_end|>{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if reasoning_effort is defined and reasoning_effort and reasoning_effort != 'none' -%}<think>{%- endif -%}"
    "{%- endif -%}"
)


def agent_checkpoint(dst: str | os.PathLike) -> Path:
    """The embedded model in `dst`, its tokenizer given Kimi's tool-call and thinking tokens (module doc)."""
    src, dst = default_model_dir(), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            (dst / f.name).symlink_to(f)
        elif f.name != "p2pk3-manifest.json":  # its hashes are the original tokenizer's
            shutil.copy(f, dst / f.name)
    old = {f"<|reserved_token_{i}|>": name for i, name in RENAMED.items()}
    tj = json.loads((dst / "tokenizer.json").read_text())
    for t in tj["added_tokens"]:
        t["content"] = old.get(t["content"], t["content"])
    (dst / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))
    tc = json.loads((dst / "tokenizer_config.json").read_text())
    for t in tc["added_tokens_decoder"].values():
        t["content"] = old.get(t["content"], t["content"])
    tc["chat_template"] = TEMPLATE
    (dst / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False))
    return dst

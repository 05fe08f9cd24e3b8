"""The model card (README.md) of the embedded demo model, from the numbers tools/eval_demo.py measured."""

from __future__ import annotations

import json
from pathlib import Path

from p2pk3.model.config import K3Config

from tools.trainlib import lineage


def _q_rows(qs: list[dict]) -> str:
    rows = []
    for q in qs:
        a = " ".join(q["answer"].split()).replace("|", "\\|")
        rows.append(f"| {q['kind']} | {q['question']} | {a[:300]} | {q['score']:.2f} |")
    return "\n".join(rows)


def architecture_table(c: K3Config) -> str:
    """The markdown table of a small K3's shapes beside Kimi K3's (both model cards)."""
    mla1 = [i + 1 for i, t in enumerate(c.layer_types) if t == "mla"]
    return f"""| | this model | Kimi K3 |
|---|---|---|
| layers | {c.num_hidden_layers} (MLA at 1-indexed {mla1}, KDA elsewhere) | 93 (MLA at 4, 8, ..., 92, 93) |
| hidden | {c.hidden_size} | 7168 |
| KDA | {c.kda_num_heads} heads x {c.kda_head_dim}, conv {c.kda_conv_size}, gate lower bound {c.kda_gate_lower_bound}, full-rank output gate | 96 x 128 |
| gated MLA (NoPE) | {c.num_attention_heads} heads, q_lora {c.q_lora_rank}, kv_lora {c.kv_lora_rank}, nope {c.qk_nope_head_dim} + rope-slot {c.qk_rope_head_dim}, v {c.v_head_dim} | 96 heads, 1536 / 512, 128 + 64, 128 |
| dense layer 0 | SiTU-GLU {c.intermediate_size} | 33792 |
| Stable LatentMoE | {c.num_experts} experts, top-{c.num_experts_per_token}, latent {c.routed_expert_hidden_size}, expert width {c.moe_intermediate_size}, {c.num_shared_experts} shared, sigmoid router + correction bias | 896, top-16, 3584, 3072, 2 shared |
| AttnRes | block size {c.attn_res_block_size} | 12 |
| vocab | {c.vocab_size} (byte-level BPE, 32 special slots laid out like Kimi's) | 163840 |
| routed experts on disk | MXFP4 (compressed-tensors `mxfp4-pack-quantized`) | same |"""


def sampling_line(out_dir: Path) -> str:
    """The card's line on the sampling defaults, from the model's generation_config.json as it is now."""
    gen = json.loads((Path(out_dir) / "generation_config.json").read_text())
    defaults = (
        f"temperature {gen.get('temperature')}, top_p {gen.get('top_p')}" if gen.get("do_sample") else "greedy"
    ) + f", repetition penalty {gen.get('repetition_penalty', 1.0)}"
    if gen.get("frequency_penalty"):
        defaults += f", frequency penalty {gen['frequency_penalty']}"
    return f"`generation_config.json`: {defaults}"


def refresh_sampling_line(out_dir: str | Path) -> bool:
    """After tools/tune_defaults.py --write changed generation_config.json: the card says the new defaults.
    False when the card has no such line (a card of another layout)."""
    card = Path(out_dir) / "README.md"
    if not card.exists():
        return False
    lines = card.read_text().split("\n")
    for i, line in enumerate(lines):
        if line.startswith("`generation_config.json`: "):
            _, sep, rest = line.partition(", chosen by measurement")
            lines[i] = sampling_line(Path(out_dir)) + sep + rest
            card.write_text("\n".join(lines))
            return True
    return False


# tools/train_docs.py's defaults of the options a run's command line names only when it set them otherwise
_DEFAULTS = {
    "steps": None,
    "chat_steps": None,
    "lr": 3e-3,
    "chat_lr": 1e-3,
    "warmup": 50,
    "chat_batch": None,
    "chat_seq": None,
    "renamed_copies": 0,
    "unquoted_copies": 0,
    "repeat_share": 0.0,
    "fresh_init": "train",
    "redraw": None,
}


def repeat_line(a: dict) -> str:
    share = a.get("repeat_share") or 0
    return f", {share:.0%} of the text rows a passage written twice (a copy task)" if share else ""


def renamed_line(a: dict) -> str:
    n = a.get("renamed_copies") or 0
    u = a.get("unquoted_copies") or 0
    line = f"; the tool conversations and self-naming answers {n}x again about made-up names" if n else ""
    return line + (f"; those about man pages and modules {u}x more, real and made-up names" if u else "")


def phase1_line(a: dict, tr: dict) -> str:
    """Phase 1 of the card's training paragraph; a run of one step continues the previous run's chat phase."""
    n = tr["steps"]["pretrain"]
    if n <= 1:
        return (
            f"Phase 1: none ({n} step at lr {a['lr']:g}, next to no change: this run is a chat phase "
            "continuing the previous run)."
        )
    return (
        f"Phase 1: {n} AdamW steps of {a['batch']} x {a['seq']}\ntokens of text{repeat_line(a)} (warmup + cosine, "
        f"peak lr {a['lr']:g}, weight decay {a['wd']:g}), {tr['minutes']['pretrain']:.0f} min."
    )


def budget_flags(a: dict) -> str:
    """The training options of a run (its `args`) as train_docs flags: the time budgets, and the steps,
    learning rates, warmup, chat rows, made-up-name copies, copy-task rows, a fresh run's init variant and a warm
    start's redrawn tensors where they were not the defaults."""
    out = [f"--minutes {a['minutes']:g}", f"--chat-minutes {a['chat_minutes']:g}"]
    for k, default in _DEFAULTS.items():
        v = a.get(k)
        if v is not None and v != default:
            out.append(f"--{k.replace('_', '-')} {v if isinstance(v, str) else format(v, 'g')}")
    return " ".join(out)


def write_card(out_dir: str | Path, m: dict) -> None:
    out_dir = Path(out_dir)
    c = K3Config.from_pretrained(out_dir)
    a, h, tr, d = m["args"], m["heldout"], m["train"], m["data"]
    ring = m.get("ring")
    ring_line = (
        f"| this checkpoint through a {ring['nodes']}-node local ring (`p2pk3 node` daemons), first "
        f"{ring['windows']} windows | {ring['ppl_ring']:.2f} (one process on the same windows: "
        f"{ring['ppl_one_process']:.2f}) | |"
        if ring
        else ""
    )
    chars = {k: v["chars"] / 1e6 for k, v in d.items()}
    warm = a.get("init_from")
    runs = m["runs"]
    tot = lineage.totals(runs)
    seen = tot["text_tokens"] / 1e6
    earlier = lineage.totals(runs[:-1])
    history = (
        f"trained on 2 CPU cores in {tot['runs']} runs ({tot['minutes']} minutes; "
        + ", then ".join(f"{r['minutes']} min" + ("" if r["warm_start"] else " from scratch") for r in runs)
        + ", each continuing the last)"
        if len(runs) > 1
        else f"trained from scratch on 2 CPU cores in {tot['minutes']} minutes"
    )
    card = f"""# k3-docs

A {m["params_m"]:.1f}M-parameter model with **exactly the Kimi K3 architecture** (text tower), {history},
on the Python 3.11 documentation and the Linux manual pages, then fine-tuned on question/answer pairs,
multi-turn conversations and tool-call conversations in the K3 chat format. It is the embedded default model
of p2pk3 ({m["export_bytes"] / 1e6:.1f} MB): every code path of the engine (KDA, gated MLA, AttnRes, Stable
LatentMoE with MXFP4 experts) and of the chat and agent front ends runs on it.

It is a small demo, far from trained out: it has seen {seen:.2f}M tokens of text (its training split has
{m["train_tokens"] / 1e6:.2f}M) and {tot["chat_tokens"] / 1e6:.2f}M of chat-phase rows, and the validation loss was still falling. It writes documentation-style
English and answers in the chat format, but its answers are often generic or wrong (see the questions
below); do not expect facts. It calls its two tools in K3's format (below).

## Tools

It was taught two tools, declared the way K3's template declares tools (a `tool_declare` system turn with
their JSON schemas): `python_doc(name)` and `man_page(name)`. Calls are written in the checkpoint's
tool-call tokens (`<|tool_calls_section_begin|><|tool_call_begin|>functions.python_doc:0`
`<|tool_call_argument_begin|>{{"name": "os.path.join"}}<|tool_call_end|><|tool_calls_section_end|>`), results
come back as `tool` turns, and the final answer restates them. `doc_index.json` is the index both tools answer
from (p2pk3/agent/doctools.py); `p2pk3 chat --tools docs` runs that loop, and the OpenAI / Anthropic APIs
return the calls to the client.

## Sampling defaults

{sampling_line(out_dir)}, chosen by measurement on validation questions (tools/tune_defaults.py;
the table is in docs/quality.md). Every front end applies them unless a request sets its own.

## Architecture (K3 layout, shrunk)

{architecture_table(c)}

Checkpoint layout as published for K3: `config.json` (`kimi_k3` wrapper with `text_config` and
`quantization_config`), sharded safetensors with `model.safetensors.index.json`, text weights under
`language_model.`, bf16 except the fp32 KDA conv / `A_log` / `dt_bias` / `o_norm` and router correction bias,
routed experts as `weight_packed` / `weight_scale` uint8. Chat format (Jinja template in
`tokenizer_config.json`): `<|im_user|>user<|im_middle|>...<|im_end|><|im_assistant|>assistant<|im_middle|>`;
stop ids `[EOS]` and `<|im_end|>`.

## Data

| source | licence | train / validation / held-out characters |
|---|---|---|
| Python 3.11 documentation, reStructuredText sources (Debian `python3.11-doc`), markup stripped to prose and code blocks | PSF License Agreement; since 3.8.6 the code examples and recipes in it are dual-licensed PSF / Zero-Clause BSD (`license.rst` of the sources, `/usr/share/doc/python3.11-doc/copyright`) | together with the man pages: {chars["train"]:.2f}M / {chars["val"]:.2f}M / {chars["heldout"]:.2f}M |
| Linux man-pages project 6.03 (Debian `manpages`, `manpages-dev`), rendered with groff | per page, as recorded in Debian's `copyright` file: about 1,430 pages under the "Linux-man-pages-copyleft" licence (verbatim and modified copies allowed if the permission notice is kept), about 730 GPL-2.0+/GPL-1.0+/GPL-2.0, about 220 BSD (4-, 3-, 2-clause), 1 Expat; all in Debian main (the non-free POSIX pages, in `manpages-posix`, are not used) | |

Documents ({d["train"]["documents"]} train, {d["val"]["documents"]} validation, {d["heldout"]["documents"]}
held out) are split by a hash of their name; paragraphs of held-out (validation) documents are removed from
the other splits, and paragraphs repeated across documents are kept once. The tokenizer saw the train split
only. The held-out documents (listed in `heldout_docs.json`) are used only for the numbers below. Note: the previous demo model (`tiny-k3-pydoc`) was trained on
CPython's `pydoc_data.topics`, which overlaps the language-reference part of these documents.

## Training

`python -m tools.train_docs {budget_flags(a)} --run runs/k3-docs --export p2pk3/assets/k3-docs{
        f" --init-from {warm}" if warm else ""}`
(seed {a["seed"]}, resumable with `--resume`){
        f"; warm-started from the previous run's weights ({earlier['text_tokens'] / 1e6:.2f}M tokens of text and "
        f"{earlier['chat_tokens'] / 1e6:.2f}M of chat rows in {earlier['runs']} runs, {earlier['minutes']} min; "
        f"`{lineage.FILE}` lists every run)" if warm else ""
    }. {phase1_line(a, tr)}
Phase 2: {tr["steps"]["chat"]} steps of {a.get("chat_batch") or a["batch"]} x {a.get("chat_seq") or a["seq"]} tokens on
{m["chat_pairs_train"]} question/answer pairs built from the train documents (a defined name or heading -> "What does X
do?" / "What is X?", its first paragraph -> the answer), the same questions reworded, 2-3 questions on one document as
one multi-turn conversation, and tool conversations (call the right tool, read its result, restate it; one in six
calls both tools){renamed_line(a)}, rendered with the chat template (30% with a system prompt), loss on the assistant turns only, a
quarter of each batch plain text, {tr["minutes"]["chat"]:.0f} min. Routed experts trained quantization-aware (MXFP4 fake quantization, straight-through
gradient); router correction bias set by quantile balancing (no aux loss). {a["threads"]} CPU threads, Python
{m["python"]}, torch {m["torch"]}. Loss curves: `loss.png` of the run.

## Quality (held-out documents, first 2,000 characters of each, windows of {a["seq"]} tokens)

| | perplexity | bits per byte |
|---|---|---|
| fp32 master weights (QAT forward) | {h["master"]["ppl"]:.2f} | {h["master"]["bpb"]:.3f} |
| this checkpoint (bf16 + MXFP4 experts, real loader), fp32 compute | {h["mxfp4"]["ppl"]:.2f} | {h["mxfp4"]["bpb"]:.3f} |
| this checkpoint, bf16 compute | {h["mxfp4_bf16"]["ppl"]:.2f} | {h["mxfp4_bf16"]["bpb"]:.3f} |
{ring_line}

The comparison with the previous demo model (bits per byte: the tokenizers differ) is in docs/quality.md.

## Questions (greedy, up to 64 tokens; score = fraction of the answer's content words found in the reference paragraph)

Plain greedy decoding without the shipped penalties, so the loops they hold back show here; the held-out
answers with the shipped defaults are in docs/quality.md.

| | question | answer | score |
|---|---|---|---|
{_q_rows(m["questions"])}

## Integrity

`p2pk3-manifest.json` beside the weights records the size and SHA-256 of every file here but this card;
`p2pk3 generate`, `p2pk3 local` and every node check the shards against it at load, as they check a
downloaded model (a changed shard stops them, naming the file). A retrained or re-exported model must
regenerate it: `p2pk3 manifest p2pk3/assets/k3-docs` (tests/test_cli_plan_deploy.py fails until it matches).

## License / provenance

Weights trained by p2pk3 from random initialisation on the texts above; the licences of the training texts
are listed under Data.
"""
    (out_dir / "README.md").write_text(card)
    (out_dir / "heldout_docs.json").write_text(json.dumps(m["heldout_docs"], indent=0) + "\n")

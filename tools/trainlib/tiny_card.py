"""The model card (README.md) of tiny-k3-pydoc, from the run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

from p2pk3.model.config import K3Config


def write_model_card(out_dir: str | Path, cfg: K3Config, metrics: dict) -> None:
    from tools.model_card import architecture_table

    c = cfg
    size = metrics.get("export_bytes", 0) / 1e6
    samples_md = "\n".join(
        f"prompt {json.dumps(p, ensure_ascii=False)}\n```text\n{o[:400]}\n```\n" for p, o in metrics.get("samples", [])
    )
    card = f"""# tiny-k3-pydoc

A {metrics.get("params_m", 0):.1f}M-parameter model with **exactly the Kimi K3 architecture** (text tower),
trained from scratch on CPU in {metrics["train_minutes"]:.0f} minutes on the Python language reference that
ships with CPython (`pydoc_data.topics`). It is the embedded default model of p2pk3: small enough to ship in
the wheel ({size:.1f} MB), real enough to exercise every code path of the engine (KDA, gated MLA, AttnRes,
Stable LatentMoE with MXFP4 experts) and to produce readable, on-topic (if often wrong) text.

It is a toy: it has seen ~{metrics["tokens_seen"] / 1e3:.0f}K tokens. Do not expect facts.

## Architecture (K3 layout, shrunk)

{architecture_table(c)}

Checkpoint layout as published for K3: `config.json` (`kimi_k3` wrapper with `text_config` and
`quantization_config`), sharded safetensors with `model.safetensors.index.json`, text weights under
`language_model.`, bf16 except the fp32 KDA conv / `A_log` (zero-padded) / `dt_bias` / `o_norm` and router
correction bias, routed experts as `weight_packed` / `weight_scale` uint8.

## Tokenizer

`tokenizer.json` (Hugging Face, byte-level BPE, Kimi K2's pre-tokenizer regex) trained on the train split only.
{c.vocab_size - 32} BPE ids, then 32 special slots laid out like Kimi's: `[BOS]` {c.vocab_size - 32},
`[EOS]` {c.vocab_size - 31}, `<|im_end|>` {c.vocab_size - 30}, `<|im_user|>` {c.vocab_size - 29},
`<|im_assistant|>` {c.vocab_size - 28}, `<|im_system|>` {c.vocab_size - 22}, `<|im_middle|>` {c.vocab_size - 15},
`[UNK]` {c.vocab_size - 2}, `[PAD]` {c.vocab_size - 1}, the rest `<|reserved_token_i|>`. Stop ids: `[EOS]` and
`<|im_end|>`. Chat format (Jinja template in `tokenizer_config.json`):

```
<|im_system|>system<|im_middle|>...<|im_end|><|im_user|>user<|im_middle|>...<|im_end|><|im_assistant|>assistant<|im_middle|>
```

## Training

`python -m tools.train_tiny --minutes 20 --run runs/tiny-k3-pydoc --export p2pk3/assets/tiny-k3-pydoc`
(seed 0, {metrics["steps"]} AdamW steps of {metrics["batch"]} x {metrics["seq"]} tokens, warmup + cosine,
1 CPU thread, Python {metrics.get("python")}, torch {metrics.get("torch")}). Data: the {metrics.get("n_train_topics", "")} train topics
of `pydoc_data.topics` as `[BOS] text [EOS]` documents plus {metrics.get("n_chats", "")} synthetic chat Q/A pairs built from
their section headings (answer = the section's first sentences). Topics are split by a hash of their
name; the held-out topics ({", ".join(metrics["heldout_topics"])}) are used only for the numbers below.
Routed experts are trained quantization-aware (MXFP4 fake quantization, straight-through gradient); the
router correction bias is set by a simple quantile-balancing rule (no aux loss).

## Quality (held-out topics, {metrics["heldout_tokens_scored"]} tokens, windows of {metrics["seq"]})

| | perplexity |
|---|---|
| add-one unigram (train split) | {metrics["unigram_ppl"]:.1f} |
| fp32 master weights (QAT forward) | {metrics["master_ppl"]:.1f} |
| fp32 master weights, float (unquantized) experts | {metrics.get("master_float_experts_ppl", float("nan")):.1f} |
| this checkpoint (bf16 + MXFP4 experts, real loader), fp32 compute | {metrics.get("mxfp4_ppl", float("nan")):.1f} |
| this checkpoint, bf16 compute | {metrics.get("mxfp4_bf16_ppl", float("nan")):.1f} |
| this checkpoint through a {metrics.get("ring", {}).get("nodes", 4)}-node local ring (`p2pk3 node` daemons) | {metrics.get("ring", {}).get("ppl", float("nan")):.1f} |

Non-overlapping windows of {metrics["seq"]} tokens, fresh context per window. Details: docs/quality.md.

Greedy samples (this checkpoint):

{samples_md}

## Integrity

`p2pk3-manifest.json` beside the weights records the size and SHA-256 of every file here but this card;
`p2pk3 generate`, `p2pk3 local` and every node check the shards against it at load, as they check a
downloaded model (a changed shard stops them, naming the file). A retrained or re-exported model must
regenerate it: `p2pk3 manifest p2pk3/assets/tiny-k3-pydoc` (tests/test_cli_plan_deploy.py fails until it matches).

## License / provenance

Weights trained by p2pk3 from random initialisation. Training text: the Python documentation shipped with
CPython (Copyright Python Software Foundation, PSF License).
"""
    (Path(out_dir) / "README.md").write_text(card)

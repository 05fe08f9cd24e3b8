"""The checkpoint directory of a trained model: weights in the K3 layout, tokenizer, generation config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from p2pk3.model.config import K3Config


def export(
    out_dir: str | Path, cfg: K3Config, sd: dict[str, torch.Tensor], tok_dir: Path, metrics: dict, held_ids: list[int]
) -> None:
    from p2pk3.checkpoint.tiny import write_checkpoint

    out = Path(out_dir)
    if out.exists():
        for f in out.iterdir():
            if f.is_file():
                f.unlink()
    # A_log: the model holds the zero-padded [max(H, K)] vector already
    write_checkpoint(out, cfg, seed=0, shards=2, state_dict=sd)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)
    if (tok_dir.parent / "doc_index.json").exists():  # the tools of `p2pk3 chat --tools docs`
        shutil.copy(tok_dir.parent / "doc_index.json", out / "doc_index.json")
    tc = json.loads((tok_dir / "tokenizer_config.json").read_text())
    gen = {
        "bos_token_id": tc["bos_token_id"],
        "eos_token_id": tc["stop_token_ids"],
        "pad_token_id": tc["pad_token_id"],
        "do_sample": False,
        "max_new_tokens": 128,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")

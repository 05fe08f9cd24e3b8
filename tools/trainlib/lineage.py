"""The training runs a demo checkpoint came from: `training_runs.json` beside its weights.

A warm start (`tools/train_docs.py --init-from DIR`) copies the runs of the checkpoint it starts from and adds
its own, so the model card counts every token the weights have seen, however many runs they went through.

    runs = runs_before(init_from)            # [] from scratch; DIR's training_runs.json otherwise
    write(export_dir, runs + [this_run(...)])
    totals(runs)                             # {"runs", "text_tokens", "chat_tokens", "minutes"}
"""

from __future__ import annotations

import json
import time
from pathlib import Path

FILE = "training_runs.json"

# The shipped k3-docs exports made before this file existed (docs/quality.md): the run from scratch of
# 2026-12-01 (669 text steps of 8 x 256, 108 chat steps of 8 x 256) and its warm start of 2026-12-02
# (1045 text steps of 8 x 256, 319 chat steps of 4 x 512). A checkpoint without the file that is warm-started
# from is one of those two lines' end: the second.
BEFORE_THE_FILE = [
    {
        "date": "2026-12-01",
        "warm_start": False,
        "text_tokens": 669 * 8 * 256,
        "chat_tokens": 108 * 8 * 256,
        "minutes": 76,
    },
    {
        "date": "2026-12-02",
        "warm_start": True,
        "text_tokens": 1045 * 8 * 256,
        "chat_tokens": 319 * 4 * 512,
        "minutes": 98,
    },
]


def runs_before(init_from: str | Path | None) -> list[dict]:
    if not init_from:
        return []
    p = Path(init_from) / FILE
    if p.exists():
        return json.loads(p.read_text())
    return [dict(r) for r in BEFORE_THE_FILE]


def runs_through(init_from: str | Path | None) -> list[dict]:
    """What a warm start from `init_from` continues: an export's runs, or a training run's folder's (the runs
    before it) and its own steps so far, read from its `ckpt.pt`."""
    if not init_from or not (Path(init_from) / "ckpt.pt").exists() or (Path(init_from) / "config.json").exists():
        return runs_before(init_from)
    import argparse

    import torch

    ck = torch.load(Path(init_from) / "ckpt.pt", map_location="cpu", weights_only=False)
    st, a = ck["state"], argparse.Namespace(**ck["args"])
    steps = {ph: len(st["hist"][ph]["step"]) for ph in ("pretrain", "chat")}
    minutes = sum(st["elapsed"].values()) / 60
    date = time.strftime("%Y-%m-%d", time.gmtime((Path(init_from) / "ckpt.pt").stat().st_mtime))
    f = Path(init_from) / FILE  # written when the run started warm; a run from scratch has none
    before = json.loads(f.read_text()) if f.exists() else runs_through(getattr(a, "init_from", None))
    return before + [this_run(date, bool(getattr(a, "init_from", None)), steps, a, minutes)]


def this_run(date: str, warm_start: bool, steps: dict, a, minutes: float) -> dict:
    """One run's line: `steps` {"pretrain": n, "chat": n}; `a` the run's arguments (batch, seq, chat_*)."""
    chat_rows = getattr(a, "chat_batch", None) or a.batch
    chat_seq = getattr(a, "chat_seq", None) or a.seq
    return {
        "date": date,
        "warm_start": warm_start,
        "text_tokens": steps["pretrain"] * a.batch * a.seq,
        "chat_tokens": steps["chat"] * chat_rows * chat_seq,
        "minutes": round(minutes),
    }


def write(export_dir: str | Path, runs: list[dict]) -> None:
    (Path(export_dir) / FILE).write_text(json.dumps(runs, indent=1) + "\n")


def totals(runs: list[dict]) -> dict:
    return {
        "runs": len(runs),
        "text_tokens": sum(r["text_tokens"] for r in runs),
        "chat_tokens": sum(r["chat_tokens"] for r in runs),
        "minutes": sum(r["minutes"] for r in runs),
    }

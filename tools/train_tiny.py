"""Train a small model of exactly the Kimi K3 architecture on CPU and export it in the K3 checkpoint layout.
The script of the run; the code is the training library tools/trainlib/ (`tiny_run` drives it).

    python -m tools.train_tiny --minutes 20 --run runs/tiny-k3-pydoc --export p2pk3/assets/tiny-k3-pydoc

Data: the text that ships with CPython, `pydoc_data.topics.topics` (topic -> reference text). Topics are split
by a hash of their name (`split_of`): ~10% of the topics (5% of the text) are HELD OUT (never seen by the
tokenizer or the model: only the final perplexity reads them), a few more are a VALIDATION split (loss curve /
model selection), the rest is TRAIN. Topics nest, so paragraphs of held-out (validation) topics are removed
from the validation and train (train) texts (`split_topics`; `overlap` measures what is left). Training documents are `[BOS] topic text [EOS]` plus synthetic chat Q/A pairs
built from the train topics' section headings (`chat_documents`), in the K3 chat template, so that the
special tokens and the template are exercised.

Model: `tiny_config` — every structural feature of K3 (KDA + gated MLA in the K3 cadence with the last two
layers MLA, dense layer 0, Stable LatentMoE with sigmoid router + correction bias, shared expert, SiTU-GLU,
AttnRes blocks), trained through the SAME forward the engine serves with (`K3Stage` over a throw-away
`StageCache`, one session per sequence). The routed experts are trained quantization-aware: float master
weights, forward through an MXFP4 fake quantizer with a straight-through gradient; the export quantizes the
masters with the same quantizer, so the shipped MXFP4 experts are exactly what the training forward used.

Router balancing (no aux loss, spec section 7): after every step the `e_score_correction_bias` of each MoE
layer moves towards balanced load with a simple form of K3's quantile balancing (`qb_update`; `--balance sign`
uses DeepSeek-V3's sign rule instead).

Outputs in --run: train.log (also stdout), loss.png, metrics.json, master.pt (fp32 master weights, canonical
names + float experts), samples; in --export: the checkpoint + tokenizer + model card + `heldout_eval.json`
(a fixed held-out slice with its recorded perplexity, for tests/test_shipped_model.py). `--finish` redoes
the export and evaluation from master.pt (`--ring N` adds the perplexity through a local ring of N daemons).
Quality numbers: docs/quality.md.

Speed: one torch thread (fastest on a shared 2-core box); ~2.2 s per 8 x 128-token step, dominated by the
KDA chunk reference (kernels/kda_ref.py `_chunk_one`: [H, C, C, K] tensors per 64-token chunk, one sequence
at a time).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.trainlib.tiny_run import finish, train  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-time budget of the training loop")
    ap.add_argument("--steps", type=int, default=None, help="fixed number of steps (default: fit --minutes)")
    ap.add_argument("--run", default="runs/tiny-k3-pydoc")
    ap.add_argument("--export", default=None, help="write the checkpoint here (e.g. p2pk3/assets/tiny-k3-pydoc)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--kda-heads", type=int, default=2)
    ap.add_argument("--kda-dim", type=int, default=32)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--moe-inter", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--balance", choices=["qb", "sign", "none"], default="qb")
    ap.add_argument("--balance-rate", type=float, default=None, help="qb: EMA rate (0.1); sign: step (1e-3)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    ap.add_argument("--profile", action="store_true", help="time 3 steps with cProfile and exit")
    ap.add_argument("--finish", action="store_true", help="skip training: export + evaluate the run's master.pt")
    ap.add_argument("--ring", type=int, default=0, help="with --finish: also score through a local ring of N daemons")
    a = ap.parse_args(argv)

    torch.manual_seed(a.seed)
    random.seed(a.seed)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.finish:
        finish(a.run, a.export, ring=a.ring)
        return 0
    return train(a)


if __name__ == "__main__":
    raise SystemExit(main())

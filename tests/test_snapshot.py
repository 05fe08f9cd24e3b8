"""Snapshot of the shipped model's math: per-token NLL of a fixed prompt under p2pk3/assets/tiny-k3-pydoc,
compared at fp32 tolerance (1e-4 absolute per token), so that ANY change of the model math (a constant, a
norm, a dropped term, a kernel reference) is seen - the held-out perplexity bound of test_shipped_model.py
(+-10 %) lets far too much through.

The snapshot lives in tests/data/tiny_k3_pydoc_nll.json together with the prompt's token ids and the
sha256 of every shipped weight file. To regenerate it after a deliberate change of the math (or of the
shipped weights), run

    P2PK3_UPDATE_SNAPSHOT=1 python -m pytest tests/test_snapshot.py

and commit the new JSON together with the change that explains it (the test then reports "updated" and
passes). Never regenerate to silence a failure you cannot explain.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from p2pk3_kernels import ops

from p2pk3.engine.reference import Pipeline

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "p2pk3" / "assets" / "tiny-k3-pydoc"
SNAPSHOT = Path(__file__).resolve().parent / "data" / "tiny_k3_pydoc_nll.json"
UPDATE = os.environ.get("P2PK3_UPDATE_SNAPSHOT") == "1"
TOL = 1e-4  # absolute, per token, fp32
PROMPT = (
    'The "with" statement is used to wrap the execution of a block with methods defined by a context '
    "manager. This allows common try...except...finally usage patterns to be encapsulated."
)

pytestmark = pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="shipped model not present")


def weight_hashes() -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(MODEL.glob("*.safetensors"))}


def prompt_ids() -> list[int]:
    from p2pk3.tokenizer import load_tokenizer

    tok = load_tokenizer(MODEL)
    return [tok.bos_id] + tok.encode(PROMPT)


def per_token_nll(logits: torch.Tensor, ids: list[int]) -> list[float]:
    lp = torch.log_softmax(logits.double(), -1)
    t = torch.tensor(ids)
    return (-lp[:-1].gather(-1, t[1:, None])[:, 0]).tolist()


@pytest.fixture(scope="module")
def torch_kernels():
    ops.force("torch")  # the snapshot is of the torch references (fp32); Triton kernels have their own tests
    yield
    ops.force(None)


@pytest.fixture(scope="module")
def snapshot(torch_kernels):
    if UPDATE:
        ids = prompt_ids()
        pipe = Pipeline.load(MODEL, 1, max_sessions=2, max_tokens=512, block_size=16)
        nll = per_token_nll(pipe.score(ids), ids)
        rec = {
            "model": "p2pk3/assets/tiny-k3-pydoc",
            "prompt": PROMPT,
            "tokens": ids,
            "dtype": "float32",
            "kernels": "torch",
            "weights_sha256": weight_hashes(),
            "nll": [round(x, 7) for x in nll],
            "mean_nll": round(sum(nll) / len(nll), 7),
        }
        SNAPSHOT.parent.mkdir(parents=True, exist_ok=True)
        SNAPSHOT.write_text(json.dumps(rec, indent=1) + "\n")
    return json.loads(SNAPSHOT.read_text())


def _check(nll: list[float], rec: dict, what: str) -> None:
    want = rec["nll"]
    assert len(nll) == len(want)
    diff = [abs(a - b) for a, b in zip(nll, want)]
    worst = max(range(len(diff)), key=diff.__getitem__)
    assert diff[worst] <= TOL, (
        f"{what}: per-token NLL differs from the snapshot by {diff[worst]:.3g} at position {worst + 1} "
        f"(token {rec['tokens'][worst + 1]}): {nll[worst]:.6f} vs {want[worst]:.6f}; mean NLL "
        f"{sum(nll) / len(nll):.6f} vs {rec['mean_nll']:.6f}. The model math changed; if deliberately, "
        f"regenerate with P2PK3_UPDATE_SNAPSHOT=1 (see the module docstring)."
    )


def test_snapshot_is_of_the_shipped_weights(snapshot):
    assert snapshot["weights_sha256"] == weight_hashes(), (
        "the shipped weights changed since the snapshot was taken: regenerate it (P2PK3_UPDATE_SNAPSHOT=1)"
    )
    assert len(snapshot["tokens"]) >= 30 and len(snapshot["nll"]) == len(snapshot["tokens"]) - 1


def test_prefill_nll_matches_snapshot(snapshot):
    pipe = Pipeline.load(MODEL, 1, max_sessions=2, max_tokens=512, block_size=16)
    _check(per_token_nll(pipe.score(snapshot["tokens"]), snapshot["tokens"]), snapshot, "one-stage prefill")


def test_staged_incremental_decode_matches_snapshot(snapshot):
    """Three stages, token by token through the caches (the decode kernels' torch references)."""
    pipe = Pipeline.load(MODEL, 3, max_sessions=2, max_tokens=512, block_size=16)
    ids = snapshot["tokens"]
    _check(per_token_nll(pipe.score(ids, incremental=True), ids), snapshot, "3-stage incremental decode")


def test_prompt_still_tokenizes_to_the_snapshot_tokens(snapshot):
    """Separate from the math: if only this fails, the tokenizer changed, not the model."""
    assert snapshot["prompt"] == PROMPT
    assert prompt_ids() == snapshot["tokens"]


def test_snapshot_mode_is_off_in_normal_runs():
    """A run that regenerates the snapshot proves nothing: make it visible."""
    if UPDATE:
        pytest.skip(f"P2PK3_UPDATE_SNAPSHOT=1: {SNAPSHOT.name} was regenerated, nothing was compared")

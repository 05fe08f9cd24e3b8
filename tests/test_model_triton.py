"""The whole model through the Triton kernels (interpreter on this CPU) gives the torch path's logits:
`P2PK3_KERNELS=triton TRITON_INTERPRET=1 p2pk3 score --dtype float32` vs `P2PK3_KERNELS=torch`."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from p2pk3.checkpoint.tiny import write_checkpoint
from p2pk3.model.config import TINY_K3

TOKS = "5,17,300,42,42,7,99,123,4,8,9,10,511,64,65"


def _score(model, path, out, incremental, env_extra):
    env = {**os.environ, **env_extra}
    argv = [
        sys.executable,
        "-m",
        "p2pk3.cli",
        "score",
        "--model",
        str(model),
        "--tokens",
        TOKS,
        "--dtype",
        "float32",
        "--dump-logits",
        str(out),
    ] + (["--incremental"] if incremental else [])
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return np.load(out)


@pytest.mark.slow
@pytest.mark.parametrize("incremental", [False, True], ids=["prefill", "decode"])
def test_whole_model_through_triton_kernels_matches_torch(tmp_path, incremental):
    write_checkpoint(tmp_path / "m", TINY_K3, seed=3, shards=2)
    ref = _score(tmp_path / "m", "torch", tmp_path / "ref.npy", incremental, {"P2PK3_KERNELS": "torch"})
    tri = _score(
        tmp_path / "m",
        "triton",
        tmp_path / "tri.npy",
        incremental,
        {"P2PK3_KERNELS": "triton", "TRITON_INTERPRET": "1"},
    )
    rel = np.abs(tri - ref).max() / np.abs(ref).max()
    assert rel <= 1e-3, f"relative error {rel:.3g}"

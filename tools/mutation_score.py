#!/usr/bin/env python3
"""Mutation score of the test suite: hand-written bugs that the tests must catch (not run in CI).

Each mutation replaces one exact snippet of one source file. For every selected mutation the script
copies the repository (without .git and caches) to a temporary directory, applies the mutation to the
COPY, runs the listed test files there with `python -m pytest` and records the verdict:

  killed    the tests failed (good: the bug is seen)
  survived  the tests passed with the bug in place (a hole in the suite)
  stale     the original snippet is no longer in the file (the code changed: update the mutation)
  timeout   the tests ran past --timeout (counted as killed: a hang is a visible failure)
  error     the copy could not be prepared / pytest did not start (counted apart)

The package is installed editable from the main checkout, so the copy is made importable explicitly:
PYTHONPATH=<copy>:<shim>, where <shim>/p2pk3_kernels is a symlink to <copy>/kernels (setuptools maps
`kernels/` to `p2pk3_kernels`; its editable finder would otherwise resolve the name to the main checkout).
Before any mutation runs, the script checks in a subprocess that `p2pk3` and `p2pk3_kernels` really
import from the copy, and refuses to run otherwise.

    python tools/mutation_score.py --list
    python tools/mutation_score.py --only 1,5           # by number (see --list) or by id
    python tools/mutation_score.py --only mla-scale-1 --tests tests/test_oracles.py
    python tools/mutation_score.py                      # everything: slow (minutes per mutation)

Score = killed / (killed + survived); stale and error entries are listed but not scored.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORE = shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", "*.pyc", ".benchmarks", "*.egg-info")

ORACLES = "tests/test_oracles.py"
SNAP = "tests/test_snapshot.py"
HAND = "tests/test_handshake_adversaries.py"
MODEL = "tests/test_model.py"
KERN = "tests/test_kernels.py"
MX = "tests/test_mxfp4.py"
CONN = "tests/test_connection.py"
DISC = "tests/test_discovery.py"
SHIPPED = "tests/test_shipped_model.py"


@dataclass
class Mutation:
    id: str
    file: str
    original: str
    replacement: str
    tests: list[str]
    note: str = ""
    count: int = 1  # occurrences to replace (the original must occur at least this often)
    extra: list[tuple[str, str]] = field(default_factory=list)  # more (original, replacement) in the same file


MUTATIONS: list[Mutation] = [
    # ---------------------------------------------------------------- the audit's survivors
    Mutation(
        "mla-scale-1",
        "p2pk3/model/kimi_k3.py",
        "scale = c.q_head_dim ** -0.5",
        "scale = 1.0",
        [ORACLES, SNAP, MODEL],
        "MLA softmax scale set to 1",
    ),
    Mutation(
        "kda-conv-taps-reversed",
        "p2pk3/model/kimi_k3.py",
        "w = self.weight[:, 0, :].float()",
        "w = self.weight[:, 0, :].flip(-1).float()",
        [ORACLES, SNAP, MODEL],
        "KDA short-conv taps reversed (ShortConv.forward)",
    ),
    Mutation(
        "hmac-no-role",
        "p2pk3/transport/connection.py",
        'msg = bytearray(_AUTH_LABEL + b"\\0" + role + b"\\0" + client_nonce + server_nonce)',
        'msg = bytearray(_AUTH_LABEL + b"\\0" + b"\\0" + client_nonce + server_nonce)',
        [HAND, CONN],
        "handshake proof computed without the role",
    ),
    Mutation(
        "hmac-no-nonces",
        "p2pk3/transport/connection.py",
        'msg = bytearray(_AUTH_LABEL + b"\\0" + role + b"\\0" + client_nonce + server_nonce)',
        'msg = bytearray(_AUTH_LABEL + b"\\0" + role + b"\\0")',
        [HAND, CONN],
        "handshake proof computed without the nonces",
    ),
    Mutation(
        "top-p-ignored",
        "p2pk3/engine/sampling.py",
        "if p.top_p < 1.0:",
        "if False:",
        [ORACLES, MODEL],
        "top-p ignored in sampling",
    ),
    Mutation(
        "resolve-slot-lowest-epoch",
        "p2pk3/node/discovery.py",
        "return max(live, key=lambda p: (p.epoch, [-ord(c) for c in p.node_id]))",
        "return min(live, key=lambda p: (p.epoch, [-ord(c) for c in p.node_id]))",
        [HAND, DISC],
        "resolve_slot picks the lowest epoch",
    ),
    Mutation(
        "mla-output-zero",
        "p2pk3/model/kimi_k3.py",
        "        return self.o_proj(o)\n",
        "        return 0 * self.o_proj(o)\n",
        [SNAP, ORACLES, SHIPPED],
        "every MLA output zeroed",
    ),
    Mutation(
        "routed-experts-zero",
        "p2pk3/model/kimi_k3.py",
        "        u = u.to(x.dtype)\n",
        "        u = 0 * u.to(x.dtype)\n",
        [SNAP, ORACLES, SHIPPED],
        "every routed expert's contribution zeroed (LatentMoE.finish)",
    ),
    # ---------------------------------------------------------------- model math
    Mutation(
        "mla-scale-nope-only",
        "p2pk3/model/kimi_k3.py",
        "scale = c.q_head_dim ** -0.5",
        "scale = c.qk_nope_head_dim ** -0.5",
        [ORACLES, SNAP],
        "MLA scale from the NoPE part only (128^-1/2 instead of 192^-1/2)",
    ),
    Mutation(
        "mla-no-k-pe",
        "p2pk3/model/kimi_k3.py",
        '+ torch.einsum("thd,ld->htl", q_pe[s:e], k_pe).float()) * scale',
        '+ 0 * torch.einsum("thd,ld->htl", q_pe[s:e], k_pe).float()) * scale',
        [ORACLES, SNAP],
        "naive MLA drops the shared k_pe term of the score",
    ),
    Mutation(
        "mla-not-causal",
        "p2pk3/model/kimi_k3.py",
        "mask = torch.arange(L, device=sc.device)[None, :] > pos_q[:, None]",
        "mask = torch.arange(L, device=sc.device)[None, :] > L",
        [ORACLES, SNAP],
        "naive MLA without the causal mask",
    ),
    Mutation(
        "mla-gate-off",
        "p2pk3/model/kimi_k3.py",
        "o = (o.float() * torch.sigmoid(self.g_proj(x).float())).to(x.dtype)",
        "o = o",
        [ORACLES, SNAP],
        "MLA output gate dropped",
    ),
    Mutation(
        "mla-kv-norm-eps",
        "p2pk3/model/kimi_k3.py",
        "self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)",
        "self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1.0)",
        [ORACLES, SNAP, MODEL],
        "kv_a_layernorm eps 1e-6 -> 1",
    ),
    Mutation(
        "kda-low-rank-gate-wrong",
        "p2pk3/model/kimi_k3.py",
        "self.g_b_proj(self.g_a_proj(x))",
        "self.g_b_proj(self.f_a_proj(x))",
        [ORACLES],
        "Kimi-Linear low-rank output gate reads f_a_proj",
    ),
    Mutation(
        "kda-no-silu",
        "p2pk3/model/kimi_k3.py",
        "            return F.silu(out)\n",
        "            return out\n",
        [ORACLES, SNAP],
        "short conv without SiLU in the decode path",
    ),
    Mutation(
        "kda-o-norm-weight",
        "p2pk3/model/kimi_k3.py",
        "* self.o_norm.weight.float()",
        "* 1.0",
        [ORACLES, SNAP],
        "KDA per-head RMSNorm weight ignored",
    ),
    Mutation(
        "router-no-scaling",
        "p2pk3/model/kimi_k3.py",
        "return ids, w * self.scaling",
        "return ids, w",
        [ORACLES, MODEL],
        "routed_scaling_factor ignored (Kimi Linear 2.446)",
    ),
    Mutation(
        "router-weights-biased",
        "p2pk3/model/kimi_k3.py",
        "w = s.gather(-1, ids)",
        "w = (s + self.e_score_correction_bias.float()).gather(-1, ids)",
        [ORACLES, MODEL],
        "expert weights from the biased scores",
    ),
    Mutation(
        "latent-norm-off",
        "p2pk3/model/kimi_k3.py",
        "u = self.routed_expert_norm(u)",
        "u = u",
        [SNAP, MODEL],
        "Stable LatentMoE without the RMSNorm of the latent sum",
    ),
    Mutation(
        "rmsnorm-eps-ignored",
        "p2pk3/model/kimi_k3.py",
        "h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)",
        "h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-2)",
        [SNAP, MODEL],
        "RMSNorm eps replaced by 1e-2",
    ),
    # ---------------------------------------------------------------- kernel references
    Mutation(
        "mla-ref-no-pe",
        "kernels/mla_decode_ref.py",
        "s = (q_lat[i].float() @ kv[:, :R].T + q_pe[i].float() @ kv[:, R:].T) * scale",
        "s = (q_lat[i].float() @ kv[:, :R].T) * scale",
        [ORACLES, KERN],
        "MLA decode reference drops q_pe . k_pe",
    ),
    Mutation(
        "kda-ref-read-before-write",
        "kernels/kda_ref.py",
        'o = torch.einsum("bhk,bhkv->bhv", q, S)  # read after the write\n    state[idx] = S',
        'o = torch.einsum("bhk,bhkv->bhv", q, state[idx])\n    state[idx] = S',
        [ORACLES, MODEL],
        "KDA decode reads the state before the write",
    ),
    Mutation(
        "kda-ref-l2-eps",
        "kernels/kda_ref.py",
        "def l2norm(x: torch.Tensor, eps: float = 1e-6)",
        "def l2norm(x: torch.Tensor, eps: float = 1.0)",
        [ORACLES, MODEL],
        "q/k L2 norm eps 1e-6 -> 1",
    ),
    Mutation(
        "kda-ref-softplus-sign",
        "kernels/kda_ref.py",
        "return -A.exp() * F.softplus(x)",
        "return -F.softplus(x)",
        [ORACLES, MODEL],
        "Kimi-Linear gate without exp(A_log)",
    ),
    Mutation(
        "situ-beta-swapped",
        "kernels/mxfp4_moe_ref.py",
        "return (beta1 * torch.tanh(g / beta1) * torch.sigmoid(g)) * (beta2 * torch.tanh(u / beta2))",
        "return (beta2 * torch.tanh(g / beta2) * torch.sigmoid(g)) * (beta1 * torch.tanh(u / beta1))",
        [SNAP, MODEL],
        "SiTU betas swapped",
    ),
    Mutation(
        "silu-glu-swapped",
        "kernels/mxfp4_moe_ref.py",
        "return F.silu(g) * u",
        "return g * F.silu(u)",
        [ORACLES, MODEL],
        "SiLU-GLU applies SiLU to the up branch",
    ),
    Mutation(
        "mxfp4-nibble-order",
        "kernels/mxfp4_moe_ref.py",
        "codes = torch.stack([packed & 0xF, packed >> 4], -1)",
        "codes = torch.stack([packed >> 4, packed & 0xF], -1)",
        [SNAP, MX, MODEL],
        "MXFP4 reference reads the high nibble first",
    ),
    Mutation(
        "attnres-softmax-axis",
        "kernels/attnres_ref.py",
        "p = torch.softmax(score, dim=0)",
        "p = torch.softmax(score, dim=1)",
        [SNAP, MODEL],
        "AttnRes softmax over tokens instead of candidates",
    ),
    # ---------------------------------------------------------------- quantization
    Mutation(
        "quant-unpack-nibble-order",
        "p2pk3/quant/mxfp4.py",
        "return torch.stack((lo, hi), dim=-1)",
        "return torch.stack((hi, lo), dim=-1)",
        [MX, MODEL],
        "unpack_fp4 puts the high nibble first",
    ),
    Mutation(
        "quant-e8m0-off-by-one",
        "p2pk3/quant/mxfp4.py",
        "bits = s << 23",
        "bits = (s + 1) << 23",
        [MX, MODEL],
        "E8M0 decode table shifted by one exponent",
    ),
    Mutation(
        "quant-emax",
        "p2pk3/quant/mxfp4.py",
        "_floor_log2(amax) - E2M1_EMAX,",
        "_floor_log2(amax) - E2M1_EMAX + 1,",
        [MX],
        "quantizer's shared exponent one too high",
    ),
    # ---------------------------------------------------------------- sampling
    Mutation(
        "top-p-drops-crossing-token",
        "p2pk3/engine/sampling.py",
        "keep = sp.cumsum(0) - sp < p.top_p",
        "keep = sp.cumsum(0) < p.top_p",
        [ORACLES],
        "top-p drops the token that crosses the threshold",
    ),
    Mutation(
        "top-k-off-by-one",
        "p2pk3/engine/sampling.py",
        "kth = torch.topk(x, p.top_k).values[-1]",
        "kth = torch.topk(x, p.top_k + 1).values[-1]",
        [ORACLES, MODEL],
        "top-k keeps k + 1 tokens",
    ),
    Mutation(
        "temperature-ignored",
        "p2pk3/engine/sampling.py",
        "x = x / p.temperature",
        "x = x",
        [ORACLES],
        "temperature ignored",
    ),
    # ---------------------------------------------------------------- transport / discovery
    Mutation(
        "hmac-no-ids",
        "p2pk3/transport/connection.py",
        "    for s in (client_id, server_id):\n",
        "    for s in ():\n",
        [HAND, CONN],
        "handshake proof without the node ids",
    ),
    Mutation(
        "server-skips-proof-check",
        "p2pk3/transport/connection.py",
        'if not hmac.compare_digest(_as_bytes(a.header.get("proof")), theirs):\n                await self._try_send',
        "if False:\n                await self._try_send",
        [HAND, CONN],
        "server accepts any client proof",
    ),
    Mutation(
        "no-version-check",
        "p2pk3/transport/connection.py",
        "if pver != PROTOCOL_VERSION:",
        "if False:",
        [HAND, CONN],
        "protocol version not checked",
    ),
    Mutation(
        "no-role-check",
        "p2pk3/transport/connection.py",
        "if prole != want_role:",
        "if False:",
        [HAND],
        "hello role not checked",
    ),
    Mutation(
        "beacon-no-replay-check",
        "p2pk3/node/discovery.py",
        'if last is not None and b["seq"] <= last:',
        "if False:",
        [HAND, DISC],
        "replayed beacons accepted",
    ),
    Mutation(
        "beacon-no-skew-check",
        "p2pk3/node/discovery.py",
        'if abs(time.time() - b["ts"]) > self.max_skew:',
        "if False:",
        [HAND, DISC],
        "stale beacons accepted",
    ),
    Mutation(
        "beacon-no-signature",
        "p2pk3/node/discovery.py",
        "if not hmac.compare_digest(hmac.new(key, msg, hashlib.sha256).digest(), tag):",
        "if False:",
        [HAND, DISC],
        "beacon signatures not verified",
    ),
]


# --------------------------------------------------------------------------------------------- running
def make_copy(dest: Path) -> tuple[Path, dict[str, str]]:
    repo = dest / "repo"
    shutil.copytree(ROOT, repo, ignore=IGNORE, symlinks=True)
    shim = dest / "shim"
    shim.mkdir()
    (shim / "p2pk3_kernels").symlink_to(repo / "kernels", target_is_directory=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(repo), str(shim)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.pop("P2PK3_UPDATE_SNAPSHOT", None)  # never rewrite the snapshot from mutated code
    return repo, env


def check_imports(repo: Path, env: dict[str, str]) -> None:
    code = (
        "import p2pk3, p2pk3_kernels, p2pk3.model.kimi_k3 as k; "
        "print(p2pk3.__file__); print(p2pk3_kernels.__file__); print(k.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise SystemExit(f"the copy does not import:\n{out.stderr}")
    real = repo.resolve()
    for line in out.stdout.split():
        if not Path(line).resolve().is_relative_to(real):
            raise SystemExit(f"imports do not come from the copy ({line} is outside {real}); refusing to run")


def apply(repo: Path, m: Mutation) -> str | None:
    """Mutate the copy; returns the original text of the file, or None when the snippet is stale."""
    path = repo / m.file
    if not path.exists():
        return None
    text = path.read_text()
    new = text
    for orig, repl in [(m.original, m.replacement), *m.extra]:
        if new.count(orig) < m.count:
            return None
        new = new.replace(orig, repl, m.count)
    path.write_text(new)
    return text


def run_one(repo: Path, env: dict[str, str], m: Mutation, tests: list[str], timeout: float) -> tuple[str, float, str]:
    original = apply(repo, m)
    if original is None:
        return "stale", 0.0, f"snippet not found in {m.file}"
    try:
        present = [t for t in tests if (repo / t.split("::")[0]).exists()]  # files or pytest node ids
        if not present:
            return "error", 0.0, f"none of the test files exist: {tests}"
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *present]
        t0 = time.monotonic()
        try:
            out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "timeout", time.monotonic() - t0, "timed out"
        dt = time.monotonic() - t0
        lines = out.stdout.strip().splitlines()
        failed = [ln for ln in lines if ln.startswith(("FAILED tests", "ERROR tests"))]
        tail = (failed[0] if failed else (lines or [""])[-1])[:160]
        if out.returncode == 0:
            return "survived", dt, tail
        if out.returncode in (1,):  # tests failed
            return "killed", dt, tail
        return ("killed" if "failed" in tail or "error" in tail else "error"), dt, f"rc={out.returncode}: {tail}"
    finally:
        (repo / m.file).write_text(original)


def select(spec: str | None) -> list[tuple[int, Mutation]]:
    allm = list(enumerate(MUTATIONS, 1))
    if not spec:
        return allm
    want = [s.strip() for s in spec.split(",") if s.strip()]
    out = []
    for w in want:
        hit = [(i, m) for i, m in allm if str(i) == w or m.id == w]
        if not hit:
            raise SystemExit(f"unknown mutation {w!r} (see --list)")
        out += hit
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--only", help="comma-separated numbers or ids")
    ap.add_argument(
        "--tests", help="comma-separated test files (or pytest node ids) to run instead of each mutation's own list"
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per mutation (default 900)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary copy")
    ap.add_argument("--check", action="store_true", help="only report which snippets are stale (no tests run)")
    a = ap.parse_args(argv)
    chosen = select(a.only)
    if a.check:
        bad = 0
        for i, m in chosen:
            path = ROOT / m.file
            text = path.read_text() if path.exists() else ""
            ok = all(text.count(o) >= m.count for o, _ in [(m.original, m.replacement), *m.extra])
            bad += not ok
            print(f"{i:3d}  {m.id:30s} {'ok' if ok else 'STALE'}")
        return 1 if bad else 0
    if a.list:
        for i, m in chosen:
            print(f"{i:3d}  {m.id:30s} {m.file:34s} {m.note}   [{', '.join(Path(t).name for t in m.tests)}]")
        return 0
    tmp = Path(tempfile.mkdtemp(prefix="p2pk3-mut-"))
    try:
        repo, env = make_copy(tmp)
        check_imports(repo, env)
        print(f"copy: {repo} (imports verified to come from the copy)")
        rows = []
        for i, m in chosen:
            tests = a.tests.split(",") if a.tests else m.tests
            verdict, dt, detail = run_one(repo, env, m, tests, a.timeout)
            rows.append((i, m, verdict, dt, detail))
            print(f"{i:3d} {m.id:30s} {verdict:9s} {dt:7.1f}s  {detail}", flush=True)
        print()
        print(f"{'#':>3} {'mutation':30s} {'file':34s} {'verdict':9s}")
        for i, m, verdict, _dt, _ in rows:
            print(f"{i:3d} {m.id:30s} {m.file:34s} {verdict:9s}")
        killed = sum(v in ("killed", "timeout") for _, _, v, _, _ in rows)
        survived = sum(v == "survived" for _, _, v, _, _ in rows)
        stale = sum(v == "stale" for _, _, v, _, _ in rows)
        errors = sum(v == "error" for _, _, v, _, _ in rows)
        scored = killed + survived
        score = f"{killed}/{scored} = {100 * killed / scored:.0f}%" if scored else "n/a"
        print(f"\nmutation score: {score}  (stale {stale}, error {errors})")
        return 0 if survived == 0 and errors == 0 else 1
    finally:
        if a.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

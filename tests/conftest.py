"""Shared pytest set-up.

Triton kernels: without a CUDA device they run under the Triton interpreter, which must be chosen before triton is
first imported, so it is set here (before any test module imports triton). On a GPU host the variable is left alone
and the kernel tests run compiled on CUDA tensors.
"""

import os

try:
    import torch as _torch

    _has_cuda = _torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # tiny models: one intra-op thread is much faster, and keeps a loaded 2-core machine usable
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("P2PK3_THREADS", "1")
    _torch.set_num_threads(1)


import asyncio  # noqa: E402
import contextlib  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture
def seed():
    """A fresh random seed per test (torch and random), printed on failure by the tests; P2PK3_TEST_SEED
    replays one."""
    s = int(os.environ.get("P2PK3_TEST_SEED") or random.randrange(2**31))
    _torch.manual_seed(s)
    random.seed(s)
    return s


def rel(a, b) -> float:
    """Relative error |a - b| / |b| in float64 (kernels against references). `from conftest import rel`."""
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@contextlib.contextmanager
def local_ring(model_dir=None, nodes: int = 2, **kw):
    """A LocalRing of `p2pk3 node` processes (the embedded model by default), started and always ended
    (a daemon that fails to start ends the others too). `from conftest import local_ring`."""
    from p2pk3.engine.reference import default_model_dir
    from p2pk3.node.local import LocalRing

    with LocalRing(model_dir or default_model_dir(), nodes, **kw) as r:
        yield r


@contextlib.contextmanager
def api_beside(ring, keydir, key: str, **kw):
    """The OpenAI / Anthropic API (`p2pk3 serve` in a subprocess) in front of a LocalRing, its key in a file
    under `keydir`, always stopped. `from conftest import api_beside`."""
    from p2pk3.api import start_api_in_background
    from p2pk3.node.local import free_ports

    keyfile = keydir / "key"
    keyfile.write_text(key + "\n")
    a = start_api_in_background(ring.topology, "127.0.0.1", free_ports(1)[0], keyfile, **kw)
    try:
        yield a
    finally:
        a.stop()


def run(coro, timeout: float = 30.0, loop: str = "asyncio"):
    """Run a test coroutine with a deadline (`loop="uvloop"` on uvloop): nothing in a test waits forever.
    Test modules import it: `from conftest import run`."""

    async def guarded():
        return await asyncio.wait_for(coro, timeout)

    factory = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as r:
        return r.run(guarded())


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory):
    """A random tiny-K3 checkpoint in the published layout (3 shards, `language_model.` prefix, MXFP4 experts)."""
    from p2pk3.checkpoint.tiny import write_checkpoint
    from p2pk3.model.config import TINY_K3

    d = tmp_path_factory.mktemp("tiny-k3")
    write_checkpoint(d, TINY_K3, seed=0, shards=3)
    return d


# ---------------------------------------------------------------------------------------------------
# No silent skips in CI: with CI=true (set by .ci/run's caller) a test skipped for a missing dependency
# (fla, triton, transformers, ...) or missing privileges (network namespaces need root) is a failure.
# Only skips whose reason starts with "GPU:" (needs a CUDA device) stay skips.
def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not (_ci() and rep.skipped) or hasattr(rep, "wasxfail"):
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    if reason.removeprefix("Skipped: ").startswith("GPU:"):
        return
    rep.outcome = "failed"
    rep.longrepr = f"skipped under CI=true, which must not happen: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    rep = outcome.get_result()
    if _ci() and rep.skipped:  # a whole module skipped at import (pytest.importorskip at module level)
        rep.outcome = "failed"
        rep.longrepr = f"module skipped under CI=true, which must not happen: {rep.longrepr}"

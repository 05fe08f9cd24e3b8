"""Network namespaces for multi-host tests on one machine (Linux, root, iproute2).

    with NetnsLab(3) as lab:             # 3 namespaces p2k3t-<rand>-0..2 on a private bridge
        lab.addr(1)                      # "10.213.<k>.11"
        lab.broadcast                    # "10.213.<k>.255"
        lab.run(0, ["ping", "-c1", lab.addr(1)])
        p = lab.popen(1, [sys.executable, "-c", "..."])
        lab.split([0, 4])                # a partition: hosts 0 and 4 on a bridge of their own
        lab.heal()                       # every host on the one bridge again

Each namespace gets a veth pair whose other end is enslaved to a Linux bridge created in the test's own
namespace. The bridge has no IP address and the namespaces have no default route, so every packet stays
between these namespaces (addresses 10.213.<k>.0/24 exist only inside them). The context manager always
removes what it created (namespaces, and with them the veths; the bridge), also when setup fails.
Use `require_netns()` (pytest.skip with the reason) before building a lab.
"""

from __future__ import annotations

import os
import random
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]


def netns_unavailable_reason() -> str | None:
    """None when namespaces can be used here; otherwise why not."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespace tests need root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is missing"
    probe = f"p2k3probe-{secrets.token_hex(3)}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create network namespaces here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require_netns() -> None:
    import pytest

    reason = netns_unavailable_reason()
    if reason:
        pytest.skip(reason)


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {r.stderr.strip()}")


class NetnsLab:
    def __init__(self, n: int, subnet: int | None = None):
        if not 1 <= n <= 200:
            raise ValueError("1..200 namespaces")
        self.n = n
        self.tag = secrets.token_hex(3)
        self.k = subnet if subnet is not None else random.randint(1, 254)
        self.names = [f"p2k3t-{self.tag}-{i}" for i in range(n)]
        self.bridge = f"p2k3b{self.tag}"  # <= 15 characters
        self.island = f"p2k3i{self.tag}"  # the second bridge of a partition (split / heal)
        self.split_off: list[int] = []
        self._created_ns: list[str] = []
        self._bridge_created = False

    # ---------------------------------------------------------------- addresses
    def addr(self, i: int) -> str:
        return f"10.213.{self.k}.{10 + i}"

    @property
    def broadcast(self) -> str:
        return f"10.213.{self.k}.255"

    # ---------------------------------------------------------------- lifecycle
    def __enter__(self) -> "NetnsLab":
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._bridge_created = True
            _ip("link", "set", self.bridge, "up")
            for i, ns in enumerate(self.names):
                _ip("netns", "add", ns)
                self._created_ns.append(ns)
                host_end, ns_end = f"p2k3{self.tag}h{i}"[:15], f"p2k3{self.tag}n{i}"[:15]
                _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
                try:
                    _ip("link", "set", ns_end, "netns", ns)
                except Exception:
                    subprocess.run(["ip", "link", "del", host_end], capture_output=True)
                    raise
                _ip("link", "set", host_end, "master", self.bridge)
                _ip("link", "set", host_end, "up")
                _ip("-n", ns, "link", "set", ns_end, "name", "eth0")
                _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "brd", "+", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()

    def cleanup(self) -> None:
        for ns in reversed(self._created_ns):  # deleting a namespace deletes its veth end and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self._created_ns.clear()
        if self._bridge_created:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
            subprocess.run(["ip", "link", "del", self.island], capture_output=True)  # absent unless split
            self._bridge_created = False

    def set_link(self, i: int, up: bool) -> None:
        """Take host i's cable out (or put it back): its veth end on the bridge goes down / up."""
        _ip("link", "set", f"p2k3{self.tag}h{i}"[:15], "up" if up else "down")

    def split(self, side: Sequence[int]) -> None:
        """Partition the hosts: those of `side` go to a bridge of their own; they reach each other, and the
        rest reach each other, but no packet crosses (the cables stay in: no link goes down)."""
        if self.split_off:
            raise RuntimeError("already split; heal() first")
        _ip("link", "add", self.island, "type", "bridge")
        _ip("link", "set", self.island, "up")
        for i in side:
            _ip("link", "set", f"p2k3{self.tag}h{i}"[:15], "master", self.island)
        self.split_off = list(side)

    def heal(self) -> None:
        """End the partition: every host on the one bridge again."""
        for i in self.split_off:
            _ip("link", "set", f"p2k3{self.tag}h{i}"[:15], "master", self.bridge)
        self.split_off = []
        subprocess.run(["ip", "link", "del", self.island], capture_output=True)

    # ---------------------------------------------------------------- running things inside
    def ns(self, i: int) -> str:
        return self.names[i]

    def run(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess:
        return run_in_ns(self.names[i], argv, **kw)

    def popen(self, i: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen:
        return popen_in_ns(self.names[i], argv, **kw)


def _env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def run_in_ns(
    ns: str,
    argv: Sequence[str],
    *,
    timeout: float = 30,
    check: bool = False,
    env: dict[str, str] | None = None,
    **kw: Any,
) -> subprocess.CompletedProcess:
    """Run argv inside namespace `ns` (the repo is on PYTHONPATH); captures text output."""
    kw.setdefault("capture_output", True)
    kw.setdefault("text", True)
    return subprocess.run(
        ["ip", "netns", "exec", ns, *argv], timeout=timeout, check=check, env=_env(env), cwd=str(REPO), **kw
    )


def popen_in_ns(ns: str, argv: Sequence[str], *, env: dict[str, str] | None = None, **kw: Any) -> subprocess.Popen:
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    kw.setdefault("text", True)
    return subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=_env(env), cwd=str(REPO), **kw)

"""Integrity at load: each shard a node reads is checked against the manifest (size always, SHA-256 on
first use or after a change, cached by size+mtime); `p2pk3 node` on a bad shard exits 1 naming the file."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from p2pk3.checkpoint.tiny import write_checkpoint
from p2pk3.deploy.integrity import check_slot
from p2pk3.deploy.manifest import MANIFEST_FILE, IntegrityError, Manifest, check_files
from p2pk3.model.config import TINY_K3
from p2pk3.node.local import free_ports
from p2pk3.topology import Topology


def make_dir(d: Path) -> Path:
    write_checkpoint(d, TINY_K3, seed=0, shards=3)
    m = Manifest(d, repo="org/tiny", commit="0" * 40)
    for p in d.iterdir():
        if p.is_file() and p.name != MANIFEST_FILE:
            e = m.record(p.name, hashlib.sha256(p.read_bytes()).hexdigest(), "hub:test")
            e.verified = None  # as if never checked on this host
    m.save()
    return d


SHARD = "model-00001-of-00003.safetensors"


def test_hash_on_first_use_then_cached_then_rehashed_after_a_change(tmp_path):
    d = make_dir(tmp_path / "m")
    r1 = check_files(d, [SHARD])
    assert r1.hashed == [SHARD] and r1.cached == []
    r2 = check_files(d, [SHARD])  # a restart: the manifest remembers the verified size + mtime
    assert r2.hashed == [] and r2.cached == [SHARD]
    p = d / SHARD
    st = p.stat()
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched: hashed again (still good)
    assert check_files(d, [SHARD]).hashed == [SHARD]


def test_corrupt_truncated_missing_and_unknown_are_named(tmp_path):
    d = make_dir(tmp_path / "m")
    p = d / SHARD
    data = bytearray(p.read_bytes())
    data[100] ^= 0xFF
    p.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as e:
        check_files(d, [SHARD])
    assert str(e.value).startswith(f"{p}: corrupt: SHA-256 ") and "does not match the manifest's" in str(e.value)
    p.write_bytes(bytes(data[:1000]))
    with pytest.raises(IntegrityError, match=rf"^{p}: truncated: 1000 bytes, the manifest says {len(data)}; "):
        check_files(d, [SHARD])
    p.unlink()
    with pytest.raises(IntegrityError, match=rf"^{p}: missing \(the manifest .* lists it with {len(data)} bytes\)"):
        check_files(d, [SHARD])
    (d / "x.safetensors").write_bytes(b"1")
    with pytest.raises(IntegrityError, match=r"x\.safetensors: not in the manifest .*run `p2pk3 download`"):
        check_files(d, ["x.safetensors"])


def test_check_slot_checks_exactly_the_slots_shards(tmp_path):
    d = make_dir(tmp_path / "m")
    topo = Topology.from_dict(
        {
            "cluster": {"name": "t"},
            "model": {"path": str(d)},
            "slots": [
                {"id": "a", "gpu_memory_gb": 2, "layers": [0, 1]},
                {"id": "b", "gpu_memory_gb": 2, "layers": [2, 5]},
            ],
        }
    )
    last = "model-00003-of-00003.safetensors"
    (d / last).write_bytes(b"broken")  # only slot b reads it
    rep = check_slot(d, TINY_K3, topo.slot_plan("a", TINY_K3))
    assert last not in rep.hashed + rep.cached and rep.hashed
    with pytest.raises(IntegrityError, match=rf"{last}: truncated"):
        check_slot(d, TINY_K3, topo.slot_plan("b", TINY_K3))
    (d / MANIFEST_FILE).unlink()
    assert check_slot(d, TINY_K3, topo.slot_plan("a", TINY_K3)) is None  # no manifest: nothing to check


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["corrupt", "truncated"])
def test_node_on_a_bad_shard_exits_1_naming_the_file(tmp_path, fault):
    d = make_dir(tmp_path / "m")
    p = d / SHARD
    data = bytearray(p.read_bytes())
    if fault == "corrupt":
        data[-5] ^= 0x01
        p.write_bytes(bytes(data))
    else:
        p.write_bytes(bytes(data[:-10]))
    port, bport = free_ports(2)
    (tmp_path / "secret").write_text("k" * 32)
    t = tmp_path / "t.toml"
    t.write_text(
        f'[cluster]\nname = "t"\nsecret_file = "secret"\nbeacon_port = {bport}\n'
        f'beacon_addrs = ["127.255.255.255"]\n[model]\npath = "{d}"\n'
        f'[[slots]]\nid = "s0"\nhost = "127.0.0.1"\nport = {port}\ngpu_memory_gb = 2\nlayers = [0, 5]\n'
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2pk3.cli",
            "node",
            "--topology",
            str(t),
            "--slot",
            "s0",
            "--no-discovery",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Error: {p}: {fault}") and "Traceback" not in r.stderr

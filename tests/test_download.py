"""`p2pk3 download` with the real huggingface_hub client against a local stand-in of the hub
(tests/hub_standin.py, HF_ENDPOINT=http://127.0.0.1:PORT), and LAN sharing between daemons."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from hub_standin import HubStandIn
from ring_helpers import ring_in_thread
from p2pk3.checkpoint.loader import canonical_name
from p2pk3.checkpoint.tiny import write_checkpoint
from p2pk3.cli import main
from p2pk3.deploy.manifest import MANIFEST_FILE, Manifest
from p2pk3.model.config import TINY_K3
from p2pk3.node.local import free_ports

SECRET = "s3cret-" * 6


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    d = tmp_path_factory.mktemp("hubrepo")
    write_checkpoint(d, TINY_K3, seed=0, shards=3)
    (d / "tokenizer.json").write_text('{"model": {}}')
    (d / "generation_config.json").write_text('{"max_new_tokens": 8}')
    (d / "README.md").write_text("model card")
    (d / "extra.bin").write_bytes(b"\x01" * 1000)
    return d


@pytest.fixture
def hub(repo):
    with HubStandIn(repo) as h:
        yield h


def write_topology(
    d: Path,
    hosts=("127.0.0.1", "127.0.0.1", "10.255.1.1"),
    ports=None,
    layers=((0, 1), (2, 3), (4, 5)),
    path="model",
    standby=False,
) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "secret").write_text(SECRET)
    ports = ports or free_ports(len(hosts) + 1)
    lines = [
        "[cluster]",
        'name = "t"',
        'secret_file = "secret"',
        'beacon_addrs = ["127.255.255.255"]',
        f"beacon_port = {ports[-1]}",
        "[model]",
        f'path = "{path}"',
    ]
    for i, (h, l) in enumerate(zip(hosts, layers)):
        lines += [
            "[[slots]]",
            f'id = "s{i}"',
            f'host = "{h}"',
            f"port = {ports[i]}",
            "gpu_memory_gb = 2",
            f"layers = [{l[0]}, {l[1]}]",
        ]
    if standby:
        lines += [
            "[[slots]]",
            'id = "spare"',
            'host = "127.0.0.1"',
            f"port = {ports[len(hosts)]}",
            "gpu_memory_gb = 2",
            "standby = true",
        ]
    p = d / "topo.toml"
    p.write_text("\n".join(lines) + "\n")
    return p


def shards_for(repo: Path, layers: set[int], embed=False, head=False) -> set[str]:
    """Independent of the code under test: shards holding tensors of these layers / embedding / head."""
    wm = json.loads((repo / "model.safetensors.index.json").read_text())["weight_map"]
    out = set()
    for stored, fn in wm.items():
        n = canonical_name(stored)
        if n.startswith("model.layers."):
            if int(n.split(".")[2]) in layers:
                out.add(fn)
        elif n == "model.embed_tokens.weight" and (embed or (head and TINY_K3.tie_word_embeddings)):
            out.add(fn)
        elif n.startswith(("model.norm", "model.output_attn_res", "lm_head")) and head:
            out.add(fn)
    return out


def all_shards(repo):
    return {p.name for p in repo.glob("model-*.safetensors")}


def run(args, env=None):
    env = {k: v for k, v in (env or {}).items()}
    env.setdefault("HF_HUB_OFFLINE", "0")
    r = CliRunner().invoke(main, args, env=env)
    return r


def fetched(hub) -> set[str]:
    return {e[1] for e in hub.log if e[0] == "GET" and not e[1].startswith("/api/")}


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------ hub
def test_only_the_slots_shards_are_fetched_and_verified(tmp_path, hub, repo):
    t = write_topology(tmp_path)
    r = run(["download", "--topology", str(t), "--slot", "s0", "--repo", hub.repo, "--quiet"], {"HF_ENDPOINT": hub.url})
    assert r.exit_code == 0, r.output
    want = shards_for(repo, {0, 1}, embed=True)
    assert want < all_shards(repo)  # the test means something: s0 does not need every shard
    got = fetched(hub)
    assert got & all_shards(repo) == want
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "generation_config.json"} <= got
    assert "README.md" not in got and "extra.bin" not in got
    m = Manifest.load(tmp_path / "model")
    for n in want | {"config.json", "tokenizer.json"}:
        assert m.files[n].sha256 == sha(repo / n) and m.files[n].source.startswith("hub:org/tiny-k3@")
        assert (tmp_path / "model" / n).read_bytes() == (repo / n).read_bytes()
    assert m.commit == hub.commit
    # a second run fetches nothing: everything is verified in place
    hub.log.clear()
    r = run(["download", "--topology", str(t), "--slot", "s0", "--repo", hub.repo, "--quiet"], {"HF_ENDPOINT": hub.url})
    assert r.exit_code == 0, r.output
    assert fetched(hub) == set() and "0 file(s) from the hub" in r.output


def test_all_local_takes_the_slots_of_this_host(tmp_path, hub, repo):
    t = write_topology(tmp_path)  # s0, s1 on 127.0.0.1; s2 on 10.255.1.1 (not this machine)
    r = run(["download", "--topology", str(t), "--all-local", "--repo", hub.repo, "--quiet"], {"HF_ENDPOINT": hub.url})
    assert r.exit_code == 0, r.output
    assert "slots s0, s1 ->" in r.output
    assert fetched(hub) & all_shards(repo) == shards_for(repo, {0, 1, 2, 3}, embed=True)
    t2 = write_topology(tmp_path / "far", hosts=("10.255.1.1", "10.255.1.2", "10.255.1.3"))
    r = run(["download", "--topology", str(t2), "--all-local", "--repo", hub.repo], {"HF_ENDPOINT": hub.url})
    assert r.exit_code == 1 and "no slot of" in r.output and "has a host of this machine" in r.output


def test_interrupted_download_resumes_and_ends_verified(tmp_path, hub, repo):
    t = write_topology(tmp_path)
    shard = sorted(shards_for(repo, {4, 5}, head=True))[-1]
    hub.cut_once.add(shard)  # the connection drops in the middle of this file, once
    r = run(["download", "--topology", str(t), "--slot", "s2", "--repo", hub.repo, "--quiet"], {"HF_ENDPOINT": hub.url})
    assert r.exit_code == 0, r.output
    assert len(hub.gets(shard)) == 2 and not hub.cut_once
    assert sha(tmp_path / "model" / shard) == sha(repo / shard)
    # a process killed mid-file leaves its .part: the next run asks only for the rest (Range)
    (tmp_path / "model" / shard).unlink()
    half = (repo / shard).stat().st_size // 2
    part = tmp_path / "model" / ".p2pk3-download" / (shard + ".part")
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes((repo / shard).read_bytes()[:half])
    hub.log.clear()
    r = run(["download", "--topology", str(t), "--slot", "s2", "--repo", hub.repo, "--quiet"], {"HF_ENDPOINT": hub.url})
    assert r.exit_code == 0, r.output
    assert [e[2] for e in hub.gets(shard)] == [f"bytes={half}-"]
    assert sha(tmp_path / "model" / shard) == sha(repo / shard) and not part.exists()
    assert Manifest.load(tmp_path / "model").files[shard].sha256 == sha(repo / shard)


def test_corrupt_transfer_is_caught_and_named(tmp_path, hub, repo):
    t = write_topology(tmp_path)
    shard = sorted(shards_for(repo, {2, 3}))[0]
    hub.corrupt.add(shard)
    r = run(["download", "--topology", str(t), "--slot", "s1", "--repo", hub.repo, "--quiet"], {"HF_ENDPOINT": hub.url})
    assert r.exit_code == 1
    last = r.output.strip().splitlines()[-1]
    assert f"{shard}: corrupt download from hub:org/tiny-k3@" in last and "does not match" in last
    assert "the file was removed" in last and "Traceback" not in r.output
    assert not (tmp_path / "model" / shard).exists()
    assert shard not in Manifest.load(tmp_path / "model").files


def test_token_and_unknown_repo(tmp_path, repo):
    t = write_topology(tmp_path)
    with HubStandIn(repo, token="hf_good") as hub:
        r = run(["download", "--topology", str(t), "--slot", "s0", "--repo", hub.repo], {"HF_ENDPOINT": hub.url})
        assert r.exit_code == 1 and "refused access (HTTP 401): set HF_TOKEN" in r.output
        r = run(
            ["download", "--topology", str(t), "--slot", "s0", "--repo", hub.repo, "--quiet"],
            {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_good"},
        )
        assert r.exit_code == 0, r.output
        r = run(
            ["download", "--topology", str(t), "--slot", "s0", "--repo", hub.repo, "--revision", "nope"],
            {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_good"},
        )
        assert r.exit_code == 1 and "revision 'nope' not found in org/tiny-k3" in r.output


def _spoil_in_place(p: Path) -> None:
    """Same size, different bytes, and a new mtime (as any write leaves; set explicitly so that a coarse
    file-system clock cannot make the spoiled file look unchanged to the manifest's (size, mtime) cache)."""
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    st = p.stat()
    p.write_bytes(bytes(data))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


@pytest.mark.parametrize("listed", ["listed", "unlisted", "no manifest"])
@pytest.mark.parametrize("kind", ["shard", "small file"])
def test_a_wrong_file_already_in_place_is_fetched_again(tmp_path, hub, repo, kind, listed):
    t = write_topology(tmp_path)
    args = ["download", "--topology", str(t), "--slot", "s0", "--repo", hub.repo, "--quiet"]
    assert run(args, {"HF_ENDPOINT": hub.url}).exit_code == 0
    model = tmp_path / "model"
    name = sorted(shards_for(repo, {0, 1}, embed=True))[0] if kind == "shard" else "generation_config.json"
    _spoil_in_place(model / name)
    assert (model / name).stat().st_size == (repo / name).stat().st_size and sha(model / name) != sha(repo / name)
    if listed == "unlisted":  # placed by hand: the manifest has no entry for it
        m = Manifest.load(model)
        del m.files[name]
        (model / MANIFEST_FILE).write_text(json.dumps(m.to_dict()))
    elif listed == "no manifest":
        (model / MANIFEST_FILE).unlink()
    hub.log.clear()
    r = run(args, {"HF_ENDPOINT": hub.url})
    assert r.exit_code == 0, r.output
    assert fetched(hub) == {name}  # that file again, nothing else
    assert sha(model / name) == sha(repo / name)
    assert Manifest.load(model).files[name].sha256 == sha(repo / name)


def test_a_file_the_hub_changed_since_the_manifest_is_fetched_again(tmp_path, repo):
    """The manifest lists the old content (verified then, unchanged since); the hub's new commit has a file
    of the same size and other content: it is fetched again, small files (checked by git blob id) included."""
    src = tmp_path / "hubrepo"
    shutil.copytree(repo, src)
    t = write_topology(tmp_path)
    args = ["download", "--topology", str(t), "--slot", "s0", "--repo", "org/tiny-k3", "--quiet"]
    with HubStandIn(src) as hub:
        assert run(args, {"HF_ENDPOINT": hub.url}).exit_code == 0
    shard = sorted(shards_for(repo, {0, 1}, embed=True))[0]
    for name in ("generation_config.json", shard):
        _spoil_in_place(src / name)  # the new revision on the hub
    with HubStandIn(src, commit="beef" * 10) as hub:
        r = run(args, {"HF_ENDPOINT": hub.url})
        assert r.exit_code == 0, r.output
        assert fetched(hub) == {"generation_config.json", shard}
    model = tmp_path / "model"
    for name in ("generation_config.json", shard):
        assert sha(model / name) == sha(src / name)
        assert Manifest.load(model).files[name].sha256 == sha(src / name)


def test_offline_uses_what_is_there_and_names_what_is_missing(tmp_path, hub, repo):
    t = write_topology(tmp_path)
    assert (
        run(
            ["download", "--topology", str(t), "--slot", "s0", "--repo", hub.repo, "--quiet"], {"HF_ENDPOINT": hub.url}
        ).exit_code
        == 0
    )
    hub.log.clear()
    r = run(
        ["download", "--topology", str(t), "--slot", "s0", "--quiet"], {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.url}
    )
    assert r.exit_code == 0, r.output
    assert "(offline)" in r.output and hub.log == []
    missing = sorted(shards_for(repo, {4, 5}, head=True) - shards_for(repo, {0, 1}, embed=True))
    assert missing
    r = run(["download", "--topology", str(t), "--slot", "s2"], {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": hub.url})
    assert r.exit_code == 1 and hub.log == []
    assert (
        f"offline (HF_HUB_OFFLINE=1): {len(missing)} file(s) needed here are missing in "
        f"{tmp_path / 'model'}: {', '.join(missing)}; run without HF_HUB_OFFLINE, or with --from-peers"
    ) in r.output


# ------------------------------------------------------------------------------------------ peers
@pytest.fixture
def full_dir(tmp_path, hub, repo):
    """A model directory with every file, fetched and recorded by `p2pk3 download`."""
    t = write_topology(tmp_path / "a", hosts=("127.0.0.1",), layers=((0, 5),), path=str(tmp_path / "full"))
    r = run(["download", "--topology", str(t), "--slot", "s0", "--repo", hub.repo, "--quiet"], {"HF_ENDPOINT": hub.url})
    assert r.exit_code == 0, r.output
    hub.log.clear()
    return tmp_path / "full"


def peer_ring(topo_path):
    """The daemons of these tests (started by `ring.call(ring.start(slot, model_dir))`) in a thread's loop, as
    the CLI under test runs loops of its own."""
    from p2pk3.topology import Topology

    topo = Topology.load(topo_path)
    return ring_in_thread(
        topo, None, slots=(), secret=topo.secret(), host="127.0.0.1", claim_wait=0.1, dead_after_s=30, heartbeat_s=5
    )


def test_from_peers_fetches_from_the_peer_not_the_hub(tmp_path, hub, repo, full_dir):
    t = write_topology(tmp_path / "ring", hosts=("127.0.0.1", "127.0.0.1"), layers=((0, 2), (3, 5)), path=str(full_dir))
    with peer_ring(t) as ring:
        d = ring.call(ring.start("s0", full_dir))
        new = tmp_path / "new"
        r = run(
            [
                "download",
                "--topology",
                str(t),
                "--slot",
                "s1",
                "--local-dir",
                str(new),
                "--repo",
                hub.repo,
                "--from-peers",
                "--peer-rate",
                "50",
                "--quiet",
            ],
            {"HF_ENDPOINT": hub.url},
        )
        assert r.exit_code == 0, r.output
        want = shards_for(repo, {3, 4, 5}, head=True)
        assert fetched(hub) == set()  # only the metadata call reached the hub
        assert [e[1] for e in hub.log if not e[1].startswith("/api/")] == []
        m = Manifest.load(new)
        port = Topology_port(t, "s0")
        for n in want:
            assert m.files[n].source == f"peer:127.0.0.1:{port}" and sha(new / n) == sha(repo / n)
        assert f"{len(want)} file(s) from the hub" not in r.output and "from peers" in r.output
        assert d._file_server.bytes_sent >= sum((repo / n).stat().st_size for n in want)


def Topology_port(t, sid):
    from p2pk3.topology import Topology

    return Topology.load(t).slot(sid).port


def test_a_peer_serves_only_manifest_files(tmp_path, hub, repo, full_dir):
    from p2pk3.transport.codec import Frame
    from p2pk3.transport.connection import open_connection

    (full_dir / "notes.txt").write_text("not a checkpoint file")
    outside = tmp_path / "outside.txt"
    outside.write_text("secret stuff")
    (full_dir / "evil.safetensors").symlink_to(outside)
    m = Manifest.load(full_dir)
    m.record("evil.safetensors", sha(outside), "local")  # even listed, a link out of the directory is refused
    m.save()
    t = write_topology(tmp_path / "ring", hosts=("127.0.0.1",), layers=((0, 5),), path=str(full_dir))
    with peer_ring(t) as ring:
        d = ring.call(ring.start("s0", full_dir))
        shard = sorted(all_shards(repo))[0]

        async def ask(conn, **kw):
            await conn.send(Frame.make("file_get", request_id="r1", **kw))
            return await asyncio.wait_for(conn.recv(), 10)

        async def go():
            conn = await open_connection("127.0.0.1", d.port, SECRET, "tester", timeout=5, handshake_timeout=5)
            out = {}
            try:
                for key, path in [
                    ("dotdot", "../outside.txt"),
                    ("abs", "/etc/passwd"),
                    ("notes", "notes.txt"),
                    ("manifest", MANIFEST_FILE),
                    ("link", "evil.safetensors"),
                ]:
                    out[key] = await ask(conn, path=path, offset=0, length=100)
                out["ok"] = await ask(conn, path=shard, offset=8, length=100)  # same connection: still served
                listing = Frame.make("file_list", request_id="r2")
                await conn.send(listing)
                out["list"] = await asyncio.wait_for(conn.recv(), 10)
            finally:
                conn.close()
            return out

        out = ring.call(go())
        msg = {k: v.header.get("message") for k, v in out.items() if v.kind == "error"}
        assert msg["dotdot"] == (
            "file_get refused: '../outside.txt' is not a plain relative file name of the model "
            "directory (no '..', no absolute path)"
        )
        assert "'/etc/passwd' is not a plain relative file name" in msg["abs"]
        assert msg["notes"] == (
            f"file_get refused: 'notes.txt' is not in this node's manifest {full_dir / MANIFEST_FILE}; "
            f"only verified checkpoint files are served"
        )
        assert f"'{MANIFEST_FILE}' is not in this node's manifest" in msg["manifest"]
        assert (
            msg["link"]
            == f"file_get refused: 'evil.safetensors' resolves outside the model directory {full_dir.resolve()}"
        )
        assert all(out[k].header["code"] == "bad_request" for k in msg)
        ok = out["ok"]
        assert ok.kind == "file_chunk" and bytes(ok.buffer("data")) == (repo / shard).read_bytes()[8:108]
        assert "evil.safetensors" not in out["list"].header["files"] and shard in out["list"].header["files"]
        assert d.stopped.is_set() is False


def test_standby_fetches_a_slots_shards_from_peers_before_taking_it_over(tmp_path, hub, repo, full_dir):
    t = write_topology(
        tmp_path / "ring", hosts=("127.0.0.1", "127.0.0.1"), layers=((0, 2), (3, 5)), path=str(full_dir), standby=True
    )
    spare_dir = tmp_path / "spare"
    r = run(
        [
            "download",
            "--topology",
            str(t),
            "--slot",
            "spare",
            "--local-dir",
            str(spare_dir),
            "--repo",
            hub.repo,
            "--quiet",
        ],
        {"HF_ENDPOINT": hub.url},
    )
    assert r.exit_code == 0, r.output
    assert not list(spare_dir.glob("model-*.safetensors"))  # a spare holds no shards, only config/index/tokenizer
    with peer_ring(t) as ring:
        ring.call(ring.start("s0", full_dir))
        b = ring.call(ring.start("spare", spare_dir))
        hub.log.clear()
        route = ring.call(b.take_over("s1", None))
        assert route.slot == "s1" and b.role == "stage"
        want = shards_for(repo, {3, 4, 5}, head=True)
        m = Manifest.load(spare_dir)
        assert {n for n in m.files if n.startswith("model-")} == want
        assert all(sha(spare_dir / n) == sha(repo / n) and m.files[n].source.startswith("peer:") for n in want)
        assert hub.log == []

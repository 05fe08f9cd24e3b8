"""The planner, topology and deploy commands as a new user meets them (issue 26): no figure that means
nothing, a shipped model checked like a downloaded one, a download that will not fill another model's
directory, a secret that exists before anything says "ok", refusals that name what does not fit."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from hub_standin import HubStandIn
from p2pk3.cli import main
import p2pk3
from p2pk3.deploy.manifest import MANIFEST_FILE, Manifest, sha256_file

ASSETS = Path(p2pk3.__file__).resolve().parent / "assets"
EMBEDDED = sorted(p for p in ASSETS.iterdir() if (p / "config.json").is_file())


def directory_files(d: Path) -> list[str]:
    """What a model directory's manifest must list (independent of the code under test): every file but
    the manifest, the model card and hidden ones (the manifest's lock file)."""
    return sorted(
        p.name
        for p in d.iterdir()
        if p.is_file() and p.name not in (MANIFEST_FILE, "README.md") and not p.name.startswith(".")
    )


def cli(*args, env=None, input=None):
    r = CliRunner().invoke(main, [str(a) for a in args], env=env, input=input, catch_exceptions=True)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise AssertionError(f"p2pk3 {' '.join(map(str, args))} raised {r.exception!r}:\n{r.output}")
    return r


def subprocess_cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "p2pk3.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout
    )


def hosts_file(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "NODES.toml"
    p.write_text(body)
    return p


# ---------------------------------------------------------------- 1. no bandwidth: no pace in ms
def test_plan_without_bandwidth_predicts_no_pace_and_says_why(tmp_path):
    nodes = hosts_file(tmp_path, '[[nodes]]\nname = "g"\ncount = 4\ngpu_memory_gb = 31.5\n')
    out = tmp_path / "t.toml"
    r = cli("plan", "--hosts", nodes, "--out", out)
    assert r.exit_code == 0, r.output
    assert "ms/token" not in r.output and "ms/token" not in out.read_text()  # no figure without a bandwidth
    assert "pace not predicted: no memory bandwidth known" in r.output
    assert "memory_bandwidth_gbs" in r.output and "rtx5090" in r.output  # how to get one
    assert "MiB/token" in r.output  # what the plan did balance


def test_plan_takes_the_datasheet_bandwidth_of_gpu_and_says_so(tmp_path):
    nodes = hosts_file(tmp_path, '[[nodes]]\nname = "g"\ncount = 4\ngpu_memory_gb = 31.5\ngpu = "rtx4090"\n')
    r = cli("plan", "--hosts", nodes, "--out", tmp_path / "t.toml")
    assert r.exit_code == 0, r.output
    assert "memory bandwidth: g 1008 GB/s (datasheet rtx4090)" in r.output
    pace = float(r.output.split("pace (slowest stage) ", 1)[1].split(" ms/token")[0])
    assert 0 < pace < 10  # a tiny model on a 4090: well under a millisecond per stage, plus overhead


def test_plan_mixed_known_and_unknown_bandwidth_is_refused(tmp_path):
    nodes = hosts_file(
        tmp_path,
        '[[nodes]]\nname = "a"\ngpu_memory_gb = 31.5\ngpu = "rtx5090"\n[[nodes]]\nname = "b"\ngpu_memory_gb = 31.5\n',
    )
    r = cli("plan", "--hosts", nodes)
    assert r.exit_code == 1 and "memory bandwidth unknown for b" in r.output and "gpu = " in r.output


# ---------------------------------------------------------------- 15. --hosts FILE, --nodes deprecated
def test_plan_hosts_file_and_the_deprecated_nodes_alias(tmp_path):
    nodes = hosts_file(tmp_path, '[[nodes]]\nname = "g"\ncount = 2\ngpu_memory_gb = 31.5\ngpu = "rtx5090"\n')
    new = cli("plan", "--hosts", nodes, "--out", tmp_path / "a.toml")
    assert new.exit_code == 0 and "deprecated" not in new.output, new.output
    old = cli("plan", "--nodes", nodes, "--out", tmp_path / "b.toml")
    assert old.exit_code == 0, old.output
    warn = [ln for ln in old.output.splitlines() if "deprecated" in ln]
    assert len(warn) == 1 and "--hosts FILE" in warn[0]
    assert (tmp_path / "a.toml").read_text() == (tmp_path / "b.toml").read_text()
    r = cli("plan")
    assert r.exit_code == 2 and "missing --hosts FILE" in r.output
    assert "--hosts" in cli("plan", "--help").output and "--nodes" not in cli("plan", "--help").output


# ---------------------------------------------------------------- 6. the CUDA reserve is named
def test_plan_refusal_names_the_cuda_reserve_and_proposes_overhead_gb(tmp_path):
    nodes = hosts_file(tmp_path, '[[nodes]]\nname = "g"\ncount = 2\ngpu_memory_gb = 1.0\nmemory_bandwidth_gbs = 100\n')
    r = cli("plan", "--hosts", nodes)
    assert r.exit_code == 1, r.output
    assert "CUDA reserve 1.00" in r.output and "--overhead-gb 0." in r.output
    fix = r.output.split("--overhead-gb 0.", 1)[1][:2]
    ok = cli("plan", "--hosts", nodes, "--overhead-gb", f"0.{fix}", "--out", tmp_path / "t.toml")
    assert ok.exit_code == 0, ok.output  # the proposal is checked by planning again


def test_topology_check_advises_the_cuda_reserve_not_fewer_layers_when_weights_are_tiny(tmp_path):
    r = cli("topology", "init", "--nodes", "2", "--gpu-memory-gb", "1.0", "--out", tmp_path / "t.toml")
    assert r.exit_code == 1, r.output
    assert "fewer layers" not in r.output
    assert "CUDA reserve 1.00 GiB" in r.output and "overhead_gb" in r.output and "--overhead-gb" in r.output


# ---------------------------------------------------------------- 4. / 21. the secret file
def test_topology_check_refuses_a_missing_secret_and_systemd_warns(tmp_path):
    nodes = hosts_file(
        tmp_path,
        '[[nodes]]\nname = "g"\ncount = 2\ngpu_memory_gb = 31.5\ngpu = "rtx5090"\nhost = "127.0.0.1"\nport = 47920\n',
    )
    topo = tmp_path / "t.toml"
    assert cli("plan", "--hosts", nodes, "--out", topo).exit_code == 0
    assert cli("topology", "check", topo, "--quiet").exit_code == 0
    (tmp_path / "cluster.key").unlink()
    r = cli("topology", "check", topo, "--quiet")
    assert r.exit_code == 1 and "ok (" not in r.output, r.output
    assert "cluster.key does not exist" in r.output and "p2pk3 secret --out" in r.output
    tables = cli("topology", "check", topo)
    assert tables.exit_code == 1 and "CUDA context" in tables.output  # the memory tables all the same
    s = cli("systemd", "--topology", topo, "--out", tmp_path / "units")
    assert s.exit_code == 0 and "warning: secret file" in s.output and "does not exist" in s.output, s.output


@pytest.mark.parametrize("how", ["plan", "init"])
def test_plan_and_topology_init_write_and_create_the_same_secret(tmp_path, how):
    topo = tmp_path / "t.toml"
    if how == "plan":
        nodes = hosts_file(tmp_path, '[[nodes]]\nname = "g"\ncount = 2\ngpu_memory_gb = 31.5\n')
        r = cli("plan", "--hosts", nodes, "--out", topo)
    else:
        r = cli("topology", "init", "--nodes", "2", "--out", topo)
    assert r.exit_code == 0, r.output
    from p2pk3.topology import Topology

    t = Topology.load(topo)
    assert t.cluster.secret_file == "cluster.key"
    key = tmp_path / "cluster.key"
    assert key.is_file() and oct(key.stat().st_mode & 0o777) == "0o600" and str(key) in r.output
    assert t.secret() == key.read_bytes().strip()
    again = cli("topology", "init", "--nodes", "2", "--out", tmp_path / "u.toml")
    assert "existing cluster secret" in again.output and key.read_bytes().strip() == t.secret()


# ---------------------------------------------------------------- 17. simulate --plot
def test_simulate_plot_without_matplotlib_names_the_plot_extra(tmp_path, monkeypatch):
    topo = tmp_path / "t.toml"
    assert cli("topology", "init", "--nodes", "2", "--out", topo).exit_code == 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    r = cli("simulate", "--topology", topo, "--plot", tmp_path / "p.png")
    assert r.exit_code == 1 and "pip install -e '.[plot]'" in r.output and "[train]" not in r.output, r.output


# ---------------------------------------------------------------- 2. the embedded models' manifests
@pytest.mark.parametrize("model", EMBEDDED, ids=lambda p: p.name)
def test_shipped_manifest_matches_the_shipped_files(model):
    """A retrained model must regenerate it: `p2pk3 manifest p2pk3/assets/NAME` (the model card says so)."""
    m = Manifest.load(model)
    assert m is not None and m.shipped, f"{model} ships without {MANIFEST_FILE}: run `p2pk3 manifest {model}`"
    assert sorted(m.files) == directory_files(model), f"run `p2pk3 manifest {model}`"
    for name, e in m.files.items():
        assert e.verified is None  # nothing machine-specific in a shipped file
        assert (model / name).stat().st_size == e.size and sha256_file(model / name) == e.sha256, (
            f"{name} changed: run `p2pk3 manifest {model}`"
        )
    assert "p2pk3 manifest" in (model / "README.md").read_text()


def test_loading_the_shipped_model_checks_it_and_writes_nothing_into_the_package():
    from p2pk3.deploy.integrity import check_checkpoint

    model = EMBEDDED[0]
    before = (model / MANIFEST_FILE).read_bytes()
    rep = check_checkpoint(model)
    assert rep is not None and sorted(rep.hashed) == sorted(
        n for n in Manifest.load(model).files if n.endswith(".safetensors")
    )
    assert (model / MANIFEST_FILE).read_bytes() == before and not (model / ".p2pk3-manifest.lock").exists()


def _flip_4k(p: Path, at: int = 1 << 20) -> None:
    with open(p, "r+b") as f:
        f.seek(at)
        b = f.read(4096)
        f.seek(at)
        f.write(bytes(x ^ 0xFF for x in b))


@pytest.fixture
def corrupt_copy(tmp_path):
    d = tmp_path / "k3-docs"
    shutil.copytree(ASSETS / "k3-docs", d)
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    _flip_4k(shard)
    return d, shard


def test_generate_refuses_a_corrupt_shard_of_the_embedded_model(corrupt_copy):
    d, shard = corrupt_copy
    r = cli("generate", "--model", d, "--prompt", "What is a tuple?", "--max-tokens", "4")
    assert r.exit_code == 1, r.output
    line = r.output.strip().splitlines()[-1]
    assert f"{shard}: corrupt" in line and "copy it again from the embedded model" in line, line
    assert f"p2pk3 manifest {d}" in line


@pytest.mark.slow
def test_local_refuses_a_corrupt_shard_of_the_embedded_model(corrupt_copy):
    d, shard = corrupt_copy
    r = subprocess_cli("local", "--model", d, "--nodes", "2", "--prompt", "What is a tuple?", "--max-tokens", "4")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{shard}: corrupt" in r.stderr and "copy it again from the embedded model" in r.stderr, r.stderr


def test_manifest_command_records_a_local_model_that_is_then_checked(tmp_path):
    d = tmp_path / "mine"
    shutil.copytree(ASSETS / "k3-docs", d)
    (d / MANIFEST_FILE).unlink()
    r = cli("manifest", d)
    assert r.exit_code == 0 and f"wrote {d / MANIFEST_FILE}" in r.output, r.output
    m = Manifest.load(d)
    assert not m.shipped and m.repo is None and sorted(m.files) == directory_files(d)
    assert all(e.source == "local" and e.verified for e in m.files.values())
    shard = sorted(d.glob("model-*.safetensors"))[0]
    _flip_4k(shard, at=4096)
    bad = cli("generate", "--model", d, "--prompt", "hi", "--max-tokens", "2")
    assert bad.exit_code == 1 and f"{shard}: corrupt" in bad.output and f"p2pk3 manifest {d}" in bad.output
    assert cli("manifest", tmp_path / "nowhere").exit_code == 1


# ---------------------------------------------------------------- 5. download into the right directory
def _topology(tmp_path: Path, model_path: Path | None = None) -> Path:
    nodes = hosts_file(
        tmp_path,
        '[[nodes]]\nname = "g"\ncount = 2\ngpu_memory_gb = 31.5\ngpu = "rtx5090"\nhost = "127.0.0.1"\nport = 47920\n',
    )
    topo = tmp_path / "t.toml"
    assert cli("plan", "--hosts", nodes, "--out", topo).exit_code == 0
    if model_path is not None:
        topo.write_text(topo.read_text().replace(f'path = "{ASSETS / "k3-docs"}"', f'path = "{model_path}"'))
    return topo


@pytest.fixture
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    for p in (ASSETS / "k3-docs").iterdir():
        if p.name != MANIFEST_FILE:
            shutil.copy(p, root / p.name)
    cfg = json.loads((root / "config.json").read_text())
    cfg["text_config"]["rope_theta"] = cfg["text_config"].get("rope_theta", 1e4) * 2  # another model's config
    (root / "config.json").write_text(json.dumps(cfg))
    with HubStandIn(root, repo="moonshotai/Kimi-K3") as h:
        yield h


def test_download_refuses_the_embedded_models_directory(tmp_path, hub):
    topo = _topology(tmp_path)  # [model] path: the embedded model (plan without --model)
    r = cli(
        "download",
        "--topology",
        topo,
        "--all-local",
        "--repo",
        hub.repo,
        "--quiet",
        env={"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"},
    )
    assert r.exit_code == 1, r.output
    assert "is a model shipped with p2pk3" in r.output and "--local-dir" in r.output and hub.repo in r.output
    assert [e for e in hub.log if e[0] == "GET" and not e[1].startswith("/api/")] == []  # nothing fetched


def test_download_refuses_a_directory_of_another_repo_or_model(tmp_path, hub):
    d = tmp_path / "model"
    shutil.copytree(ASSETS / "k3-docs", d)
    m = Manifest.load(d)
    m.shipped, m.repo = False, "org/other"
    m.path.write_text(json.dumps(m.to_dict()))
    topo = _topology(tmp_path, d)
    env = {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"}
    r = cli("download", "--topology", topo, "--all-local", "--repo", hub.repo, "--quiet", env=env)
    assert r.exit_code == 1 and f"{d} holds org/other" in r.output and "--repo org/other" in r.output, r.output
    (d / MANIFEST_FILE).unlink()  # no manifest: the config tells
    before = (d / "config.json").read_bytes()
    r = cli("download", "--topology", topo, "--all-local", "--repo", hub.repo, "--quiet", env=env)
    assert r.exit_code == 1 and "is not the config.json of moonshotai/Kimi-K3" in r.output, r.output
    assert (d / "config.json").read_bytes() == before  # not overwritten


def test_download_offline_on_a_local_model_without_manifest_says_what_is_the_case(tmp_path):
    d = tmp_path / "model"
    shutil.copytree(ASSETS / "k3-docs", d)
    (d / MANIFEST_FILE).unlink()
    topo = _topology(tmp_path, d)
    r = cli("download", "--topology", topo, "--all-local", "--quiet", env={"HF_HUB_OFFLINE": "1"})
    assert r.exit_code == 1, r.output
    assert "missing" not in r.output and "are here but cannot be verified offline" in r.output
    assert f"has no {MANIFEST_FILE}" in r.output and f"p2pk3 manifest {d}" in r.output
    assert cli("manifest", d).exit_code == 0
    ok = cli("download", "--topology", topo, "--all-local", "--quiet", env={"HF_HUB_OFFLINE": "1"})
    assert ok.exit_code == 0 and "already verified" in ok.output, ok.output

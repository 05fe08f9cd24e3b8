"""`p2pk3 download`: fetch exactly the files some slots need, verify them, and record them in the manifest.

Order: the hub's file metadata (one `model_info(files_metadata=True)` call: sizes, LFS SHA-256, git blob ids,
the commit the revision points at), then `model.safetensors.index.json` and the config / tokenizer / chat
template files, then ONLY the shards holding tensors of the slots (files.needed_shards). Each file:

* already there and verified (manifest entry with the hub's SHA-256, file unchanged or re-hashed): kept;
* else from a LAN peer that lists it with the same SHA-256 (`--from-peers`, peers.py), else from the hub;
* downloads go to `.p2pk3-download/<file>.part` and resume from its length after an interruption (a cut
  connection is retried in place by huggingface_hub's `http_get` with a Range request; a killed process
  resumes on the next run); the finished file is checked (size, SHA-256 for LFS files, the git blob id
  for small files) before it is moved into place and recorded in `p2pk3-manifest.json`.

Environment: HF_ENDPOINT (a mirror or a stand-in), HF_TOKEN, HF_HUB_OFFLINE=1 (no hub: use and verify
what is there, fetch from peers if asked, and say exactly which files are missing).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable
from urllib.parse import urlparse

from p2pk3.checkpoint.loader import INDEX_FILE, SINGLE_FILE
from p2pk3.model.config import K3Config

from .files import is_small_file, needed_shards, read_weight_map
from .manifest import MANIFEST_FILE, IntegrityError, Manifest, git_blob_sha1, sha256_file
from .peers import fetch_file, list_peer_files

PART_DIR = ".p2pk3-download"


class DownloadError(RuntimeError):
    """A download that cannot complete (names the file and why)."""


def offline_mode() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


@dataclass
class RemoteFile:
    name: str
    size: int | None
    sha256: str | None = None  # LFS files
    git_sha1: str | None = None  # blob id (non-LFS files: the hash of their content)


@dataclass
class Outcome:
    fetched_hub: list[str] = field(default_factory=list)
    fetched_peer: list[str] = field(default_factory=list)
    present: list[str] = field(default_factory=list)
    bytes_fetched: int = 0
    seconds: float = 0.0
    shards: dict[str, set[str]] = field(default_factory=dict)  # shard -> slots needing it


# ------------------------------------------------------------------------------------------ the hub
class Hub:
    """The huggingface_hub client, bound to one repo and revision (endpoint and token read at call time)."""

    def __init__(self, repo: str, revision: str | None = None, endpoint: str | None = None, token: str | None = None):
        self.repo, self.revision = repo, revision or "main"
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co").rstrip("/")
        self.token = token if token is not None else (os.environ.get("HF_TOKEN") or None)
        self.commit: str | None = None
        self.files: dict[str, RemoteFile] = {}

    def _explain(self, e: Exception, what: str) -> DownloadError:
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        where = f"{self.repo}@{self.revision} on {self.endpoint}"
        if isinstance(e, GatedRepoError):
            return DownloadError(f"{what}: {where} is gated: accept its terms on the hub and set HF_TOKEN")
        if isinstance(e, RevisionNotFoundError):
            return DownloadError(f"{what}: revision {self.revision!r} not found in {self.repo} on {self.endpoint}")
        if isinstance(e, RepositoryNotFoundError):
            hint = "" if self.token else " (private repo? set HF_TOKEN)"
            return DownloadError(f"{what}: repository {self.repo} not found on {self.endpoint}{hint}")
        if isinstance(e, HfHubHTTPError):
            code = getattr(getattr(e, "response", None), "status_code", None)
            if code in (401, 403):
                return DownloadError(
                    f"{what}: {where} refused access (HTTP {code}): "
                    f"{'HF_TOKEN is not accepted' if self.token else 'set HF_TOKEN'}"
                )
            return DownloadError(f"{what}: {where}: HTTP {code}: {str(e).splitlines()[0]}")
        return DownloadError(
            f"{what}: cannot reach {self.endpoint} ({type(e).__name__}: {e}); "
            f"check the network / HF_ENDPOINT, or set HF_HUB_OFFLINE=1 to use the files here"
        )

    def load_info(self) -> None:
        from huggingface_hub import HfApi

        try:
            info = HfApi(endpoint=self.endpoint, token=self.token).model_info(
                self.repo, revision=self.revision, files_metadata=True
            )
        except Exception as e:
            raise self._explain(e, "file list") from None
        self.commit = info.sha or self.revision
        for s in info.siblings or []:
            lfs = s.lfs
            self.files[s.rfilename] = RemoteFile(
                s.rfilename,
                s.size if s.size is not None else (lfs.size if lfs else None),
                sha256=(lfs.sha256.lower() if lfs and lfs.sha256 else None),
                git_sha1=s.blob_id,
            )

    def fetch(
        self, rf: RemoteFile, part: Path, bar: Callable[[int], None] | None, total: Callable[[int], None] | None
    ) -> None:
        """Download `rf` into `part`, resuming from its current length."""
        from huggingface_hub import get_hf_file_metadata, hf_hub_url
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils import build_hf_headers

        url = hf_hub_url(self.repo, rf.name, revision=self.commit, endpoint=self.endpoint)
        try:
            meta = get_hf_file_metadata(url, token=self.token, endpoint=self.endpoint)
        except Exception as e:
            raise self._explain(e, rf.name) from None
        size = meta.size if meta.size is not None else rf.size
        headers = build_hf_headers(token=self.token)
        location = meta.location or url
        if urlparse(location).netloc != urlparse(url).netloc:
            headers.pop("authorization", None)  # a signed CDN url: the token stays with the hub
        part.parent.mkdir(parents=True, exist_ok=True)
        have = part.stat().st_size if part.exists() else 0
        if size is not None and have > size:
            part.unlink()
            have = 0
        if total is not None and have:
            total(have)
        with open(part, "ab") as f:
            try:
                http_get(
                    location,
                    f,
                    resume_size=have,
                    headers=headers,
                    expected_size=size,
                    displayed_filename=rf.name,
                    tqdm_class=_bar_class(bar, total),
                )
            except Exception as e:
                f.flush()
                raise DownloadError(
                    f"{rf.name}: download interrupted after {part.stat().st_size} of {size} bytes "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); run the same "
                    f"command again to resume"
                ) from None


def _bar_class(bar, total):
    """A tqdm-like class for huggingface_hub's http_get that feeds our progress bars."""

    class _Bar:
        def __init__(self, *a, initial=0, **kw):
            if bar is not None and initial:
                bar(initial)

        def update(self, n=1):
            if bar is not None:
                bar(n)
            if total is not None:
                total(n)

        def update_transfer(self, n):  # the byte counter of the transfer (already counted by update)
            pass

        def close(self):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    return _Bar


# ------------------------------------------------------------------------------------------ progress
class Progress:
    """rich progress bars: one per file and one for the total (bytes, rate, ETA). `quiet`: none."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self._p = None
        self._total = None

    def __enter__(self):
        if not self.quiet:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress as RP,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            self._p = RP(
                TextColumn("{task.description}", justify="left"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=False,
            )
            self._p.__enter__()
        return self

    def __exit__(self, *exc):
        if self._p is not None:
            self._p.__exit__(*exc)

    def set_total(self, label: str, nbytes: int) -> None:
        if self._p is not None:
            self._total = self._p.add_task(label, total=nbytes)

    def file(self, name: str, size: int | None, where: str) -> tuple[Callable[[int], None], Callable[[], None]]:
        if self._p is None:
            return (lambda n: None), (lambda: None)
        t = self._p.add_task(f"{name} ({where})", total=size)
        return (lambda n: self._p.advance(t, n)), (lambda: self._p.update(t, visible=False))

    def total(self, n: int) -> None:
        if self._p is not None and self._total is not None:
            self._p.advance(self._total, n)

    def log(self, msg: str) -> None:
        if self._p is not None:
            self._p.console.print(msg, highlight=False)


# ------------------------------------------------------------------------------------------ the run
class Downloader:
    def __init__(
        self,
        local_dir: str | Path,
        *,
        repo: str | None,
        revision: str | None = None,
        peers: Iterable[tuple[str, int]] = (),
        secret: bytes | None = None,
        peer_rate_mbps: float | None = None,
        offline: bool | None = None,
        quiet: bool = False,
        echo: Callable[[str], None] = print,
    ):
        self.dir = Path(local_dir)
        self.offline = offline_mode() if offline is None else offline
        self.hub = Hub(repo, revision) if repo else None
        self.peer_addrs = list(peers)
        self.secret = secret
        self.peer_rate = peer_rate_mbps
        self.quiet, self.echo = quiet, echo
        self.manifest: Manifest | None = None
        self.peer_files: dict[tuple[str, int], dict[str, dict]] = {}
        self.out = Outcome()

    # ---- expected content of a file
    def _expected(self, name: str) -> tuple[int | None, str | None, str | None, str]:
        """(size, sha256, git_sha1, whose) for `name`: the hub's metadata, else the manifest, else a peer's."""
        if self.hub is not None and name in self.hub.files:
            rf = self.hub.files[name]
            return rf.size, rf.sha256, rf.git_sha1, "the hub"
        e = self.manifest.files.get(name) if self.manifest else None
        if e is not None:
            return e.size, e.sha256, None, f"the manifest {self.manifest.path}"
        for addr, files in self.peer_files.items():
            if name in files:
                f = files[name]
                return f["size"], f["sha256"], None, f"peer {addr[0]}:{addr[1]}"
        return None, None, None, ""

    def _verified_here(self, name: str) -> bool:
        """`name` is in place and matches what is expected (records it in the manifest when it was not)."""
        p = self.dir / name
        if not p.is_file():
            return False
        size, sha, gsha, _ = self._expected(name)
        e = self.manifest.files.get(name)
        # the manifest's (size, mtime) cache vouches for the content only if its SHA-256 is the one expected;
        # a small file the hub knows by git blob id alone is hashed again (cheap), as the manifest has no blob id
        if e is not None and (e.sha256 == sha or (sha is None and gsha is None)):
            from .manifest import check_files

            try:
                check_files(self.dir, [name], manifest=self.manifest, save=False)
                return True
            except IntegrityError as ex:
                self.echo(f"{name}: {str(ex).split(': ', 1)[-1].split(';')[0]}: fetching it again")
                return False
        if size is not None and p.stat().st_size != size:
            return False
        got = sha256_file(p)
        if sha is not None:
            ok = got == sha
        elif gsha is not None:
            ok = git_blob_sha1(p) == gsha
        else:
            ok = False
        if ok:
            self.manifest.record(name, got, e.source if e else "local")
        return ok

    def _verify_part(self, name: str, part: Path, source: str) -> None:
        size, sha, gsha, whose = self._expected(name)
        have = part.stat().st_size
        if size is not None and have != size:
            part.unlink()
            raise DownloadError(f"{name}: received {have} bytes from {source}, {whose} says {size}; removed, run again")
        got = sha256_file(part)
        if sha is not None and got != sha:
            part.unlink()
            raise DownloadError(
                f"{name}: corrupt download from {source}: SHA-256 {got[:16]}... does not match "
                f"{sha[:16]}... of {whose}; the file was removed, run again to fetch it anew"
            )
        if sha is None and gsha is not None and git_blob_sha1(part) != gsha:
            part.unlink()
            raise DownloadError(
                f"{name}: corrupt download from {source}: its git blob id does not match "
                f"{gsha[:12]}... of {whose}; the file was removed, run again"
            )
        dest = self.dir / name
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(part, dest)
        self.manifest.record(name, got, source)
        self.manifest.save()

    def _fetch(self, name: str, prog: Progress) -> None:
        size, sha, _, _ = self._expected(name)
        part = self.dir / PART_DIR / (name + ".part")
        for addr, files in self.peer_files.items():
            f = files.get(name)
            if f is None or (sha is not None and f["sha256"] != sha) or (size is not None and f["size"] != size):
                continue
            adv, done = prog.file(name, f["size"], f"peer {addr[0]}:{addr[1]}")
            try:
                n = asyncio.run(
                    fetch_file(
                        addr,
                        self.secret,
                        name,
                        f["size"],
                        part,
                        rate_mbps=self.peer_rate,
                        progress=lambda k, adv=adv: (adv(k), prog.total(k)),
                    )
                )
            except Exception as e:
                prog.log(f"{name}: peer {addr[0]}:{addr[1]} failed ({e}); trying the next source")
                continue
            finally:
                done()
            self._verify_part(name, part, f"peer:{addr[0]}:{addr[1]}")
            self.out.fetched_peer.append(name)
            self.out.bytes_fetched += n
            return
        if self.hub is None or self.offline:
            raise DownloadError(
                f"{name}: no peer has it and the hub is "
                f"{'off (HF_HUB_OFFLINE=1)' if self.offline else 'not configured (no --repo)'}"
            )
        if name not in self.hub.files:
            raise DownloadError(f"{name}: not in {self.hub.repo}@{self.hub.revision} on {self.hub.endpoint}")
        before = part.stat().st_size if part.exists() else 0
        adv, done = prog.file(name, size, "hub")
        try:
            self.hub.fetch(self.hub.files[name], part, adv, prog.total)
        finally:
            done()
        self._verify_part(name, part, f"hub:{self.hub.repo}@{self.hub.commit}")
        self.out.fetched_hub.append(name)
        self.out.bytes_fetched += (size or 0) - before

    def _ensure(self, names: list[str], prog: Progress, label: str = "total") -> None:
        todo = [n for n in names if not self._verified_here(n)]
        self.out.present += [n for n in names if n not in todo]
        if not todo:
            self.manifest.save()
            return
        if self.offline:
            nowhere = [n for n in todo if not any(n in f for f in self.peer_files.values())]
            if nowhere:
                raise DownloadError(self._offline_refusal(nowhere))
        known = [self._expected(n)[0] for n in todo]
        prog.set_total(f"{label}: {len(todo)} file(s)", sum(k or 0 for k in known))
        for n in todo:
            self._fetch(n, prog)

    def fetch(self, names: list[str]) -> Outcome:
        """Only `names` (e.g. the shards a standby lacks before a takeover, node/takeover.py), no config
        needed: each is kept when verified here, else fetched from a peer (listed now, when `run` or an
        earlier call has not) or the hub, verified, and recorded in the directory's manifest."""
        if self.manifest is None:
            self.manifest = Manifest.load(self.dir) or Manifest(self.dir)
        if self.peer_addrs and not self.peer_files:
            self.peer_files = asyncio.run(list_peer_files(self.peer_addrs, self.secret, echo=self.echo))
        with Progress(self.quiet) as prog:
            self._ensure(list(names), prog)
        return self.out

    def _offline_refusal(self, names: list[str]) -> str:
        """What is really the case with files needed here that cannot be had offline."""
        peers = " nor on any peer" if self.peer_files else ""
        absent = [n for n in names if not (self.dir / n).is_file()]
        unknown = [n for n in names if n not in absent and n not in self.manifest.files]
        bad = [n for n in names if n not in absent and n not in unknown]
        said = []
        if absent:
            said.append(f"{len(absent)} file(s) needed here are missing in {self.dir}{peers}: {', '.join(absent)}")
        if unknown:
            why = (
                " has no p2pk3-manifest.json"
                if not self.manifest.files
                else f"'s manifest {self.manifest.path} does not list them"
            )
            said.append(
                f"{len(unknown)} file(s) are here but cannot be verified offline ({self.dir}{why}): "
                f"{', '.join(unknown)}; for a model you put there yourself, `p2pk3 manifest {self.dir}` "
                f"records its files as they are"
            )
        if bad:
            said.append(f"{len(bad)} file(s) do not match the manifest: {', '.join(bad)}")
        return (
            "offline (HF_HUB_OFFLINE=1): "
            + "; ".join(said)
            + "; run without HF_HUB_OFFLINE"
            + ("" if self.peer_files else ", or with --from-peers")
        )

    def _check_target(self) -> None:
        """Refuse a model directory that holds another model than the repo asked for (before any transfer)."""
        m, want = self.manifest, self.hub.repo
        fix = f"give --local-dir DIR for {want} (and set [model] path = DIR in the topology for the nodes)"
        if m.shipped:
            raise DownloadError(
                f"{self.dir} is a model shipped with p2pk3 (a topology from `plan` or `topology "
                f"init` without --model points at it), not {want}: {fix}"
            )
        if m.repo and m.repo != want:
            raise DownloadError(
                f"{self.dir} holds {m.repo} (its {MANIFEST_FILE}), not {want}: {fix}, or pass --repo {m.repo}"
            )
        if m.repo is None and any(e.source == "local" for e in m.files.values()):
            raise DownloadError(
                f"{self.dir} holds a local model recorded by `p2pk3 manifest` with no repo, not a "
                f"download of {want}: {fix}; if it is a copy of {want}, `p2pk3 manifest {self.dir} "
                f"--repo {want}` says so"
            )

    def _check_config(self) -> None:
        """A config.json here that the manifest does not vouch for must be the hub's (else: another model)."""
        p, rf = self.dir / "config.json", self.hub.files.get("config.json")
        if "config.json" in self.manifest.files or not p.is_file() or rf is None or rf.git_sha1 is None:
            return
        if git_blob_sha1(p) != rf.git_sha1:
            raise DownloadError(
                f"{p} is not the config.json of {self.hub.repo}@{self.hub.revision}: {self.dir} "
                f"holds another model; give --local-dir DIR for {self.hub.repo}, or remove the "
                f"directory's files to fetch {self.hub.repo} there"
            )

    def run(self, cfg_fn: Callable[[Path], K3Config], plans_fn: Callable[[K3Config], list]) -> Outcome:
        """cfg_fn(local_dir) -> the model config (after config.json is here); plans_fn(cfg) -> slot plans."""
        t0 = time.perf_counter()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.manifest = Manifest.load(self.dir) or Manifest(self.dir)
        if self.hub is not None:
            self._check_target()
        if self.hub is not None and not self.offline:
            self.hub.load_info()
            self._check_config()
            if self.manifest.commit and self.manifest.commit != self.hub.commit and self.manifest.repo == self.hub.repo:
                self.echo(
                    f"note: {self.dir} holds files of commit {self.manifest.commit[:12]}; the hub's "
                    f"{self.hub.revision} is {self.hub.commit[:12]}: changed files are fetched again"
                )
            self.manifest.repo, self.manifest.revision, self.manifest.commit = (
                self.hub.repo,
                self.hub.revision,
                self.hub.commit,
            )
        if self.peer_addrs:
            self.peer_files = asyncio.run(list_peer_files(self.peer_addrs, self.secret, echo=self.echo))
        with Progress(self.quiet) as prog:
            # 1. the index and the small files
            if self.hub is not None and not self.offline:
                avail = set(self.hub.files)
            else:
                avail = set(self.manifest.files) | {n for f in self.peer_files.values() for n in f}
                avail |= {p.name for p in self.dir.iterdir() if p.is_file()}
            first = sorted(n for n in avail if is_small_file(n) or n == INDEX_FILE)
            if "config.json" not in avail:
                raise DownloadError(f"config.json: not found ({self._where()}); is this a model repository?")
            self._ensure(first, prog, "index, config, tokenizer")
            # 2. the shards the slots need
            cfg = cfg_fn(self.dir)
            plans = plans_fn(cfg)
            if (self.dir / INDEX_FILE).is_file():
                shards = needed_shards(
                    cfg, read_weight_map(self.dir / INDEX_FILE), plans, where=str(self.dir / INDEX_FILE)
                )
            elif SINGLE_FILE in avail:
                shards = {SINGLE_FILE: {p.slot for p in plans}} if any(p.layers for p in plans) else {}
            else:
                raise DownloadError(f"{INDEX_FILE}: not found ({self._where()}), and no {SINGLE_FILE} either")
            self.out.shards = shards
            self._ensure(sorted(shards), prog, "shards of " + ", ".join(p.slot for p in plans))
        parts = self.dir / PART_DIR
        if parts.is_dir() and not any(parts.rglob("*.part")):
            shutil.rmtree(parts, ignore_errors=True)
        self.out.seconds = time.perf_counter() - t0
        return self.out

    def _where(self) -> str:
        if self.hub is not None and not self.offline:
            return f"{self.hub.repo}@{self.hub.revision} on {self.hub.endpoint}"
        return f"offline: {self.dir}" + (" and the peers" if self.peer_files else "")

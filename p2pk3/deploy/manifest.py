"""The local manifest of a model directory: `p2pk3-manifest.json`, what `p2pk3 download` fetched and verified.

    {"version": 1, "repo": "moonshotai/Kimi-K3", "revision": "main", "commit": "<40 hex>",
     "files": {"model-00001-of-000096.safetensors": {"size": 4981...,"sha256": "<64 hex>",
               "source": "hub:moonshotai/Kimi-K3@<commit>" | "peer:10.0.0.5:47920" | "local",
               "verified": {"size": ..., "mtime_ns": ...}}}}

`verified` is the (size, mtime) the file had when its SHA-256 was last checked against `sha256`: a node
that finds the file unchanged trusts it without hashing again (a restart is fast); a file whose size or
mtime moved is hashed again (`check_files`). A model directory not fetched from the hub gets its manifest
from `record_directory` (`p2pk3 manifest DIR`, source "local"); the embedded models ship one with
`"shipped": true`: their directory is part of the package, so no verdict is cached there (every load hashes
them, ~50 ms) and a mismatch says to restore the file or regenerate the manifest. Writes are atomic (temp file + rename) under a lock file, and
merge with what another process wrote meanwhile (several nodes of one host share one model directory).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

MANIFEST_FILE = "p2pk3-manifest.json"
LOCK_FILE = ".p2pk3-manifest.lock"
VERSION = 1
HASH_BLOCK = 8 << 20
ASSETS = Path(__file__).resolve().parent.parent / "assets"  # the embedded models ship here

log = logging.getLogger("p2pk3.deploy")


class IntegrityError(ValueError):
    """A file of the model directory is missing, truncated, corrupt or unknown to the manifest."""


class ManifestError(ValueError):
    """The manifest file itself cannot be used (unreadable, not JSON, wrong structure)."""


def sha256_file(path: str | Path, progress: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(HASH_BLOCK)
        mv = memoryview(buf)
        while n := f.readinto(buf):
            h.update(mv[:n])
            if progress is not None:
                progress(n)
    return h.hexdigest()


def git_blob_sha1(path: str | Path) -> str:
    """The git object id of a file (what the hub reports as blobId / ETag for a non-LFS file)."""
    p = Path(path)
    h = hashlib.sha1(b"blob %d\0" % p.stat().st_size)
    with open(p, "rb") as f:
        while chunk := f.read(HASH_BLOCK):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class FileEntry:
    size: int
    sha256: str
    source: str = "local"
    verified: dict | None = None  # {"size", "mtime_ns"} at the last successful hash check

    def to_dict(self) -> dict:
        d = {"size": self.size, "sha256": self.sha256, "source": self.source}
        if self.verified:
            d["verified"] = dict(self.verified)
        return d


@dataclass
class Manifest:
    dir: Path
    files: dict[str, FileEntry] = field(default_factory=dict)
    repo: str | None = None
    revision: str | None = None
    commit: str | None = None
    shipped: bool = False  # the files ship with the package (p2pk3/assets): verdicts are not cached here

    @property
    def path(self) -> Path:
        return self.dir / MANIFEST_FILE

    # -------------------------------------------------------------- I/O
    @classmethod
    def load(cls, model_dir: str | Path, *, missing_ok: bool = True) -> "Manifest | None":
        d = Path(model_dir)
        p = d / MANIFEST_FILE
        try:
            raw = json.loads(p.read_text())
        except FileNotFoundError:
            if missing_ok:
                return None
            raise IntegrityError(f"{p}: no manifest (run `p2pk3 download` to fetch and verify the model)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ManifestError(
                f"{p}: cannot read the manifest ({e}); remove it and run `p2pk3 download` again"
            ) from None
        return cls.from_dict(d, raw)

    @classmethod
    def from_dict(cls, d: Path, raw) -> "Manifest":
        p = d / MANIFEST_FILE
        if not isinstance(raw, dict) or raw.get("version") != VERSION or not isinstance(raw.get("files"), dict):
            raise ManifestError(f"{p}: not a p2pk3 manifest (version {VERSION} with a 'files' table)")
        files: dict[str, FileEntry] = {}
        for name, e in raw["files"].items():
            ok = (
                isinstance(e, dict)
                and isinstance(e.get("size"), int)
                and e["size"] >= 0
                and isinstance(e.get("sha256"), str)
                and len(e["sha256"]) == 64
            )
            if not ok or not safe_name(name):
                raise ManifestError(f"{p}: bad entry for file {name!r} (needs a relative name, size and sha256)")
            v = e.get("verified")
            files[name] = FileEntry(
                e["size"], e["sha256"].lower(), str(e.get("source", "local")), v if isinstance(v, dict) else None
            )
        return cls(d, files, raw.get("repo"), raw.get("revision"), raw.get("commit"), raw.get("shipped") is True)

    def to_dict(self) -> dict:
        d = {"version": VERSION, "repo": self.repo, "revision": self.revision, "commit": self.commit}
        if self.shipped:
            d["shipped"] = True
        return {**d, "files": {n: e.to_dict() for n, e in sorted(self.files.items())}}

    def refetch_hint(self, name: str) -> str:
        """How to get a good copy of `name` back, by where it came from."""
        e = self.files.get(name)
        if self.shipped:
            where = (
                f"restore it (`git checkout -- {self.dir}` or reinstall p2pk3)"
                if self.dir.resolve().is_relative_to(ASSETS)
                else f"copy it again from the embedded model in {ASSETS} that this directory is a copy of"
            )
            return (
                f"this file ships with p2pk3: {where}; if it was changed on purpose (a retrained model), "
                f"`p2pk3 manifest {self.dir}` records it"
            )
        if e is not None and e.source == "local":
            return (
                f"restore it; if it was changed on purpose, `p2pk3 manifest {self.dir}` records the directory "
                f"as it is now"
            )
        return "run `p2pk3 download` for this slot to fetch it again"

    def save(self) -> None:
        """Atomic write, merged with the manifest on disk (entries of other files another process added).
        A shipped manifest is part of the package: only `record_directory` writes it."""
        if self.shipped:
            return
        with _locked(self.dir):
            try:
                disk = Manifest.load(self.dir)
            except ManifestError:
                disk = None
            if disk is not None:
                for n, e in disk.files.items():
                    self.files.setdefault(n, e)
                self.repo = self.repo or disk.repo
                self.revision = self.revision or disk.revision
                self.commit = self.commit or disk.commit
            tmp = self.path.with_name(f".{MANIFEST_FILE}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
            os.replace(tmp, self.path)

    # -------------------------------------------------------------- entries
    def record(self, name: str, sha256: str, source: str) -> FileEntry:
        """`name` (a file in the directory) was just verified to hash to `sha256`."""
        st = (self.dir / name).stat()
        e = FileEntry(st.st_size, sha256, source, {"size": st.st_size, "mtime_ns": st.st_mtime_ns})
        self.files[name] = e
        return e


@contextlib.contextmanager
def _locked(d: Path):
    fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def safe_name(name) -> bool:
    """A manifest file name: relative, no `..`, no empty parts, no backslashes or NULs."""
    if not isinstance(name, str) or not name or "\\" in name or "\0" in name or name.startswith("/"):
        return False
    return all(part not in ("", ".", "..") for part in name.split("/"))


@dataclass
class CheckReport:
    hashed: list[str] = field(default_factory=list)  # names whose SHA-256 was computed now
    cached: list[str] = field(default_factory=list)  # names trusted from the (size, mtime) cache
    seconds: float = 0.0


def check_files(
    model_dir: str | Path,
    names: Iterable[str],
    *,
    manifest: Manifest | None = None,
    require_manifest: bool = False,
    save: bool = True,
) -> CheckReport | None:
    """Check each of `names` against the manifest of `model_dir`: size always; SHA-256 when the file is
    new to the cache (first use) or changed (size or mtime differs from the last verification).
    Raises IntegrityError naming the file and what is wrong. Without a manifest: None (nothing to check)
    unless `require_manifest`. Successful hashes are written back to the manifest's cache."""
    t0 = time.perf_counter()
    d = Path(model_dir)
    m = manifest if manifest is not None else Manifest.load(d, missing_ok=not require_manifest)
    if m is None:
        return None
    rep = CheckReport()
    for name in names:
        p = d / name
        e = m.files.get(name)
        if e is None:
            raise IntegrityError(
                f"{p}: not in the manifest {m.path} (fetched outside `p2pk3 download`?); run "
                f"`p2pk3 download` for this slot to verify and record it"
            )
        try:
            st = p.stat()
        except FileNotFoundError:
            raise IntegrityError(
                f"{p}: missing (the manifest {m.path} lists it with {e.size} bytes); {m.refetch_hint(name)}"
            ) from None
        if st.st_size != e.size:
            what = "truncated" if st.st_size < e.size else "too long"
            raise IntegrityError(f"{p}: {what}: {st.st_size} bytes, the manifest says {e.size}; {m.refetch_hint(name)}")
        v = e.verified or {}
        if v.get("size") == st.st_size and v.get("mtime_ns") == st.st_mtime_ns:
            rep.cached.append(name)
            continue
        got = sha256_file(p)
        if got != e.sha256:
            raise IntegrityError(
                f"{p}: corrupt: SHA-256 {got[:16]}... does not match the manifest's "
                f"{e.sha256[:16]}...; {m.refetch_hint(name)}"
            )
        if not m.shipped:
            e.verified = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        rep.hashed.append(name)
    if rep.hashed and save and not m.shipped:
        try:
            m.save()
        except OSError as ex:  # a read-only model directory: the check still passed, it just is not cached
            log.warning("could not update %s (%s): the next start hashes again", m.path, ex)
    rep.seconds = time.perf_counter() - t0
    return rep


# files of a model directory that a manifest never lists: itself, its lock, the model card, download temps
UNRECORDED = (MANIFEST_FILE, LOCK_FILE, "README.md")


def directory_files(model_dir: str | Path) -> list[str]:
    """The files `record_directory` lists: every regular file under `model_dir` (relative names) but
    UNRECORDED, hidden files and folders (`.p2pk3-download/`, `.git/`) and links."""
    d = Path(model_dir)
    out = []
    for p in sorted(d.rglob("*")):
        rel = p.relative_to(d).as_posix()
        if any(part.startswith(".") for part in rel.split("/")) or rel in UNRECORDED:
            continue
        if p.is_file() and not p.is_symlink():
            out.append(rel)
    return out


def record_directory(model_dir: str | Path, *, shipped: bool | None = None, repo: str | None = None) -> Manifest:
    """Hash every file of a model directory not fetched with `p2pk3 download` (a local or trained model; an
    embedded one, under p2pk3/assets, is marked `shipped` unless told) and write its manifest (replacing any):
    from then on the loader checks the shards against it as it checks a downloaded model."""
    d = Path(model_dir)
    if not d.is_dir():
        raise ManifestError(f"{d}: no such directory")
    if shipped is None:
        shipped = d.resolve().is_relative_to(ASSETS)
    names = directory_files(d)
    if not names:
        raise ManifestError(f"{d}: no files to record")
    m = Manifest(d, repo=repo, shipped=shipped)
    for name in names:
        e = m.record(name, sha256_file(d / name), "local")
        if shipped:
            e.verified = None
    with _locked(d):
        tmp = m.path.with_name(f".{MANIFEST_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(m.to_dict(), indent=1) + "\n")
        os.replace(tmp, m.path)
    if shipped:  # the lock file is not part of the package
        with contextlib.suppress(OSError):
            (d / LOCK_FILE).unlink()
    return m

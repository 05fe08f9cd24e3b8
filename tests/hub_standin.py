"""A local stand-in of the Hugging Face Hub's HTTP endpoints, for tests of `p2pk3 download` with the real
huggingface_hub client (HF_ENDPOINT=http://127.0.0.1:PORT). It serves the files of one directory as the
repo `repo` at commit `commit`, and implements exactly what huggingface_hub 2.x calls:

* GET  /api/models/{repo}/revision/{rev}?blobs=true  -> {"id", "sha", "siblings": [{rfilename, size, blobId,
  lfs: {sha256, size, pointerSize}}]}   (HfApi.model_info(files_metadata=True))
* HEAD /{repo}/resolve/{rev}/{file}  -> 200 with X-Repo-Commit, ETag (git blob id; for LFS files the sha256),
  X-Linked-Etag + X-Linked-Size (LFS files), Content-Length, Accept-Ranges   (get_hf_file_metadata)
* GET  /{repo}/resolve/{rev}/{file}  -> the bytes; `Range: bytes=N-` -> 206 with Content-Range   (http_get)

Faults for tests: `cut_once` (names: the first GET sends half the body and drops the connection),
`corrupt` (names: served with flipped bytes; the metadata keeps the true hashes), `token` (require
`Authorization: Bearer <token>`, else 401). `log` records (method, file or api path, Range header).
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

LFS_SUFFIXES = (".safetensors", ".bin", ".model")


def _git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HubStandIn:
    def __init__(
        self, root: str | Path, repo: str = "org/tiny-k3", commit: str = "c0ffee" * 6 + "abcd", token: str | None = None
    ):
        self.root, self.repo, self.commit, self.token = Path(root), repo, commit, token
        self.log: list[tuple[str, str, str | None]] = []
        self.cut_once: set[str] = set()
        self.corrupt: set[str] = set()
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ files
    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())

    def meta(self, name: str) -> dict:
        data = (self.root / name).read_bytes()
        d = {"rfilename": name, "size": len(data), "blobId": _git_sha1(data)}
        if name.endswith(LFS_SUFFIXES):
            d["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return d

    def gets(self, name: str) -> list[tuple[str, str, str | None]]:
        """The GET requests of file `name` (method, name, Range)."""
        return [e for e in self.log if e[0] == "GET" and e[1] == name]

    # ------------------------------------------------------------------ server
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> "HubStandIn":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def _auth_ok(self) -> bool:
                if hub.token is None or self.headers.get("Authorization") == f"Bearer {hub.token}":
                    return True
                self._plain(
                    401,
                    b'{"error": "Invalid credentials in Authorization header"}',
                    {"X-Error-Message": "Invalid credentials in Authorization header"},
                )
                return False

            def _plain(self, code: int, body: bytes, extra: dict | None = None, head: bool = False) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _route(self):
                path = unquote(urlparse(self.path).path)
                api = f"/api/models/{hub.repo}/revision/"
                if path.startswith(api):
                    return "api", path[len(api) :]
                pre = f"/{hub.repo}/resolve/"
                if path.startswith(pre):
                    rev, _, name = path[len(pre) :].partition("/")
                    return "file", (rev, name)
                return None, path

            def do_GET(self):
                self._serve(head=False)

            def do_HEAD(self):
                self._serve(head=True)

            def _serve(self, head: bool):
                kind, arg = self._route()
                rng = self.headers.get("Range")
                with hub._lock:
                    hub.log.append(("HEAD" if head else "GET", arg[1] if kind == "file" else self.path, rng))
                if not self._auth_ok():
                    return
                if kind == "api":
                    if arg not in ("main", hub.commit):
                        return self._plain(
                            404, b'{"error": "Revision Not Found"}', {"X-Error-Code": "RevisionNotFound"}
                        )
                    body = json.dumps(
                        {
                            "id": hub.repo,
                            "modelId": hub.repo,
                            "sha": hub.commit,
                            "private": False,
                            "siblings": [hub.meta(n) for n in hub.files()],
                        }
                    ).encode()
                    return self._plain(200, body, head=head)
                if kind != "file":
                    return self._plain(404, b'{"error": "not found"}', head=head)
                rev, name = arg
                p = hub.root / name
                if rev not in ("main", hub.commit) or not p.is_file() or ".." in name.split("/"):
                    return self._plain(
                        404,
                        b'{"error": "Entry not found"}',
                        {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": hub.commit},
                        head=head,
                    )
                data = p.read_bytes()
                m = hub.meta(name)
                hdr = {"X-Repo-Commit": hub.commit, "ETag": f'"{m["blobId"]}"', "Accept-Ranges": "bytes"}
                if "lfs" in m:
                    hdr["ETag"] = hdr["X-Linked-Etag"] = f'"{m["lfs"]["sha256"]}"'
                    hdr["X-Linked-Size"] = str(len(data))
                if name in hub.corrupt:
                    data = bytes(b ^ 0x5A for b in data[:64]) + data[64:]
                start = 0
                if rng and rng.startswith("bytes=") and not head:
                    start = int(rng[6:].split("-")[0])
                code = 206 if start else 200
                body = data[start:]
                self.send_response(code)
                for k, v in hdr.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.end_headers()
                if head:
                    return
                with hub._lock:
                    cut = name in hub.cut_once
                    hub.cut_once.discard(name)
                if cut:  # half the body, then the connection drops
                    self.wfile.write(body[: len(body) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                self.wfile.write(body)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

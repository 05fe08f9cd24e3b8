"""`start_api_in_background`: `p2pk3 serve` as a subprocess beside a ring (what `p2pk3 local --api` uses).

api = start_api_in_background(ring.topology, "127.0.0.1", 8000, api_key_file=None)
api.url          # "http://127.0.0.1:8000/v1"
api.stop()       # SIGTERM, then SIGKILL after a grace period
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


class ApiProcess:
    def __init__(self, proc: subprocess.Popen, host: str, port: int, log_path: Path):
        self.proc, self.host, self.port, self.log_path = proc, host, port, log_path

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL (what `OpenAI(base_url=...)` takes)."""
        return self.base_url + "/v1"

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-4000:]
        except OSError:
            return ""

    def wait_ready(self, timeout: float = 60.0) -> "ApiProcess":
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"p2pk3 serve exited with {self.proc.returncode}; its log ({self.log_path}):\n{self.log()}"
                )
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=1.0) as r:
                    if r.status == 200 and json.loads(r.read()).get("pid") == self.proc.pid:
                        return self  # (another process's API on that port is not ours)
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"p2pk3 serve not answering on {self.base_url} after {timeout:.0f} s; log:\n{self.log()}"
                )
            time.sleep(0.1)

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def start_api_in_background(
    topology_path: str | os.PathLike,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key_file: str | os.PathLike | None = None,
    *,
    model_name: str | None = None,
    log_path: str | os.PathLike | None = None,
    wait: float | None = 60.0,
) -> ApiProcess:
    """Start `p2pk3 serve` for the topology; with `wait`, return once it answers (raise with its log if it
    exits or does not answer in time). The log goes next to the topology file unless `log_path`."""
    topology_path = Path(topology_path).resolve()
    log_path = Path(log_path) if log_path else topology_path.parent / "api.log"
    cmd = [
        sys.executable,
        "-P",
        "-m",
        "p2pk3.cli",
        "serve",
        "--topology",
        str(topology_path),
        "--host",
        host,
        "--port",
        str(port),
    ]
    if api_key_file is not None:
        cmd += ["--api-key-file", str(Path(api_key_file).resolve())]
    if model_name is not None:
        cmd += ["--model-name", model_name]
    with open(log_path, "a") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=topology_path.parent
        )
    api = ApiProcess(proc, host, port, log_path)
    if wait is not None:
        api.wait_ready(wait)
    return api

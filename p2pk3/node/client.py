"""Client side of the entry protocol: `generate` requests over an authenticated connection."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from p2pk3.engine.sampling import SamplingParams
from p2pk3.transport.connection import open_connection
from p2pk3.transport.frames import Frame


class RequestError(RuntimeError):
    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass
class Reply:
    tokens: list[int]
    stats: dict
    stage_stats: dict
    logits: np.ndarray | None = None
    streamed: list[int] = field(default_factory=list)


class Client:
    def __init__(self, conn):
        self.conn = conn
        self._rid = 0

    @classmethod
    async def connect(cls, host: str, port: int, secret: bytes, node_id: str = "client") -> "Client":
        return cls(await open_connection(host, port, secret, node_id))

    def close(self) -> None:
        self.conn.close("client done")

    async def status(self) -> dict:
        """The node's counters (slot, batches, tokens, busy seconds, open sessions)."""
        await self.conn.send(Frame.make("status"))
        f = await self.conn.recv()
        if f.kind != "status":
            raise RequestError("bad_reply", f"expected a status frame, got {f.kind!r}")
        return dict(f.header)

    async def generate(self, prompt: list[int], params: SamplingParams | None = None, *, logits: bool = False,
                       incremental: bool = False, on_token=None) -> Reply:
        """One request on this connection (one at a time per connection; open several for concurrency)."""
        self._rid += 1
        params = params or SamplingParams()
        await self.conn.send(Frame.make("generate", request_id=self._rid, prompt=[int(t) for t in prompt],
                                        params=params.to_wire(), logits=logits, incremental=incremental))
        streamed = []
        while True:
            f = await self.conn.recv()
            if f.kind == "token":
                streamed.append(int(f.header["token"]))
                if on_token:
                    on_token(int(f.header["token"]))
            elif f.kind == "done":
                lg = None
                if f.has("logits"):
                    lg = np.array(f.array("logits"), dtype=np.float32, copy=True)
                return Reply(list(f.header["tokens"]), f.header.get("stats", {}), f.header.get("stage_stats", {}),
                             lg, streamed)
            elif f.kind == "error":
                raise RequestError(str(f.header.get("code")), str(f.header.get("message")))
            else:
                raise RequestError("bad_reply", f"unexpected frame {f.kind!r}")

"""Client side of the entry protocol: `generate` requests over an authenticated connection.

    c = await Client.connect(host, port, secret)
    reply = await c.generate(prompt_ids, SamplingParams(max_tokens=64), on_token=print)
    reply.tokens

Resuming: a client that knows other addresses of the cluster (`Client.connect(..., fallbacks=[...])`, or
`Client.for_topology(topo)`, which knows every slot's address) resumes an interrupted request when its
entry dies: it finds the node that holds the entry role now (a standby takes it over), and sends the
prompt plus the tokens received so far, so the stream continues with exactly the tokens an undisturbed
run gives (sampling is a function of seed and position; with temperature > 0 and no seed the client
draws the seed itself so that a resumed request keeps it; the grammar and the penalties count the tokens
received so far as output, `GenerateRequest.generated`). Without fallbacks a lost connection is a
clean `RequestError("connection_lost", ...)`. Failures inside the ring never reach the client: the
entry replays the sessions, and the client sees a pause.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

import numpy as np

from p2pk3.params import SamplingParams
from p2pk3.transport.codec import ProtocolError
from p2pk3.transport.connection import AuthenticationError, ConnectionClosed, TransportError, open_connection
from p2pk3.transport.messages import (
    GenerateRequest,
    TokenLogprob,
    cancel_frame,
    parse_done,
    parse_error,
    parse_status,
    parse_token,
    parse_token_logprob,
    status_frame,
)

LOST = (ConnectionClosed, TransportError, ConnectionError, OSError, asyncio.TimeoutError, ProtocolError)


def why(e: BaseException) -> str:
    """A connection failure in words, said once ("connection refused", not "connection lost: connection lost:
    ...")."""
    if isinstance(e, ConnectionRefusedError):
        return "connection refused (nothing listens there: is the node up?)"
    if isinstance(e, AuthenticationError):  # "node 's0' at HOST:PORT refused the connection: REASON [code]"
        reason = str(e).rpartition("refused the connection: ")[2].rsplit(" [", 1)[0]
        return f"refused the handshake: {reason} (is the topology's secret_file the ring's?)"
    if isinstance(e, (asyncio.TimeoutError, TimeoutError)) and not str(e):
        return "no answer (hung, stopped or cut off)"
    text = getattr(e, "reason", None) or str(e) or type(e).__name__
    return text.removeprefix("connection lost: ")


def _definitive(e: BaseException) -> bool:
    """Refused or not authenticated: asking the same address again soon gives the same answer."""
    return isinstance(e, (ConnectionRefusedError, AuthenticationError))


class RequestError(RuntimeError):
    def __init__(self, code: str, message: str, retry_after: int | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.retry_after = retry_after  # seconds (a `busy` or `queue_timeout` answer)


@dataclass
class Reply:
    """`tokens`: every generated id. With `params.logprobs` set: `logprobs`, one `TokenLogprob` per token
    (its logprob and the top N: `top_ids`, `top_logprobs`); with `params.prompt_logprobs`: `prompt_logprobs`,
    one per prompt token (the first has logprob None). None when not asked."""

    tokens: list[int]
    stats: dict
    stage_stats: dict
    logits: np.ndarray | None = None
    streamed: list[int] = field(default_factory=list)
    resumed: int = 0  # how many times the request moved to a new entry
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


class Client:
    def __init__(
        self,
        conn,
        *,
        secret: bytes | None = None,
        node_id: str = "client",
        fallbacks: Iterable[tuple[str, int]] = (),
        resume_timeout_s: float = 60.0,
    ):
        self.conn = conn
        self.secret, self.node_id = secret, node_id
        self.fallbacks = list(fallbacks)
        self.resume_timeout_s = resume_timeout_s
        self._rid = 0

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        secret: bytes,
        node_id: str = "client",
        *,
        fallbacks: Iterable[tuple[str, int]] = (),
        timeout: float = 10.0,
        resume_timeout_s: float = 60.0,
    ) -> "Client":
        conn = await open_connection(host, port, secret, node_id, timeout=timeout)
        return cls(
            conn,
            secret=secret,
            node_id=node_id,
            fallbacks=[(host, port), *fallbacks],
            resume_timeout_s=resume_timeout_s,
        )

    @classmethod
    async def for_topology(
        cls,
        topo,
        secret: bytes | None = None,
        node_id: str = "client",
        *,
        timeout: float = 10.0,
        resume_timeout_s: float = 60.0,
    ) -> "Client":
        """Connect to whichever node holds the entry role now (asking the topology's addresses). When every
        address refuses the connection or the secret, that is said at once (RequestError "unreachable"),
        naming each address and why; only a ring that answers without an entry is waited for."""
        secret = secret if secret is not None else topo.secret()
        addrs = [a for a in topo.static_addresses().values()]
        self = cls(None, secret=secret, node_id=node_id, fallbacks=addrs, resume_timeout_s=resume_timeout_s)
        self.conn = await self._find_entry(timeout, give_up_when_refused=True)
        return self

    @property
    def can_resume(self) -> bool:
        return self.secret is not None and bool(self.fallbacks)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close("client done")

    async def status(self) -> dict:
        """The node's public statistics (slot, role, batches, tokens, busy seconds, sessions, ...)."""
        await self.conn.send(status_frame())
        while True:
            f = await self.conn.recv()
            if f.kind == "status":
                return parse_status(f)
            if f.kind not in ("token", "done", "error"):  # frames of an abandoned request are skipped
                raise RequestError("bad_reply", f"expected a status frame, got {f.kind!r}")

    async def _find_entry(self, timeout: float, give_up_when_refused: bool = False):
        """A connection to the node that holds the entry role now; retries until `timeout` (with
        `give_up_when_refused`: not when every address refused the connection or the secret)."""
        deadline = time.monotonic() + timeout
        last = "no address to try"
        while True:
            refused = []
            for addr in self.fallbacks:
                try:
                    conn = await open_connection(*addr, self.secret, self.node_id, timeout=2.0, handshake_timeout=2.0)
                except LOST as e:
                    last = f"{addr[0]}:{addr[1]}: {why(e)}"
                    if _definitive(e):
                        refused.append(last)
                    continue
                try:
                    await asyncio.wait_for(conn.send(status_frame()), 2.0)
                    st = (await asyncio.wait_for(conn.recv(), 2.0)).header
                except LOST as e:
                    conn.close("probe")
                    last = f"{addr[0]}:{addr[1]}: {why(e)}"
                    continue
                if st.get("role") == "entry":
                    return conn
                conn.close("not the entry")
                last = f"{addr[0]}:{addr[1]} is {st.get('role')} of slot {st.get('slot')}"
            if give_up_when_refused and self.fallbacks and len(refused) == len(self.fallbacks):
                shown = "; ".join(refused[:3]) + (f"; and {len(refused) - 3} more" if len(refused) > 3 else "")
                raise RequestError("unreachable", f"every node refused: {shown}")
            if time.monotonic() > deadline:
                raise RequestError("connection_lost", f"no node holds the entry role (last: {last})")
            await asyncio.sleep(0.25)

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        *,
        logits: bool = False,
        incremental: bool = False,
        on_token: Callable[[int], None] | None = None,
        resume: bool | None = None,
        max_queue: int | None = None,
        queue_timeout: float | None = None,
        on_logprob: Callable[[int, TokenLogprob], None] | None = None,
    ) -> Reply:
        """One request; returns when it is done. Cancelling the awaiting task cancels the request in the
        ring (its caches are freed), or takes it out of the entry's queue. `resume` (default: when the
        client knows fallback addresses): carry an interrupted request over to a new entry. `max_queue` /
        `queue_timeout`: tighter bounds than the entry's for this request's wait in its queue.

        `on_token(token_id)` is called for each token as it streams. With `params.logprobs` set, each token
        arrives with its `TokenLogprob` (token, logprob, top_ids, top_logprobs): `on_logprob(token_id,
        entry)` is called right after `on_token`, and `Reply.logprobs` has them all; with
        `params.prompt_logprobs`, `Reply.prompt_logprobs` has the prompt's (echo)."""
        params = params or SamplingParams()
        resume = self.can_resume if resume is None else resume
        if resume and params.temperature > 0 and params.seed is None:
            params = params.with_seed(random.getrandbits(62))
        streamed: list[int] = []
        lps: list[TokenLogprob] = []
        moves = 0
        while True:
            p = replace(params, max_tokens=params.max_tokens - len(streamed))
            try:
                r = await self._one(
                    list(prompt) + streamed,
                    p,
                    logits,
                    incremental,
                    streamed,
                    on_token,
                    lps,
                    on_logprob,
                    len(streamed),
                    (max_queue, queue_timeout),
                )
                r.tokens = streamed[: len(streamed) - len(r.streamed)] + r.tokens
                r.streamed, r.resumed = streamed, moves
                if params.logprobs is not None:
                    r.logprobs = list(lps)
                if r.prompt_logprobs is not None:
                    r.prompt_logprobs = r.prompt_logprobs[: len(prompt)]
                return r
            except LOST as e:
                if not resume or logits:
                    raise RequestError("connection_lost", f"the connection to the entry was lost: {why(e)}") from None
                if streamed and (streamed[-1] in params.stop_ids or len(streamed) >= params.max_tokens):
                    return Reply(
                        streamed, {}, {}, None, streamed, moves, list(lps) if params.logprobs is not None else None
                    )
                self.close()
                self.conn = await self._find_entry(self.resume_timeout_s)
                moves += 1

    async def _one(
        self, prompt, params, logits, incremental, streamed, on_token, lps, on_logprob, generated, queue=(None, None)
    ) -> Reply:
        self._rid += 1
        rid = self._rid
        req = GenerateRequest(rid, prompt, params, logits, incremental, *queue, generated=generated)
        await self.conn.send(req.frame())
        mine = []
        try:
            while True:
                f = await self.conn.recv()
                if f.header.get("request_id", rid) != rid:
                    continue  # a frame of an earlier, cancelled request
                if f.kind == "token":
                    t = parse_token(f)[2]
                    lp = parse_token_logprob(f)
                    streamed.append(t)
                    mine.append(t)
                    if lp is not None:
                        lps.append(lp)
                    if on_token:
                        on_token(t)
                    if on_logprob and lp is not None:
                        on_logprob(t, lp)
                elif f.kind == "done":
                    d = parse_done(f)
                    lg = np.array(f.array("logits"), dtype=np.float32, copy=True) if f.has("logits") else None
                    plp = list(d.prompt_logprobs) if d.prompt_logprobs is not None else None
                    return Reply(d.tokens, d.stats, d.stage_stats, lg, mine, prompt_logprobs=plp)
                elif f.kind == "error":
                    e = parse_error(f)
                    raise RequestError(e.code, e.message, e.retry_after)
                else:
                    raise RequestError("bad_reply", f"unexpected frame {f.kind!r}")
        except asyncio.CancelledError:
            try:
                await asyncio.wait_for(asyncio.shield(self.conn.send(cancel_frame(rid))), 1.0)
            except Exception:
                pass
            raise

    async def cancel_current(self) -> None:
        await self.conn.send(cancel_frame(self._rid))

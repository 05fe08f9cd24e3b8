"""The node daemon: one per GPU host, all identical. It loads what its topology slot owns, serves an
authenticated TCP port, connects to its ring successor, runs its stage over batches of whatever is
waiting, and — on the slot that holds the embedding — plays the entry role for clients.

Ring: slot 0 (embedding + entry) -> ... -> last slot (head: final norm, lm_head, sampling) -> slot 0.
Frames on the ring: `forward` (a hop), `result` (sampled tokens / logits back to the entry), `free`
(end sessions; travels once around the ring in order with the work). Client frames on any connection
to the entry node: `generate` -> `token`* then `done` (or `error`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from p2pk3.engine.reference import configure_cpu_threads, load_stage
from p2pk3.engine.sampling import SamplingParams
from p2pk3.model.cache import CacheFull, SessionError
from p2pk3.model.config import K3Config
from p2pk3.model.kimi_k3 import ExpertNotHeld
from p2pk3.topology import Topology
from p2pk3.transport.connection import ConnectionClosed, TransportError, open_connection, serve
from p2pk3.transport.frames import Frame, ProtocolError, error_frame, free_frame, parse_free, parse_result, pong_frame, result_frame

from .claims import ClaimTable, connection_asker, handle_claim, negotiate_claim
from .discovery import Discovery
from .entry import Busy, Entry
from .stage_runner import StageRunner, Work, hop_frame, merge, model_plan, torch_tensor, wire_tensor, work_from_forward

log = logging.getLogger("p2pk3.node")

RECOVERABLE = (CacheFull, SessionError, ExpertNotHeld)


@dataclass
class _Free:
    sessions: list[tuple[str, int]]
    origin: str


class NodeDaemon:
    def __init__(self, topo: Topology, slot: str, *, model_dir: str | Path, secret: bytes, host: str = "127.0.0.1",
                 port: int | None = None, node_id: str | None = None, dtype: str = "float32", device: str = "cpu",
                 max_sessions: int = 32, max_tokens: int = 32768, max_batch_tokens: int = 2048,
                 prefill_chunk: int = 256, discovery: bool = False, advertise_host: str | None = None,
                 drop_beacons: bool = False, claim_wait: float = 1.5):
        self.topo, self.slot_id = topo, slot
        self.slot = topo.slot(slot)
        self.model_dir = Path(model_dir)
        self.secret = secret
        self.host = host
        self.port = port if port is not None else (self.slot.port or 0)
        self.node_id = node_id or f"{slot}@{os.uname().nodename}:{os.getpid()}"
        self.dtype, self.device = dtype, device
        self.max_sessions, self.max_tokens = max_sessions, max_tokens
        self.max_batch_tokens, self.prefill_chunk = max_batch_tokens, prefill_chunk
        self.use_discovery = discovery
        self.advertise_host = advertise_host
        self.drop_beacons = drop_beacons  # fault hook for tests: ignore every received beacon
        self.claim_wait = claim_wait
        self.claims = ClaimTable(self.node_id)
        self.claim = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.entry: Entry | None = None
        self.runner: StageRunner | None = None
        self._next_conn = None
        self._next_lock = asyncio.Lock()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="stage")
        self._tasks: list[asyncio.Task] = []
        self.server = None
        self.discovery = None
        self.stats = {"batches": 0, "tokens": 0, "busy_s": 0.0, "frames_in": 0, "errors": 0, "started": time.time()}

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = K3Config.from_pretrained(self.model_dir)
        self.cfg = cfg
        if torch.device(self.device).type == "cpu":
            configure_cpu_threads(cfg)
        for w in self.topo.validate(cfg):  # raises TopologyError naming every problem
            log.warning("topology: %s", w)
        if not self.slot.standby:
            tp = self.topo.stage_plan(self.slot, cfg)
            self.tplan = tp
            plan = model_plan(tp, cfg)
            stage = await loop.run_in_executor(self._executor, load_stage, self.model_dir, plan, self.dtype,
                                               self.device, cfg)
            self.runner = StageRunner(stage, stage.new_cache(self.max_sessions, self.max_tokens))
            if plan.embed:
                self.entry = Entry(self._submit_local, self._free_from_entry, prefill_chunk=self.prefill_chunk,
                                   max_batch_tokens=self.max_batch_tokens, max_sessions=self.max_sessions)
        self.server = await serve(self.host, self.port, self.secret, self.node_id, self._handle)
        self.port = self.server.port
        try:
            if self.use_discovery:
                await self._start_discovery()
            await self._claim_slot()
        except BaseException:
            await self.stop()
            raise
        if self.slot.standby:  # a spare: up, discovered, claimed, holding no layers (fail-over: next step)
            log.info("standby slot %s up on %s:%d (holds no layers)", self.slot_id, self.host, self.port)
            return
        self._tasks.append(asyncio.create_task(self._worker(), name=f"stage-{self.slot_id}"))
        log.info("slot %s serving on %s:%d: %s", self.slot_id, self.host, self.port, self.tplan.describe())

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.discovery is not None:
            await self.discovery.stop()
        if self.server is not None:
            await _maybe_await(self.server.close())
        if self._next_conn is not None:
            self._next_conn.close("shutting down")
        if self.entry:
            self.entry.fail_all("node shutting down")
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _start_discovery(self) -> None:
        c = self.topo.cluster
        adv = self.advertise_host or (self.host if self.host not in ("0.0.0.0", "") else None)
        self.discovery = Discovery(c.name, self.secret, self.node_id, port=self.port, host=adv,
                                   beacon_port=c.beacon_port, beacon_addrs=c.beacon_addrs,
                                   static=self.topo.static_addresses(), claims=self.claims,
                                   standby=self.slot.standby,
                                   interval=0.5 if self.claim_wait < 1.5 else 1.0)
        if self.drop_beacons:
            self.discovery._on_datagram = lambda data, addr: None
        await self.discovery.start()
        await asyncio.sleep(self.claim_wait)  # hear the others' beacons before claiming

    async def _claim_slot(self) -> None:
        """Take our slot with an epoch above any seen: ask every discovered node and the static address of
        every other slot; a live holder refuses and we stop with its reason (ClaimRefused)."""
        addrs: dict[str, tuple[str, int]] = {}
        if self.discovery is not None:
            for nid, p in self.discovery.peers().items():
                addrs[nid] = p.address
        mine = {(self.host, self.port), (self.advertise_host, self.port)}
        for sid, a in self.topo.static_addresses().items():
            if a not in mine and a not in addrs.values():
                addrs[f"static:{sid}"] = a
        base = connection_asker(addrs, self.secret, self.node_id, connect_timeout=1.0)

        async def ask(peer, frame):
            if peer.startswith("static:"):  # we do not know its node id: ask whoever answers there
                from p2pk3.transport.connection import open_connection
                conn = await open_connection(*addrs[peer], self.secret, self.node_id, timeout=1.0, handshake_timeout=1.0)
                try:
                    await conn.send(frame)
                    return await conn.recv() if frame.header.get("op", "request") == "request" else None
                finally:
                    conn.close("claim done")
            return await base(peer, frame)

        async def notify(peer, frame):
            try:
                await ask(peer, frame)
            except Exception:
                pass

        self.claim = await negotiate_claim(self.claims, self.slot_id, list(addrs), ask, timeout=2.0, notify=notify)
        if self.discovery is not None:
            self.discovery.update(slot=self.slot_id, epoch=self.claim.epoch, since=self.claim.since)
        log.info("claimed slot %s (epoch %d)", self.slot_id, self.claim.epoch)

    # ------------------------------------------------------------------ ring successor
    def _successor_addr(self) -> tuple[str, int]:
        act = self.topo.active
        nxt = act[(act.index(self.slot) + 1) % len(act)]
        if self.discovery is not None:
            peer = self.discovery.resolve_slot(nxt.id)  # the live claimant, else the static address
            if peer is not None:
                return peer.address
        if nxt.host and nxt.port:
            return nxt.host, nxt.port
        raise ConnectionError(f"no address known for ring successor slot {nxt.id} (not discovered, none in topology)")

    @property
    def is_alone(self) -> bool:
        return len(self.topo.active) == 1

    async def _send_next(self, frame: Frame, *, as_received: bool = False) -> None:
        async with self._next_lock:
            tries = 300 if self.discovery is not None else 50  # discovery may still be converging
            for attempt in range(tries):
                if self._next_conn is None or self._next_conn.closed:
                    try:
                        host, port = self._successor_addr()
                        self._next_conn = await open_connection(host, port, self.secret, self.node_id)
                        asyncio.create_task(self._drain_replies(self._next_conn))
                    except (OSError, asyncio.TimeoutError, TransportError, ConnectionError) as e:
                        if attempt == tries - 1:
                            raise
                        log.debug("successor not reachable yet (%s); retrying", e)
                        await asyncio.sleep(0.1)
                        continue
                try:
                    if as_received:  # pass a received frame on without re-encoding it
                        await self._next_conn.forward(frame)
                    else:
                        await self._next_conn.send(frame)
                    return
                except (ConnectionClosed, TransportError, OSError) as e:
                    log.warning("lost the connection to the ring successor: %s", e)
                    self._next_conn = None
            raise ConnectionError("ring successor unreachable")

    async def _drain_replies(self, conn) -> None:
        """Our successor never sends on this connection except errors; log them."""
        try:
            async for f in conn:
                if f.kind == "error":
                    log.warning("successor reported: %s: %s", f.header.get("code"), f.header.get("message"))
        except (ProtocolError, TransportError, ConnectionError):
            pass

    # ------------------------------------------------------------------ inbound
    async def _handle(self, conn) -> None:
        try:
            async for f in conn:
                self.stats["frames_in"] += 1
                kind = f.kind
                if kind in ("forward", "result", "free") and self.runner is None:
                    raise ProtocolError(f"{kind} frame sent to standby slot {self.slot_id}, which holds no stage")
                if kind == "forward":
                    try:
                        work = work_from_forward(f, self.runner.stage.device)
                    except ProtocolError:
                        raise
                    except Exception as e:  # malformed tensors (dtype/shape the stage cannot take)
                        raise ProtocolError(f"forward frame rejected: {e}") from None
                    self.queue.put_nowait(work)
                elif kind == "result":
                    if self.entry is None:  # an error result on its way to the entry: pass it on
                        parse_result(f)
                        await self._send_next(f, as_received=True)
                        continue
                    results = parse_result(f)
                    logits = torch_tensor(f, "logits", "cpu") if f.has("logits") else None
                    self.entry.on_results(results, logits)
                elif kind == "free":
                    self.queue.put_nowait(_Free(parse_free(f), str(f.header.get("origin", ""))))
                elif kind == "ping":
                    await conn.send(pong_frame(f, slot=self.slot_id, **self.public_stats()))
                elif kind == "generate":
                    await self._serve_generate(conn, f)
                elif kind == "claim":
                    reply = handle_claim(self.claims, f, peer_id=conn.peer_id)
                    if reply is not None:
                        await conn.send(reply)
                elif kind == "status":
                    await conn.send(Frame.make("status", **self.public_stats()))
                else:
                    raise ProtocolError(f"unexpected frame kind {kind!r}")
        except ProtocolError as e:
            self.stats["errors"] += 1
            log.warning("closing connection from %s: %s", conn.describe(), e)
            try:
                await conn.send(error_frame("bad_frame", str(e), fatal=True))
            except Exception:
                pass
            conn.close(str(e))
        except (ConnectionClosed, TransportError, ConnectionError):
            pass

    def public_stats(self) -> dict:
        r = self.runner
        return {"slot": self.slot_id, "standby": self.slot.standby, "node": self.node_id,
                "epoch": self.claim.epoch if self.claim else None, "batches": self.stats["batches"],
                "tokens": self.stats["tokens"], "busy_s": round(self.stats["busy_s"], 4),
                "sessions": len(r.cache.sessions) if r else 0, "errors": self.stats["errors"]}

    # ------------------------------------------------------------------ the stage worker
    def _submit_local(self, work: Work) -> None:
        self.queue.put_nowait(work)

    def _free_from_entry(self, sessions) -> None:
        self.queue.put_nowait(_Free([(str(s), e) for s, e in sessions], origin=self.node_id))

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            item = await self.queue.get()
            if isinstance(item, _Free):
                await self._do_free(item)
                continue
            works, n = [item], item.n_tokens
            pending_free = []
            while not self.queue.empty() and n < self.max_batch_tokens:  # continuous batching
                nxt = self.queue.get_nowait()
                if isinstance(nxt, _Free):
                    pending_free.append(nxt)
                    break
                works.append(nxt)
                n += nxt.n_tokens
            try:
                await self._run_works(loop, works)
                for fr in pending_free:
                    await self._do_free(fr)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the worker must survive anything one batch does
                self.stats["errors"] += 1
                log.exception("slot %s: batch failed", self.slot_id)
                for w in works:
                    try:
                        await self._report_errors(w, RuntimeError(f"slot {self.slot_id} failed: {e}"))
                    except Exception:
                        log.warning("slot %s: could not report the failure to the entry", self.slot_id)

    async def _run_works(self, loop, works: list[Work]) -> None:
        groups = [works]
        if len(works) > 1 and (works[0].tokens is None) != (works[-1].tokens is None):
            groups = [[w] for w in works]
        for group in groups:
            t0 = time.perf_counter()
            try:
                out = await loop.run_in_executor(self._executor, self.runner.run, merge(group))
                outs = [(group, out)]
            except Exception as e:  # CacheFull, SessionError, ExpertNotHeld, or a bad hop's shapes
                if len(group) == 1:
                    await self._report_errors(group[0], e)
                    continue
                outs = []  # one bad unit must not fail the others: rerun them one by one
                for w in group:
                    try:
                        outs.append(([w], await loop.run_in_executor(self._executor, self.runner.run, w)))
                    except Exception as e1:
                        await self._report_errors(w, e1)
            self.stats["busy_s"] += time.perf_counter() - t0
            for g, out in outs:
                self.stats["batches"] += 1
                self.stats["tokens"] += sum(w.n_tokens for w in g)
                segs = [s for w in g for s in w.segments]
                await self._emit(segs, out)

    async def _emit(self, segs, out) -> None:
        if out[0] == "hop":
            nl = self.tplan.last_layer + (0 if self.tplan.exits_mid_moe else 1)
            await self._send_next(hop_frame(segs, out[1], nl))
            return
        _, results, logits = out
        if self.entry is not None:  # the ring closes on this node (single-slot ring)
            self.entry.on_results(results, logits)
        else:
            await self._send_next(result_frame(results, wire_tensor(logits) if logits is not None else None))

    async def _report_errors(self, work: Work, e: Exception) -> None:
        self.stats["errors"] += 1
        msg = str(e) if isinstance(e, RECOVERABLE) else f"{type(e).__name__}: {e}"
        if isinstance(e, RECOVERABLE):
            log.warning("slot %s: %s", self.slot_id, msg)
        else:
            log.error("slot %s: unexpected failure of a batch: %s", self.slot_id, msg, exc_info=e)
        results = [{"session": s.session, "epoch": s.epoch, "pos": s.start_pos, "token": 0, "error": msg}
                   for s in work.segments]
        # the stage frees nothing it did not open; the entry frees the sessions along the ring
        if self.entry is not None:
            self.entry.on_results(results, None)
        else:
            await self._send_result_to_entry(results)

    async def _send_result_to_entry(self, results) -> None:
        """Errors skip the remaining stages: they travel on the ring to the entry as result frames
        (stages that are not the head pass result frames on)."""
        await self._send_next(result_frame(results))

    async def _do_free(self, fr: _Free) -> None:
        for sid, _epoch in fr.sessions:
            self.runner.free(sid)
        act = self.topo.active
        last = act.index(self.slot) == len(act) - 1
        if not last:
            f = free_frame(fr.sessions)
            f.header["origin"] = fr.origin
            await self._send_next(f)

    # ------------------------------------------------------------------ clients
    async def _serve_generate(self, conn, f: Frame) -> None:
        if self.entry is None:
            await conn.send(error_frame("not_entry", f"slot {self.slot_id} has no entry role; connect to the first slot"))
            return
        h = f.header
        prompt = h.get("prompt")
        vocab = self.cfg.vocab_size
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            await conn.send(error_frame("bad_request", f"prompt must be a non-empty list of token ids in 0..{vocab - 1}"))
            return
        try:
            params = SamplingParams.from_wire(h.get("params") or {})
            s = self.entry.submit(prompt, params, want_logits=bool(h.get("logits")), incremental=bool(h.get("incremental")))
        except Busy as e:
            await conn.send(error_frame("busy", str(e)))
            return
        except (ValueError, TypeError) as e:
            await conn.send(error_frame("bad_request", str(e)))
            return
        rid = h.get("request_id", 0)
        try:
            while True:
                tok = await s.out.get()
                if tok is None:
                    break
                await conn.send(Frame.make("token", request_id=rid, session=s.id, token=tok))
        except (ConnectionClosed, TransportError):
            self.entry.cancel(s.id, "client went away")
            return
        if s.error:
            await conn.send(error_frame("busy" if "busy" in s.error else "failed", s.error, request_id=rid, session=s.id))
            return
        tensors = None
        if s.want_logits:
            tensors = [("logits", wire_tensor(torch.cat(s.logits)))]
        await conn.send(Frame.make("done", tensors, request_id=rid, session=s.id, tokens=s.generated,
                                   stats=s.stats(), stage_stats=self.public_stats()))


async def _maybe_await(x):
    if asyncio.iscoroutine(x) or isinstance(x, asyncio.Future):
        return await x
    return x

"""The node daemon: one per GPU host, all identical. It loads what its topology slot owns, serves an
authenticated TCP port, sends its stage's output to its ring successor, and — on the slot that holds
the embedding — plays the entry role for clients and coordinates failure handling. A daemon on a
standby slot holds nothing until it is asked to take a dead slot over.

Ring: slot 0 (embedding + entry) -> ... -> last slot (head: final norm, lm_head, sampling) -> slot 0.
The parts: stage_runner (torch), worker (batching), links (successor / entry connections), monitor
(heartbeats), failover (what a dead slot means), entry + serving (sessions and clients), claims and
discovery (who holds which slot), routes (where each slot is served now), takeover (the files a spare
lacks), spares (the pool of standbys beyond the topology's), admission (the entry's queue), degraded (slow
stages, handed over), replaced (telling a replaced holder that its slot moved). Frame kinds are dispatched
by the table in `_handlers` (docs/protocol.md lists them all; every frame is built and parsed in
transport/messages).

Over 700 lines, one module because it is the one place that wires those parts together: the
lifecycle (start, take over, stop), the handler table and the outbound paths share the daemon's state;
each part gets from it only what it needs (e.g. the failover Coordinator gets callbacks, not the daemon).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from p2pk3.checkpoint.stage import load_stage
from p2pk3.engine.reference import configure_cpu_threads
from p2pk3.engine.sampler import grammar_tokenizer
from p2pk3.model.config import K3Config
from p2pk3.topology import Topology
from p2pk3.transport.codec import Frame, ProtocolError
from p2pk3.transport.connection import ConnectionClosed, TransportError, open_connection
from p2pk3.transport.messages import (
    ErrorCode,
    Result,
    Route,
    error_frame,
    free_frame,
    handover_frame,
    parse_claim,
    parse_free,
    parse_free_keep,
    parse_prefix_report,
    parse_handover,
    parse_result,
    parse_retain,
    parse_route,
    parse_takeover,
    pong_frame,
    prefix_report_frame,
    result_frame,
    route_frame,
    status_frame,
)
from p2pk3.transport.server import serve

from .admission import Admission
from .claiming import claim_slot
from .claims import Claim, ClaimTable, handle_claim
from .degraded import entry_watch
from .discovery import Discovery
from .entry import Entry
from .failover import Coordinator, entry_lost, request
from .links import LinkDown, PeerLink
from .monitor import Monitor
from .options import NodeOptions
from .prefix_setup import deliver, make_caches, make_matcher, reports
from .status import node_status
from .replaced import tell_replaced
from .routes import RouteTable
from .serving import ClientRequests, ClientService
from .spares import POOL_SLOT, SparePool, handle_join, join_pool, with_pool_slot
from .takeover import fetch_lacking_files
from .stage_runner import (
    HeadOut,
    HopOut,
    StageRunner,
    hop_frame,
    model_plan,
    torch_tensor,
    wire_tensor,
    work_from_forward,
)
from .worker import Free, Retain, StageWorker

log = logging.getLogger("p2pk3.node")


class NodeDaemon:
    def __init__(
        self,
        topo: Topology,
        slot: str | None,
        *,
        model_dir: str | Path,
        secret: bytes,
        options: NodeOptions | None = None,
    ):
        self.pool = slot is None  # a pool spare (node/spares.py): a standby no topology slot names
        if self.pool:
            topo, slot = with_pool_slot(topo), POOL_SLOT
        self.topo, self.slot_id = topo, slot
        topo.slot(slot)  # KeyError for an unknown slot
        self.model_dir = Path(model_dir)
        self.secret = secret
        self.opts = o = (options or NodeOptions()).sized_by(topo.memory)
        self.host = o.host
        self.port = o.port if o.port is not None else (self.slot.port or 0)
        self.node_id = o.node_id or f"{'spare' if self.pool else slot}@{os.uname().nodename}:{os.getpid()}"
        self.claims = ClaimTable(self.node_id, on_lost=self._lost_claim)
        self.claim = None
        self.role = "starting"
        self.entry: Entry | None = None
        self.clients: ClientService | None = None
        self.runner: StageRunner | None = None
        self.worker: StageWorker | None = None
        self.monitor: Monitor | None = None
        self.coordinator: Coordinator | None = None
        self.spares = SparePool()  # the entry's pool spares (the entry role uses it)
        self.routes = RouteTable(topo.static_addresses())
        self.successor = PeerLink(
            "ring successor",
            self._successor_addr,
            secret,
            self.node_id,
            dial_deadline_s=o.dial_deadline_s,
            send_timeout_s=o.send_timeout_s,
        )
        self.to_entry = PeerLink(
            "entry",
            lambda: self.routes.address(self.topo.active[0].id),
            secret,
            self.node_id,
            dial_deadline_s=o.dial_deadline_s,
            send_timeout_s=o.send_timeout_s,
        )
        self.routes.listeners.append(self._on_route)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="stage")
        self.server = None
        self.discovery = None
        self.stopped = asyncio.Event()
        self.stop_reason: str | None = None
        self.stats = {"frames_in": 0, "errors": 0, "started": time.time()}
        self.started_mono = time.monotonic()  # the start-up grace (NodeOptions.startup_grace_s) counts from here
        self.cfg: K3Config | None = None
        self._taking: asyncio.Task | None = None
        self._joining: asyncio.Task | None = None  # a pool spare's join loop
        self._file_server = None  # deploy.peers.FileServer, made on the first file request
        self._tasks: set[asyncio.Task] = set()  # background tasks (telling a replaced holder its slot moved)
        self._handlers = {
            "forward": self._on_forward,
            "result": self._on_result,
            "free": self._on_free,
            "ping": self._on_ping,
            "status": self._on_status,
            "claim": self._on_claim,
            "generate": self._on_generate,
            "cancel": self._on_cancel,
            "route": self._on_route_frame,
            "takeover": self._on_takeover,
            "handover": self._on_handover,
            "retain": self._on_retain,
            "prefix_report": self._on_prefix_report,
            "file_list": self._on_file_list,
            "file_get": self._on_file_get,
            "join": lambda conn, f, reqs: handle_join(self, conn, f),  # a pool spare (node/spares.py)
        }

    @property
    def slot(self):
        return self.topo.slot(self.slot_id)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        o = self.opts
        self.cfg = cfg = K3Config.from_pretrained(self.model_dir)
        if torch.device(o.device).type == "cpu":
            configure_cpu_threads(cfg)
        for w in self.topo.validate(cfg):  # raises TopologyError naming every problem
            log.warning("topology: %s", w)
        if not self.slot.standby:
            self.role = "loading"
            await self._load(self.slot_id)
        self.server = await serve(self.host, self.port, self.secret, self.node_id, self._handle)
        self.port = self.server.port
        try:
            if o.discovery:
                await self._start_discovery()
            if not self.pool:  # a pool spare claims nothing until it takes a slot over
                await self._claim_slot(self.slot_id)
        except BaseException:
            await self.stop("could not start")
            raise
        if self.slot.standby:
            self.role = "standby"
            self._start_monitor()
            if self.pool:
                self._joining = asyncio.create_task(join_pool(self), name="join-pool")
            log.info("standby %s up on %s:%d (holds no layers)", self.slot_id, self.host, self.port)
            return
        self._start_serving()
        log.info("slot %s serving on %s:%d: %s", self.slot_id, self.host, self.port, self.plan.describe())

    async def _load(self, slot_id: str) -> None:
        loop = asyncio.get_running_loop()
        o = self.opts
        self.plan = self.topo.slot_plan(self.topo.slot(slot_id), self.cfg)
        plan = model_plan(self.plan, self.cfg)
        from p2pk3.deploy.integrity import check_slot  # the shards against the manifest (IntegrityError stops us)

        await loop.run_in_executor(self._executor, check_slot, self.model_dir, self.cfg, self.plan)
        stage = await loop.run_in_executor(
            self._executor,
            load_stage,
            self.model_dir,
            plan,
            o.dtype,
            o.device,
            self.cfg,
            self.topo.model.formats,
            None,
            o.compile,
        )  # formats: p2pk3.quant
        gtok = (lambda: grammar_tokenizer(self.model_dir, self.cfg.vocab_size)) if plan.head else None
        self.runner = StageRunner(
            stage, *make_caches(stage, o, self.cfg, self.topo.model.formats), grammar_tokenizer=gtok
        )
        self.worker = StageWorker(
            self.runner,
            self._executor,
            slot=slot_id,
            max_batch_tokens=o.max_batch_tokens,
            emit=self._emit,
            report=self._report,
            pass_free=self._pass_free,
            first=plan.embed,
            report_prefix=self._report_prefix,
        )
        if plan.embed:  # requests are taken from now on; they run once the worker starts
            m, d = o.schedule(len(self.topo.active))
            self.entry = Entry(
                self.worker.put,
                self._free_from_entry,
                prefill_chunk=o.prefill_chunk,
                max_batch_tokens=o.max_batch_tokens,
                max_sessions=o.max_sessions,
                micro_batches=m,
                prefill_depth=d,
                stage_cost=self.worker.cost,
            )
            if self.runner.prefix is not None:  # the entry's side of the prefix cache
                self.entry.prefixes = make_matcher(self.topo, o, self.cfg)
            self.coordinator = Coordinator(
                self.entry,
                slot_id=slot_id,
                topo=self.topo,
                opts=o,
                routes=self.routes,
                holder_of=self.holder_of,
                mark_dead=self.claims.mark_dead,
                broadcast=self.broadcast,
                retain=self.retain,
                request=self._request,
                spares=self.spares,
                degraded=entry_watch(self, slot_id),
            )
            self.clients = ClientService(
                self.entry,
                self.cfg.vocab_size,
                health=self.coordinator.health,
                stage_stats=self.public_stats,
                admission=Admission(self.entry, max_queue=o.max_queue, timeout_s=o.queue_timeout_s),
            )

    def _start_serving(self) -> None:
        self.role = "entry" if self.entry is not None else "stage"
        self.worker.start()
        if self.runner.prefix is not None:  # a new holder's cache is empty: the entry forgets what it knew
            asyncio.get_running_loop().create_task(self._report_prefix([], [], reset=True))
        if self.entry is not None:
            self._start_monitor()
            self.coordinator.start(self.monitor)
        elif self.monitor is not None:  # a standby that took a stage over watches nothing
            self.monitor.stop()
            self.monitor = None

    def _start_monitor(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
        o = self.opts
        self.monitor = Monitor(
            self.secret,
            self.node_id,
            self._watched,
            lambda key: self.spares.address(key) or self.routes.address(key),
            heartbeat_s=o.heartbeat_s,
            dead_after_s=o.dead_after_s,
            on_change=self._on_peer_change,
        )
        self.monitor.start()

    def _watched(self) -> list[str]:
        """Entry: every other active slot and every standby. Standby: the entry slot and the other standbys."""
        if self.role == "entry":
            if self.discovery is not None:
                self.spares.heard(self.discovery.peers())
            return [s.id for s in self.topo.slots if s.id != self.slot_id] + self.spares.keys()
        if self.role == "standby":
            return [self.topo.active[0].id] + [s.id for s in self.topo.standby if s.id != self.slot_id]
        return []

    def _on_peer_change(self, slot: str, ps) -> None:
        info = ps.info
        if ps.state == "up" and info.get("node") and isinstance(info.get("epoch"), int) and info.get("slot"):
            self.claims.observe(info["node"], info["slot"], info["epoch"])  # heartbeats keep claims fresh
        elif ps.state == "dead":  # the detector's verdict voids the claim: a restarted node may claim the slot
            holder = self.holder_of(slot, ps)
            if holder is not None:
                self.claims.mark_dead(slot, *holder)
        if self.coordinator is not None:
            self.coordinator.on_change(slot, ps)
        elif self.role == "standby" and slot == self.topo.active[0].id:
            asyncio.get_running_loop().call_later(0, self._maybe_take_entry)

    def holder_of(self, slot: str, ps) -> tuple[str, int] | None:
        """(node, epoch) of the claim a takeover of `slot` replaces: the claim table's record (commits and
        heartbeats feed it), else what the holder's last pong said."""
        r = self.claims.record(slot)
        if r is not None and r.node != self.node_id:
            return r.node, r.epoch
        if ps is not None and ps.info.get("node") and isinstance(ps.info.get("epoch"), int):
            return ps.info["node"], ps.info["epoch"]
        return None

    def _request(self, addr: tuple[str, int], frame: Frame, timeout: float) -> Frame:
        return request(addr, self.secret, self.node_id, frame, timeout)

    def _maybe_take_entry(self) -> None:
        if self.role != "standby" or self.monitor is None or self._taking is not None:
            return
        grace_left = self.opts.startup_grace_s - (time.monotonic() - self.started_mono)
        verdict = entry_lost(self.monitor, self.topo, self.slot_id, grace_left)
        if verdict is True:
            slot = self.topo.active[0].id
            if self.monitor.state(slot).state != "dead":
                log.warning(
                    "the entry slot %s has not answered since this standby started %.0f s ago: taking it over",
                    slot,
                    time.monotonic() - self.started_mono,
                )
            self._taking = asyncio.create_task(self._take_over_entry(self.holder_of(slot, self.monitor.state(slot))))
        elif verdict is not False:  # an entry never seen up: look again when the start-up grace is over
            asyncio.get_running_loop().call_later(verdict, self._maybe_take_entry)

    async def _take_over_entry(self, replaces) -> None:
        slot = self.topo.active[0].id
        try:
            route = await self.take_over(slot, replaces)
        except Exception as e:
            log.error("could not take over the entry slot %s: %s; retrying", slot, e)
            asyncio.get_running_loop().call_later(self.opts.heartbeat_s, self._maybe_take_entry)
            return
        finally:
            self._taking = None
        await self.broadcast(route_frame(route))

    async def stop(self, reason: str = "stopped") -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            log.info("node %s (slot %s) stopping: %s", self.node_id, self.slot_id, reason)
        for part in (self.worker, self.monitor, self.coordinator):
            if part is not None:
                part.stop()
        if self._joining is not None:
            self._joining.cancel()
        for t in list(self._tasks):
            t.cancel()
        if self.discovery is not None:
            await self.discovery.stop()
        if self.server is not None:
            self.server.close()
        self.successor.close()
        self.to_entry.close()
        if self.entry:
            self.entry.fail_all("node shutting down")
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.stopped.set()

    async def _start_discovery(self) -> None:
        c, o = self.topo.cluster, self.opts
        adv = self.advertised_host
        self.discovery = Discovery(
            c.name,
            self.secret,
            self.node_id,
            port=self.port,
            host=adv,
            beacon_port=c.beacon_port,
            beacon_addrs=c.beacon_addrs,
            static=self.topo.static_addresses(),
            claims=self.claims,
            standby=self.slot.standby,
            interval=0.5 if o.claim_wait < 1.5 else 1.0,
            drop_received=o.drop_beacons,
        )
        self.routes.discovery = self.discovery
        await self.discovery.start()
        await asyncio.sleep(o.claim_wait)  # hear the others' beacons before claiming

    @property
    def advertised_host(self) -> str:
        o = self.opts
        return o.advertise_host or (self.host if self.host not in ("0.0.0.0", "") else "127.0.0.1")

    async def _claim_slot(self, slot_id: str, replaces: tuple[str, int] | None = None) -> None:
        self.claim = await claim_slot(self, slot_id, replaces)

    async def take_over(self, slot_id: str, replaces: tuple[str, int] | None) -> Route:
        """A standby becomes `slot_id`: load exactly that slot's weights, claim it at a new epoch, serve."""
        if self.role != "standby":
            raise RuntimeError(f"node {self.node_id} is not a standby (it is {self.role} of slot {self.slot_id})")
        if self.topo.slot(slot_id).standby:
            raise ValueError(f"slot {slot_id} is a standby slot")
        log.warning("taking over slot %s (replacing %s)", slot_id, replaces)
        self.role = "loading"
        try:
            plan = self.topo.slot_plan(
                self.topo.slot(slot_id), self.cfg
            )  # its shards this spare lacks, from the others
            await fetch_lacking_files(self.model_dir, self.cfg, plan, self._other_addresses(), self.secret)
            await self._load(slot_id)
            await self._claim_slot(slot_id, replaces)
        except BaseException:
            self.role = "standby"
            self.runner = self.worker = self.entry = self.clients = self.coordinator = None
            raise
        self.slot_id = slot_id
        route = Route(slot_id, self.node_id, self.advertised_host, self.port, self.claim.epoch)
        was = self.routes.address_or_none(slot_id)  # the replaced holder's, before the route moves it
        self.routes.announce(route)
        if replaces is not None and was is not None and was != route.address:  # it may come back (partition)
            t = asyncio.ensure_future(tell_replaced(was, replaces[0], route, self.secret, self.node_id))
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)
        self._start_serving()
        log.warning("took over slot %s at epoch %d: %s", slot_id, self.claim.epoch, self.plan.describe())
        return route

    def _other_addresses(self) -> list[tuple[str, int]]:
        """Where every other slot of the topology is served (those with no known address are left out)."""
        out = []
        for s in self.topo.slots:
            if s.id != self.slot_id:
                try:
                    out.append(self.routes.address(s.id))
                except ConnectionError:
                    continue
        return out

    async def broadcast(self, frame: Frame, *, stages_only: bool = False) -> None:
        """Send `frame` to every other node of the topology (best effort, each with a deadline)."""
        slots = self.topo.active if stages_only else self.topo.slots

        async def one(sid):
            try:
                addr = self.routes.address(sid)
                conn = await open_connection(*addr, self.secret, self.node_id, timeout=2.0, handshake_timeout=2.0)
                try:
                    await asyncio.wait_for(conn.send(frame), 2.0)
                finally:
                    conn.close("broadcast done")
            except Exception as e:
                log.debug("could not send %s to slot %s: %s", frame.kind, sid, e)

        await asyncio.gather(*(one(s.id) for s in slots if s.id != self.slot_id))

    # ------------------------------------------------------------------ ring links
    def _successor_addr(self) -> tuple[str, int]:
        act = self.topo.active
        nxt = act[(act.index(self.slot) + 1) % len(act)]
        return self.routes.address(nxt.id)

    def _on_route(self, r: Route) -> None:
        act = self.topo.active
        if self.slot in act and r.slot == act[(act.index(self.slot) + 1) % len(act)].id:
            self.successor.reset("the successor slot moved")
        if r.slot == act[0].id:
            self.to_entry.reset("the entry moved")

    # ------------------------------------------------------------------ inbound
    async def _handle(self, conn) -> None:
        reqs = ClientRequests(conn)
        try:
            async for f in conn:
                self.stats["frames_in"] += 1
                handler = self._handlers.get(f.kind)
                if handler is None:
                    raise ProtocolError(f"unexpected frame kind {f.kind!r}")
                await handler(conn, f, reqs)
        except ProtocolError as e:
            self.stats["errors"] += 1
            log.warning("closing connection from %s: %s", conn.describe(), e)
            try:
                await asyncio.wait_for(conn.send(error_frame(ErrorCode.BAD_FRAME, str(e), fatal=True)), 1.0)
            except Exception:
                pass
            conn.close(str(e))
        except (ConnectionClosed, TransportError, ConnectionError):
            pass
        finally:
            reqs.close(self.entry)

    def _need_stage(self, kind: str) -> None:
        if self.worker is None:
            raise ProtocolError(f"{kind} frame sent to slot {self.slot_id}, which holds no stage ({self.role})")

    async def _on_forward(self, conn, f, reqs) -> None:
        self._need_stage("forward")
        try:
            work = work_from_forward(f, self.runner.stage.device)
        except ProtocolError:
            raise
        except Exception as e:  # malformed tensors (dtype/shape the stage cannot take)
            raise ProtocolError(f"forward frame rejected: {e}") from None
        self.worker.put(work)

    async def _on_result(self, conn, f, reqs) -> None:
        results = parse_result(f)
        if self.entry is None:  # on its way to the entry (the route changed under it): pass it on
            await self._to_entry(f)
            return
        logits = torch_tensor(f, "logits", "cpu") if f.has("logits") else None
        self.entry.on_results(results, logits)

    async def _on_free(self, conn, f, reqs) -> None:
        self._need_stage("free")
        sessions, origin = parse_free(f)
        self.worker.put(Free([(str(s), e) for s, e in sessions], origin, parse_free_keep(f)))

    async def _on_retain(self, conn, f, reqs) -> None:
        self.retain(parse_retain(f))

    def retain(self, keep: dict[str, int]) -> None:
        if self.worker is not None:
            self.worker.put(Retain(keep))

    async def _on_prefix_report(self, conn, f, reqs) -> None:
        if self.entry is not None:
            deliver(self.entry.prefixes, parse_prefix_report(f))

    async def _on_ping(self, conn, f, reqs) -> None:
        await conn.send(pong_frame(f, **self.public_stats()))

    async def _on_status(self, conn, f, reqs) -> None:
        await conn.send(status_frame(**self.public_stats()))

    async def _on_claim(self, conn, f, reqs) -> None:
        c = parse_claim(f)
        if not any(s.id == c.slot for s in self.topo.slots):  # nor the claim table
            raise ProtocolError(f"claim for slot {c.slot[:64]!r}, which is not in the topology")
        reply = handle_claim(self.claims, c, peer_id=conn.peer_id)
        if reply is not None:
            await conn.send(reply)

    async def _on_generate(self, conn, f, reqs) -> None:
        if self.clients is None:
            entry = self.topo.active[0].id
            try:
                h, p = self.routes.address(entry)
                where = f" at {h}:{p}"
            except ConnectionError:
                where = ""
            await conn.send(
                error_frame(
                    ErrorCode.NOT_ENTRY,
                    f"slot {self.slot_id} has no entry role; connect to the entry (slot {entry}{where})",
                    request_id=f.header.get("request_id"),
                )
            )
            return
        await self.clients.generate(conn, f, reqs)

    async def _on_cancel(self, conn, f, reqs) -> None:
        if self.clients is not None:
            self.clients.cancel(f, reqs)

    async def _on_route_frame(self, conn, f, reqs) -> None:
        r = parse_route(f)
        if not any(s.id == r.slot for s in self.topo.slots):  # the route table must not grow without bound
            raise ProtocolError(f"route for slot {r.slot[:64]!r}, which is not in the topology")
        if r.slot == self.slot_id and r.node != self.node_id and self.claim and r.epoch > self.claim.epoch:
            self._step_down(f"slot {r.slot} was taken over by node {r.node} (epoch {r.epoch}, ours {self.claim.epoch})")
        self.routes.announce(r)

    def _step_down(self, why: str) -> None:
        """This node no longer holds its slot: it stops serving (`p2pk3 node` exits; start it again as a
        standby to give the ring its spare back)."""
        if self.stop_reason is None:
            log.error("%s: this node steps down", why)
            self.stop_reason = why
            asyncio.get_running_loop().call_later(0, lambda: asyncio.ensure_future(self.stop(why)))

    def _lost_claim(self, lost: Claim, by: Claim) -> None:
        """The claim table heard a claim that beats ours (a heartbeat, a beacon or a claim message from the
        node that took our slot while we could not hear: a partition, a stop)."""
        if self.role in ("entry", "stage") and lost.slot == self.slot_id:
            self._step_down(f"slot {lost.slot} was taken by {by.describe()} (ours: epoch {lost.epoch})")

    def file_server(self):
        """What this node serves to peers: the files of its manifest (deploy/peers.py), made on first use."""
        if self._file_server is None:
            from p2pk3.deploy.peers import FileServer

            self._file_server = FileServer(self.model_dir)
        return self._file_server

    async def _on_file_list(self, conn, f, reqs) -> None:
        from p2pk3.deploy.peers import handle_file_list  # files of the manifest, for peers

        await handle_file_list(self.file_server(), conn, f)

    async def _on_file_get(self, conn, f, reqs) -> None:
        from p2pk3.deploy.peers import handle_file_get  # one chunk of a manifest file, rate-limited

        await handle_file_get(self.file_server(), conn, f)

    async def _on_takeover(self, conn, f, reqs) -> None:
        slot, replaces = parse_takeover(f)
        try:
            route = await self.take_over(slot, replaces)
        except Exception as e:
            await conn.send(error_frame(ErrorCode.FAILED, f"takeover of slot {slot} failed: {e}"))
            return
        await conn.send(route_frame(route))

    async def _on_handover(self, conn, f, reqs) -> None:
        """The entry found this stage degraded (node/degraded.py): step down so a standby takes the slot."""
        slot, epoch, reason = parse_handover(f)
        mine = self.claim.epoch if self.claim else None
        if self.role != "stage" or slot != self.slot_id or epoch != mine:
            why = f"handover of slot {slot} at epoch {epoch} refused: this node holds {self.slot_id} at epoch {mine}"
            await conn.send(error_frame(ErrorCode.FAILED, f"{why} ({self.role})"))
            return
        await conn.send(handover_frame(slot, epoch, reason))
        self.claims.release()  # the standby's claim is granted here too
        self._step_down(f"slot {slot} (epoch {epoch}) handed over for being slow: {reason}")

    # ------------------------------------------------------------------ outbound
    async def _emit(self, segs, out: HopOut | HeadOut) -> None:
        if isinstance(out, HopOut):
            nl = self.plan.last_layer + (0 if self.plan.exits_mid_moe else 1)
            frame = hop_frame(segs, out.hop, nl)
        elif self.entry is not None:  # the ring closes on this node (single-slot ring)
            self.entry.on_results(out.results, out.logits)
            return
        else:
            frame = result_frame(out.results, wire_tensor(out.logits) if out.logits is not None else None)
        try:
            await self.successor.send(frame)
        except LinkDown as e:
            log.error("slot %s: %s; the entry re-sends these sessions once the ring is repaired", self.slot_id, e)
            act = self.topo.active
            nxt = act[(act.index(self.slot) + 1) % len(act)].id
            why = f"slot {nxt} is unreachable from slot {self.slot_id}, its predecessor ({e})"
            await self._report(
                [Result(s.session, s.epoch, s.start_pos, error=why, code=ErrorCode.UNAVAILABLE) for s in segs]
            )

    async def _report(self, results: list[Result]) -> None:
        """Per-session errors go straight to the entry (not along the ring, which may be what broke)."""
        if self.entry is not None:
            self.entry.on_results(results, None)
            return
        await self._to_entry(result_frame(results))

    async def _report_prefix(self, added, evicted, reset: bool = False) -> None:
        """What this stage's prefix cache added and evicted, to the entry (directly when it is here)."""
        for r in reports(self.slot_id, self.node_id, added, evicted, reset=reset, stateless=self.runner.prefix.stateless):
            if self.entry is not None:
                deliver(self.entry.prefixes, r)
            else:
                await self._to_entry(prefix_report_frame(r))

    async def _to_entry(self, frame: Frame) -> None:
        try:
            await self.to_entry.send(frame, deadline_s=self.opts.dead_after_s * 2)
        except LinkDown as e:
            log.warning("slot %s: could not reach the entry: %s", self.slot_id, e)

    def _free_from_entry(self, sessions) -> None:
        p = self.entry.prefixes if self.entry is not None else None
        keep = p.take_kept([str(s) for s, _ in sessions]) if p is not None else {}
        self.worker.put(Free([(str(s), e) for s, e in sessions], origin=self.node_id, keep=keep))

    async def _pass_free(self, fr: Free) -> None:
        act = self.topo.active
        if act.index(self.slot) == len(act) - 1:
            return
        try:
            await self.successor.send(free_frame(fr.sessions, fr.origin, fr.keep))
        except LinkDown as e:
            log.warning("slot %s: free not passed on: %s", self.slot_id, e)

    # ------------------------------------------------------------------ status
    def public_stats(self) -> dict:
        """What the `status` request and the pongs answer (node/status.py)."""
        return node_status(self)

"""`NodeOptions`: every tunable of a daemon in one place (the CLI fills it from `p2pk3 node` flags)."""

from __future__ import annotations

from dataclasses import dataclass, replace

DEFAULT_SESSIONS = 32  # without a [memory] table in the topology
DEFAULT_CACHE_TOKENS = 32768
QUEUE_FACTOR = 4  # the default admission queue holds this many times the session capacity
DEFAULT_QUEUE_TIMEOUT_S = 600.0  # node/admission.py says why


HIT_CHUNK_MIN = 32  # tokens: the smallest chunk a prefix-cache hit's remainder is cut into


def chunk_after_hit(remainder: int, depth: int, chunk: int) -> int:
    """The prefill chunk of a session that starts at a cached prefix (the entry and the simulator alike): the
    `remainder` still to compute is cut so that the `depth` chunks in flight fill the pipeline (a 2k-token
    agent turn through 78 stages: 32-token chunks, not 8 of 256, whose passes would each cross the ring
    nearly alone), never below HIT_CHUNK_MIN nor above `chunk`. A cold prompt keeps `chunk`."""
    return max(1, min(chunk, max(HIT_CHUNK_MIN, -(-remainder // max(1, depth)))))


@dataclass
class NodeOptions:
    host: str = "127.0.0.1"  # listen address
    port: int | None = None  # None: the slot's port from the topology (0: any free port)
    node_id: str | None = None  # default: "<slot>@<hostname>:<pid>"
    advertise_host: str | None = None  # the address peers dial (default: host)
    dtype: str = "float32"
    device: str = "cpu"
    compile: bool | None = None  # compiled decode step (p2pk3.model.compiled); None: on for CUDA, off on the CPU
    # sessions held at once (KDA state rows) and MLA cache tokens over all sessions; None: what the topology's
    # [memory] table sized (sessions, sessions x context), else DEFAULT_SESSIONS / DEFAULT_CACHE_TOKENS
    max_sessions: int | None = None
    cache_tokens: int | None = None
    max_batch_tokens: int = 2048  # tokens in one stage batch
    prefill_chunk: int = 256  # the entry cuts prompts into chunks of at most this many tokens
    # the entry's schedule (docs/architecture.md, "The scheduler"); None: auto = the ring's active slots
    micro_batches: int | None = None  # decode micro-batches in flight at once (1: one batch of every decode)
    prefill_depth: int | None = None  # chunks of one prompt in flight at once (1: the next leaves when one is back)
    # admission (node/admission.py): requests beyond max_sessions wait in a queue of at most max_queue (None:
    # 4 x max_sessions), each at most queue_timeout_s; a request that finds the queue full is refused (busy)
    max_queue: int | None = None
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    # prefix cache (docs/architecture.md, "The prefix cache"): device tier and host tier in GiB (None: defaults
    # from the free memory, p2pk3/node/prefix_setup.py; 0: off), tokens per block, a KDA snapshot every k blocks
    prefix_cache_gb: float | None = None
    host_cache_gb: float | None = None
    prefix_block: int = 64
    snapshot_every: int = 16
    discovery: bool = False  # UDP beacons
    claim_wait: float = 1.5  # seconds of listening to beacons before claiming
    # failure handling (docs/architecture.md, "Failure handling")
    heartbeat_s: float = 0.5  # ping period of the failure detector
    dead_after_s: float = 2.5  # no pong for this long: the peer is dead (detection <= heartbeat_s + dead_after_s)
    dial_deadline_s: float = 10.0  # how long a ring link keeps re-dialling before it gives up
    send_timeout_s: float = 10.0  # a frame the successor does not take within this is a dead link
    unit_timeout_s: float = 120.0  # a request unit with no answer from the ring for this long fails
    startup_grace_s: float = 15.0  # a slot never seen up is taken over only after this long
    retain_every_s: float = 30.0  # the entry tells the stages which sessions are alive (frees leftovers)
    # degraded stages (node/degraded.py): slower than `degraded_factor` x the expected time per token for
    # `degraded_after_s` -> handed over to a standby, at most once per slot per `handover_cooldown_s`
    degraded_factor: float = 3.0
    degraded_after_s: float = 10.0
    handover_cooldown_s: float = 120.0
    sim_profile: str | None = None  # hardware profile (p2pk3/sim/profiles): the simulator's expected times
    # fault injection (tests; the hooks sit in the production receive paths)
    drop_beacons: bool = False

    def sized_by(self, memory) -> "NodeOptions":
        """These options with the cache sizes left unset taken from the topology's [memory] table (a
        `topology.MemorySpec`; only where the file has the table: `memory.given`), so a node allocates what
        the plan sized; the defaults otherwise."""
        sessions = self.max_sessions
        if sessions is None:
            sessions = memory.sessions if memory.given else DEFAULT_SESSIONS
        tokens = self.cache_tokens
        if tokens is None:
            tokens = sessions * memory.context if memory.given else DEFAULT_CACHE_TOKENS
        return replace(self, max_sessions=sessions, cache_tokens=tokens)

    def schedule(self, active_slots: int) -> tuple[int, int]:
        """(micro-batches, prefill depth) for a ring of `active_slots` stages: auto is one unit per stage."""
        auto = max(1, active_slots)
        return self.micro_batches or auto, self.prefill_depth or auto

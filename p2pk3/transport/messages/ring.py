"""Ring frames, between daemons: `forward` (a stage-boundary hop), `result` (sampled tokens / logits /
per-session errors on their way to the entry), `free` (end sessions on every stage), `ping` / `pong`
(the failure detector)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from p2pk3.params import MAX_DRAFT, MAX_LOGPROBS, SamplingParams, TokenLogprob

from ..codec import Frame, ProtocolError
from .fields import ErrorCode, check_session, expect, is_int, logprob_list, name, sampling


# ------------------------------------------------------------------------------------------ segments
@dataclass(frozen=True)
class Segment:
    """One session's run of consecutive tokens in a batched frame: positions start_pos .. start_pos+n_tokens-1.
    `sample`: the parameters with which the last stage samples the token after the last position (None:
    a prefill chunk that is not the prompt's last, nothing to sample). `want_logits`: return the logits
    of every position instead of sampling (scoring).

    `draft` (speculative decoding): the k token ids drafted after the session's last accepted token; the
    segment's tokens are then [last accepted, *draft] (n_tokens = k + 1), every stage keeps a rollback
    checkpoint for them, and the last stage verifies them (Result.accepted). A later segment of the session
    whose start_pos is below what a stage holds rolls that stage back to start_pos.

    Prefix cache (p2pk3/node/prefix_match.py): `prefix` names the cached point (a chained block hash) the
    session starts at, on its first segment of an epoch that starts at start_pos > 0 (a stage that does not
    hold it answers code `prefix_miss`); `blocks` are the keys of the block boundaries the segment completes,
    `snap` the key of its end point when the entry wants the stages to keep a state snapshot there.

    The last stage's sampler state (penalties, grammar, prompt logprobs: `SamplingParams.stateful`) needs
    the session's token ids, which only the entry has. Segments of such a session carry `ids`: the ids at
    positions start_pos .. start_pos + len(ids) - 1, i.e. the segment's own tokens (drafts excluded: they
    are in `draft`) and, for a prefill chunk with more history after it, the next position's id (so the
    chunk's last row can be scored); and `output_from`: the first position of the output (generated
    tokens; the prompt is below it; after a replay the output so far is prefilled again). `prompt_logprobs`
    (N, 0..20): return the logprobs of the prompt tokens this segment's rows predict, with the top N.
    `history`: the ids of positions 0 .. start_pos - 1, on the first segment of a session that starts at a
    cached prefix (`prefix`) and whose sampler counts the prompt's ids (the repetition penalty,
    `SamplingParams.needs_prompt_ids`): the stages compute nothing for them, the last stage's sampler reads
    them."""

    session: str | int
    epoch: int
    start_pos: int
    n_tokens: int
    sample: SamplingParams | None = None
    want_logits: bool = False
    draft: tuple[int, ...] = ()
    ids: tuple[int, ...] = ()
    output_from: int = 0
    prompt_logprobs: int | None = None
    prefix: str | None = None
    blocks: tuple[str, ...] = ()
    snap: str | None = None
    history: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "session": self.session,
            "epoch": self.epoch,
            "start_pos": self.start_pos,
            "n_tokens": self.n_tokens,
        }
        if self.sample is not None:
            d["sample"] = self.sample.wire_map()  # shared, not copied: the frame only encodes it
        if self.want_logits:
            d["logits"] = True
        if self.draft:
            d["draft"] = [int(t) for t in self.draft]
        if self.ids:
            d["ids"] = [int(t) for t in self.ids]
            d["output_from"] = int(self.output_from)
        if self.prompt_logprobs is not None:
            d["prompt_logprobs"] = int(self.prompt_logprobs)
        if self.prefix is not None:
            d["prefix"] = self.prefix
        if self.blocks:
            d["blocks"] = list(self.blocks)
        if self.snap is not None:
            d["snap"] = self.snap
        if self.history:
            d["history"] = [int(t) for t in self.history]
        return d

    @classmethod
    def from_wire(cls, d: Any, where: str = "segment", same: "Segment | None" = None) -> "Segment":
        """`same`: the frame's previous segment; its sampling parameters are reused when this segment's map is
        their wire map (a batch's sessions mostly share theirs: one parse a frame, not one a segment)."""
        if not isinstance(d, dict):
            raise ProtocolError(f"{where}: not a map")
        check_session(d.get("session"), where)
        for k in ("epoch", "start_pos"):
            if not is_int(d.get(k)) or d[k] < 0:
                raise ProtocolError(f"{where}: {k} must be a non-negative integer, got {d.get(k)!r}")
        if not is_int(d.get("n_tokens")) or d["n_tokens"] <= 0:
            raise ProtocolError(f"{where}: n_tokens must be a positive integer, got {d.get('n_tokens')!r}")
        s = d.get("sample")
        if s is None:
            sample = None
        elif same is not None and same.sample is not None and _same_value(same.sample.wire_map(), s):
            sample = same.sample
        else:
            sample = sampling(s, f"{where}: sample")
        want = d.get("logits", False)
        if not isinstance(want, bool):
            raise ProtocolError(f"{where}: logits must be a bool")
        draft = d.get("draft", [])
        if not isinstance(draft, list) or len(draft) > MAX_DRAFT or not all(is_int(t) and t >= 0 for t in draft):
            raise ProtocolError(f"{where}: draft must be a list of at most {MAX_DRAFT} non-negative token ids")
        if draft and (d["n_tokens"] != len(draft) + 1 or sample is None or want):
            raise ProtocolError(
                f"{where}: a draft of {len(draft)} tokens needs n_tokens = {len(draft) + 1} "
                f"(got {d['n_tokens']}), sampling parameters and no logits"
            )
        prefix, snap, blocks = d.get("prefix"), d.get("snap"), d.get("blocks", [])
        for k, v in (("prefix", prefix), ("snap", snap)):
            if v is not None and not _is_key(v):
                raise ProtocolError(f"{where}: {k} must be a block key (1 to {MAX_KEY} characters), got {v!r:.40}")
        if prefix is not None and d["start_pos"] == 0:
            raise ProtocolError(f"{where}: a prefix names the cached point the segment starts at: start_pos > 0")
        if not isinstance(blocks, list) or len(blocks) > d["n_tokens"] or not all(_is_key(k) for k in blocks):
            raise ProtocolError(f"{where}: blocks must be a list of at most n_tokens block keys")
        ids = d.get("ids", [])
        n = d["n_tokens"] - len(draft)
        if not isinstance(ids, list) or len(ids) > n + 1 or not all(is_int(t) and t >= 0 for t in ids):
            raise ProtocolError(f"{where}: ids must be a list of at most {n + 1} non-negative token ids")
        out_from = d.get("output_from", 0)
        if not is_int(out_from) or out_from < 0:
            raise ProtocolError(f"{where}: output_from must be a non-negative integer, got {out_from!r}")
        plp = d.get("prompt_logprobs")
        if plp is not None and (not is_int(plp) or not 0 <= plp <= MAX_LOGPROBS):
            raise ProtocolError(f"{where}: prompt_logprobs must be an integer in 0..{MAX_LOGPROBS}, got {plp!r}")
        if plp is not None and not ids:
            raise ProtocolError(f"{where}: prompt_logprobs needs the segment's ids")
        history = d.get("history", [])
        if not isinstance(history, list) or not all(is_int(t) and t >= 0 for t in history):
            raise ProtocolError(f"{where}: history must be a list of non-negative token ids")
        if history and (len(history) != d["start_pos"] or prefix is None or not ids):
            raise ProtocolError(
                f"{where}: history holds the {d['start_pos']} ids below start_pos of a segment that starts at a "
                f"cached prefix and carries its ids (got {len(history)} ids, prefix {prefix!r:.40}, {len(ids)} ids)"
            )
        return cls(
            d["session"],
            d["epoch"],
            d["start_pos"],
            d["n_tokens"],
            sample,
            want,
            tuple(draft),
            ids=tuple(ids),
            output_from=out_from,
            prompt_logprobs=plp,
            prefix=prefix,
            blocks=tuple(blocks),
            snap=snap,
            history=tuple(history),
        )


def _same_value(a: Any, b: Any) -> bool:
    """Equal and of the same types throughout (1 == True == 1.0 in Python, but the wire check refuses a bool
    for a number: a map equal only that way must be parsed, not take the previous segment's parse)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(v, b[k]) for k, v in a.items())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return a == b


MAX_KEY = 64  # characters of a prefix block key (p2pk3/node/prefix_match.py makes 32)


def _is_key(v: Any) -> bool:
    return isinstance(v, str) and 0 < len(v) <= MAX_KEY


def _segments(segs: Iterable[Segment]) -> list[dict[str, Any]]:
    out = [s.to_wire() for s in segs]
    if not out:
        raise ValueError("a batch needs at least one segment")
    return out


def _parse_segments(header: Mapping[str, Any]) -> list[Segment]:
    segs = header.get("segments")
    if not isinstance(segs, list) or not segs:
        raise ProtocolError(f"{header.get('kind')} frame: 'segments' must be a non-empty list")
    out: list[Segment] = []
    for i, s in enumerate(segs):
        out.append(Segment.from_wire(s, f"segment {i}", out[-1] if out else None))
    return out


def _shape_of(t: Any) -> tuple[int, ...]:
    return tuple(t[1]) if isinstance(t, tuple) else tuple(t.shape)


# ------------------------------------------------------------------------------------------- forward
def forward_frame(
    segments: Iterable[Segment],
    prefix: Any,
    bank: Any = None,
    partial_latent: Any = None,
    *,
    layer: int,
    mid_moe: bool = False,
) -> Frame:
    """A stage-boundary hop: `prefix` [N, D], `bank` [R, N, D] (AttnRes snapshots; None when R = 0),
    `partial_latent` [N, W] (only when `mid_moe`: the hop is inside layer `layer`'s MoE, split over slots).
    `layer`: the first layer the receiver runs (or continues, when mid_moe). Tensors are numpy arrays
    or (dtype, shape, buffer) tuples (bf16 from torch: ("bfloat16", t.shape, t.view(torch.uint8).numpy()))."""
    segs = _segments(segments)
    n = sum(s["n_tokens"] for s in segs)
    ps = _shape_of(prefix)
    if len(ps) != 2 or ps[0] != n:
        raise ValueError(f"prefix shape {list(ps)} must be [N={n}, D]")
    tensors: list[tuple[str, Any]] = [("prefix", prefix)]
    if bank is not None:
        bs = _shape_of(bank)
        if len(bs) != 3 or bs[1:] != ps:
            raise ValueError(f"bank shape {list(bs)} must be [R, {n}, {ps[1]}]")
        tensors.append(("bank", bank))
    if mid_moe != (partial_latent is not None):
        raise ValueError("partial_latent is sent exactly when mid_moe is set")
    if partial_latent is not None:
        ls = _shape_of(partial_latent)
        if len(ls) != 2 or ls[0] != n:
            raise ValueError(f"partial_latent shape {list(ls)} must be [N={n}, W]")
        tensors.append(("partial_latent", partial_latent))
    return Frame.make("forward", tensors, segments=segs, layer=int(layer), mid_moe=bool(mid_moe))


@dataclass
class Forward:
    """A parsed `forward` frame (tensors stay in the frame: `frame.buffer(name)`)."""

    segments: list[Segment]
    layer: int
    mid_moe: bool
    n_tokens: int
    hidden: int
    bank_rows: int
    frame: Frame


def parse_forward(frame: Frame) -> Forward:
    h = expect(frame, "forward")
    segs = _parse_segments(h)
    layer, mid = h.get("layer"), h.get("mid_moe", False)
    if not is_int(layer) or layer < 0:
        raise ProtocolError(f"forward frame: bad layer {layer!r}")
    if not isinstance(mid, bool):
        raise ProtocolError("forward frame: mid_moe must be a bool")
    n = sum(s.n_tokens for s in segs)
    if not frame.has("prefix"):
        raise ProtocolError("forward frame has no 'prefix' tensor")
    p = frame.desc("prefix")
    if len(p["shape"]) != 2 or p["shape"][0] != n:
        raise ProtocolError(f"forward frame: prefix shape {p['shape']} does not match the {n} tokens of its segments")
    rows = 0
    if frame.has("bank"):
        b = frame.desc("bank")
        if len(b["shape"]) != 3 or b["shape"][1:] != p["shape"] or b["dtype"] != p["dtype"]:
            raise ProtocolError(
                f"forward frame: bank {b['dtype']}{b['shape']} does not match prefix {p['dtype']}{p['shape']}"
            )
        rows = b["shape"][0]
    if mid != frame.has("partial_latent"):
        raise ProtocolError("forward frame: partial_latent must be present exactly when mid_moe is set")
    if mid:
        q = frame.desc("partial_latent")
        if len(q["shape"]) != 2 or q["shape"][0] != n:
            raise ProtocolError(f"forward frame: partial_latent shape {q['shape']} must be [{n}, W]")
    extra = set(frame.names()) - {"prefix", "bank", "partial_latent"}
    if extra:
        raise ProtocolError(f"forward frame: unexpected tensors {sorted(extra)}")
    return Forward(segs, layer, mid, n, p["shape"][1], rows, frame)


# -------------------------------------------------------------------------------------------- result
@dataclass
class Result:
    """What the last stage says about one segment: the sampled `token` at position `pos` (the segment's
    end), or `skip` (a non-final prefill chunk: nothing sampled), or `rows` logits rows in the frame's
    `logits` tensor (scoring), or `error` with its `code` (the session failed on some stage; the entry
    ends it).

    For a segment with a draft: `accepted` are the drafted tokens the target accepted (the longest prefix
    it would have produced itself), `token` the one it produced after them (at the first mismatch, or
    after all k), at position `pos`; the session continues with accepted + [token].

    `logprobs` (when the sampling parameters ask for them): one entry per token of `tokens`, in order.
    `prompt_logprobs` (when the segment asked): entries for the prompt tokens at positions `prompt_from`,
    `prompt_from` + 1, ... that the segment's rows predict. Only these small entries travel, never rows."""

    session: str | int
    epoch: int
    pos: int
    token: int = 0
    skip: bool = False
    rows: int = 0
    error: str | None = None
    code: str | None = None  # with error: an ErrorCode (busy: the stage's cache is full)
    accepted: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    prompt_from: int = 0

    @property
    def tokens(self) -> list[int]:
        """The tokens this result adds to the session, in order."""
        return [*self.accepted, self.token]

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"session": self.session, "epoch": self.epoch, "pos": self.pos, "token": self.token}
        if self.accepted:
            d["accepted"] = [int(t) for t in self.accepted]
        if self.skip:
            d["skip"] = True
        if self.rows:
            d["rows"] = self.rows
        if self.error is not None:
            d["error"] = self.error
            d["code"] = self.code or ErrorCode.FAILED
        if self.logprobs:
            d["logprobs"] = [e.to_wire() for e in self.logprobs]
        if self.prompt_logprobs:
            d["prompt_logprobs"] = [e.to_wire() for e in self.prompt_logprobs]
            d["prompt_from"] = int(self.prompt_from)
        return d

    @classmethod
    def from_wire(cls, r: Any, where: str) -> "Result":
        if not isinstance(r, dict):
            raise ProtocolError(f"{where}: not a map")
        check_session(r.get("session"), where)
        for k in ("epoch", "pos", "token"):
            if not is_int(r.get(k)) or r[k] < 0:
                raise ProtocolError(f"{where}: {k} must be a non-negative integer, got {r.get(k)!r}")
        skip, rows, err = r.get("skip", False), r.get("rows", 0), r.get("error")
        if not isinstance(skip, bool):
            raise ProtocolError(f"{where}: skip must be a bool")
        if not is_int(rows) or rows < 0:
            raise ProtocolError(f"{where}: rows must be a non-negative integer")
        code = r.get("code")
        if err is not None and not isinstance(err, str):
            raise ProtocolError(f"{where}: error must be a string")
        if code is not None and not isinstance(code, str):
            raise ProtocolError(f"{where}: code must be a string")
        acc = r.get("accepted", [])
        if not isinstance(acc, list) or len(acc) > MAX_DRAFT or not all(is_int(t) and t >= 0 for t in acc):
            raise ProtocolError(f"{where}: accepted must be a list of at most {MAX_DRAFT} non-negative token ids")
        lps = logprob_list(r.get("logprobs", []), f"{where}: logprobs", MAX_DRAFT + 1)
        if lps and len(lps) != len(acc) + 1:
            raise ProtocolError(f"{where}: {len(lps)} logprob entries for {len(acc) + 1} tokens")
        plps = logprob_list(r.get("prompt_logprobs", []), f"{where}: prompt_logprobs", 1 << 20)
        pfrom = r.get("prompt_from", 0)
        if not is_int(pfrom) or pfrom < 0:
            raise ProtocolError(f"{where}: prompt_from must be a non-negative integer, got {pfrom!r}")
        return cls(r["session"], r["epoch"], r["pos"], r["token"], skip, rows, err, code, tuple(acc), lps, plps, pfrom)


def result_frame(results: Iterable[Result], logits: Any = None) -> Frame:
    """Results leaving the last slot (or an error report from any slot); optional `logits` float32
    [sum of rows, V] when segments asked for them."""
    rs = [r.to_wire() for r in results]
    tensors = [("logits", logits)] if logits is not None else None
    return Frame.make("result", tensors, results=rs)


def parse_result(frame: Frame) -> list[Result]:
    h = expect(frame, "result")
    rs = h.get("results")
    if not isinstance(rs, list):
        raise ProtocolError("result frame: 'results' must be a list")
    out = [Result.from_wire(r, f"result {i}") for i, r in enumerate(rs)]
    rows = sum(r.rows for r in out)
    if rows:
        if not frame.has("logits"):
            raise ProtocolError(f"result frame: {rows} logits rows announced but no 'logits' tensor")
        shape = frame.desc("logits")["shape"]
        if len(shape) != 2 or shape[0] != rows:
            raise ProtocolError(f"result frame: logits shape {shape} must be [{rows}, V]")
    if frame.has("logits") and frame.desc("logits")["dtype"] != "float32":
        # checked here, not only where the logits are used: a stage relays results to the entry
        raise ProtocolError(f"result frame: logits must be float32, not {frame.desc('logits')['dtype']}")
    return out


# ---------------------------------------------------------------------------------------------- free
def free_frame(
    sessions: Iterable[tuple[str | int, int]], origin: str = "", keep: Mapping[str, Keep] | None = None
) -> Frame:
    """`keep` (prefix cache): for some of the sessions, what the stages register before freeing them."""
    ss = []
    for sid, epoch in sessions:
        check_session(sid, "free")
        ss.append({"session": sid, "epoch": int(epoch)})
    extra = {"keep": [k.to_wire(sid) for sid, k in keep.items()]} if keep else {}
    return Frame.make("free", sessions=ss, origin=origin, **extra)


@dataclass(frozen=True)
class Keep:
    """A finished session's generated part, for the prefix cache: the keys of the block boundaries in
    (start, start + n] and of the point start + n (the tokens the stages hold of it), registered before
    the session is freed."""

    start: int
    n: int
    blocks: tuple[str, ...]
    snap: str

    def to_wire(self, session) -> dict[str, Any]:
        return {"session": session, "start": self.start, "n": self.n, "blocks": list(self.blocks), "snap": self.snap}


def parse_free_keep(frame: Frame) -> dict[str, Keep]:
    """session id (as a string) -> Keep, from a `free` frame's optional `keep` list."""
    ks = expect(frame, "free").get("keep", [])
    if not isinstance(ks, list):
        raise ProtocolError("free frame: keep must be a list")
    out = {}
    for k in ks:
        if not isinstance(k, dict):
            raise ProtocolError("free frame: each keep entry is a map")
        check_session(k.get("session"), "free: keep")
        start, n, blocks, snap = k.get("start"), k.get("n"), k.get("blocks"), k.get("snap")
        if not (is_int(start) and start >= 0 and is_int(n) and n > 0):
            raise ProtocolError("free frame: keep needs start >= 0 and n > 0")
        if not isinstance(blocks, list) or len(blocks) > n or not all(_is_key(b) for b in blocks) or not _is_key(snap):
            raise ProtocolError("free frame: keep needs blocks (at most n keys) and a snap key")
        out[str(k["session"])] = Keep(start, n, tuple(blocks), snap)
    return out


def parse_free(frame: Frame) -> tuple[list[tuple[str | int, int]], str]:
    """(sessions as (id, epoch), origin node id)."""
    h = expect(frame, "free")
    ss = h.get("sessions")
    if not isinstance(ss, list):
        raise ProtocolError("free frame: 'sessions' must be a list")
    out = []
    for s in ss:
        if not isinstance(s, dict) or not is_int(s.get("epoch")):
            raise ProtocolError("free frame: each session needs 'session' and an integer 'epoch'")
        check_session(s.get("session"), "free")
        out.append((s["session"], s["epoch"]))
    origin = h.get("origin", "")
    if not isinstance(origin, str):
        raise ProtocolError("free frame: origin must be a string")
    return out, origin


# --------------------------------------------------------------------------------------- ping / pong
def ping_frame(ping_id: int, t_ns: int) -> Frame:
    return Frame.make("ping", id=int(ping_id), t_ns=int(t_ns))


def _echo(v: Any) -> Any:
    """A ping field echoed in the pong: only plain numbers and short strings (a ping may carry up to a
    header's worth of anything; its pong must not grow past the header limit or echo structures)."""
    if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and -(2**63) <= v < 2**64):
        return v
    if isinstance(v, (str, bytes)) and len(v) <= 256:
        return v
    return None


def pong_frame(ping: Frame, **stats: Any) -> Frame:
    return Frame.make("pong", id=_echo(ping.header.get("id")), t_ns=_echo(ping.header.get("t_ns")), **stats)


def parse_pong(frame: Frame) -> dict[str, Any]:
    """A pong -> its fields (the echoed `id` and `t_ns`, and the node's heartbeat statistics: slot, role,
    epoch, ...). ProtocolError for another kind, or an echoed id that is not the integer a ping sends."""
    h = expect(frame, "pong")
    if h.get("id") is not None and not is_int(h.get("id")):
        raise ProtocolError(f"pong frame: id must be the ping's integer id, got {h.get('id')!r}")
    return dict(h)


# ------------------------------------------------------------------------------------ prefix report
MAX_REPORT = 8192  # points in one report (a report of more is sent as several)


@dataclass
class PrefixReport:
    """What a stage's prefix cache can resume at now, as changes since its last report (stage -> entry).
    `reset`: forget everything reported before (a cache that starts empty: a new holder of the slot);
    `stateless`: the stage holds no attention layer and can start a session anywhere."""

    slot: str
    holder: str
    added: list[tuple[str, int]]
    evicted: list[str]
    reset: bool = False
    stateless: bool = False


def prefix_report_frame(r: PrefixReport) -> Frame:
    return Frame.make(
        "prefix_report",
        slot=r.slot,
        holder=r.holder,
        added=[[k, int(p)] for k, p in r.added],
        evicted=list(r.evicted),
        reset=bool(r.reset),
        stateless=bool(r.stateless),
    )


def parse_prefix_report(frame: Frame) -> PrefixReport:
    h = expect(frame, "prefix_report")
    slot, holder = name(h.get("slot"), "prefix_report: slot"), name(h.get("holder"), "prefix_report: holder")
    added, evicted = h.get("added", []), h.get("evicted", [])
    if not isinstance(added, list) or len(added) > MAX_REPORT:
        raise ProtocolError(f"prefix_report: added must be a list of at most {MAX_REPORT} [key, position]")
    for a in added:
        if not (isinstance(a, list) and len(a) == 2 and _is_key(a[0]) and is_int(a[1]) and a[1] > 0):
            raise ProtocolError(f"prefix_report: each added point is [key, position > 0], got {a!r:.60}")
    if not isinstance(evicted, list) or len(evicted) > MAX_REPORT or not all(_is_key(k) for k in evicted):
        raise ProtocolError(f"prefix_report: evicted must be a list of at most {MAX_REPORT} keys")
    reset, stateless = h.get("reset", False), h.get("stateless", False)
    if not isinstance(reset, bool) or not isinstance(stateless, bool):
        raise ProtocolError("prefix_report: reset and stateless must be bools")
    return PrefixReport(slot, holder, [(k, p) for k, p in added], list(evicted), reset, stateless)

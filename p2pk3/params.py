"""`SamplingParams`: what a request asks of the sampler — the one schema shared by the engine (which
samples), the wire protocol (which carries it in `generate` requests and in the segment that the last
stage samples) and the front ends. Plain Python: no torch, no network."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

# wire field -> accepted Python types (bool is never accepted as a number)
_FIELDS: dict[str, tuple[type, ...]] = {
    "temperature": (int, float),
    "top_k": (int,),
    "top_p": (int, float),
    "seed": (int, type(None)),
    "max_tokens": (int,),
    "stop_ids": (list, tuple),
    "speculate": (str,),
    "draft_tokens": (int,),
}
MAX_STOP_IDS = 64
# Speculative decoding (p2pk3/spec): how the entry drafts tokens that the ring verifies in one pass. It never
# changes the output (greedy and seeded sampling give the same tokens with and without it), only the speed.
SPEC_METHODS = ("off", "ngram", "suffix")
MAX_DRAFT = 16  # drafted tokens per pass at most (wire limit of a segment's `draft`)
DEFAULT_DRAFT = 8
# Front-end limits and defaults (CLI and API alike; p2pk3/frontends/prompt.py). The engine samples at any
# temperature >= 0; the front ends accept what OpenAI's API accepts.
MAX_TEMPERATURE = 2.0
MAX_SEED = (1 << 63) - 1
DEFAULT_MAX_TOKENS = 64  # generated tokens when neither the user nor the checkpoint's generation_config says


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None with temperature > 0: the entry draws one
    max_tokens: int = DEFAULT_MAX_TOKENS  # generated tokens
    stop_ids: tuple[int, ...] = ()
    speculate: str = "off"  # draft proposer at the entry: off | ngram (prompt lookup) | suffix (+ cluster index)
    draft_tokens: int = DEFAULT_DRAFT  # most drafted tokens per pass (the entry adapts below it, 0 included)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop ids, got {len(self.stop_ids)}")
        if self.speculate not in SPEC_METHODS:
            raise ValueError(f"speculate must be one of {', '.join(SPEC_METHODS)}, got {self.speculate!r}")
        if not 0 <= self.draft_tokens <= MAX_DRAFT:
            raise ValueError(f"draft_tokens must be in 0..{MAX_DRAFT}, got {self.draft_tokens}")
        object.__setattr__(self, "stop_ids", tuple(int(t) for t in self.stop_ids))

    @property
    def speculating(self) -> bool:
        return self.speculate != "off" and self.draft_tokens > 0

    def sampler(self) -> "SamplingParams":
        """What the sampler needs (the speculation options dropped): the map a segment carries."""
        return (
            self
            if self.speculate == "off" and self.draft_tokens == DEFAULT_DRAFT
            else replace(self, speculate="off", draft_tokens=DEFAULT_DRAFT)
        )

    def with_seed(self, seed: int) -> "SamplingParams":
        return replace(self, seed=seed)

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        d["stop_ids"] = list(self.stop_ids)
        if self.speculate == "off":  # the wire stays as it was without speculation
            del d["speculate"]
            if self.draft_tokens == DEFAULT_DRAFT:
                del d["draft_tokens"]
        return d

    @classmethod
    def from_wire(cls, d: Any) -> "SamplingParams":
        """Parse a wire map; raises ValueError naming the field on a wrong type, value or unknown key."""
        if not isinstance(d, dict):
            raise ValueError(f"sampling parameters must be a map, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; known: {sorted(_FIELDS)}")
        for k, v in d.items():
            types = _FIELDS[k]
            if isinstance(v, bool) or not isinstance(v, types):
                raise ValueError(f"sampling parameter {k!r} has the wrong type ({type(v).__name__})")
        stops = d.get("stop_ids", ())
        if len(stops) > MAX_STOP_IDS or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stops
        ):
            raise ValueError(f"stop_ids must be at most {MAX_STOP_IDS} non-negative integers")
        kw = {k: v for k, v in d.items() if k != "stop_ids"}
        return cls(**kw, stop_ids=tuple(stops))

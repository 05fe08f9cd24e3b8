"""How `n` pipeline stages share `n_layers` whole layers: the one definition used by the in-process
pipeline (`score --stages`), the topology builders (`topology init`, `local --nodes`) and the planner."""

from __future__ import annotations


def even_layer_ranges(n_layers: int, n: int) -> list[range]:
    """`n` contiguous ranges covering 0..n_layers-1 in order; sizes differ by at most one, the larger
    ones first (61 layers over 4 stages: 16, 15, 15, 15)."""
    if n < 1:
        raise ValueError(f"need at least one stage, got {n}")
    if n > n_layers:
        raise ValueError(f"{n} stages but only {n_layers} layers: every stage needs at least one whole layer")
    q, r = divmod(n_layers, n)
    out, a = [], 0
    for i in range(n):
        size = q + (1 if i < r else 0)
        out.append(range(a, a + size))
        a += size
    return out

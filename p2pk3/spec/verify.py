"""Acceptance of drafted tokens on the last stage.

The segment's tokens are [t, d1 .. dk] at positions p .. p+k; logits row i predicts position p+i+1. Draft
token d_{i+1} is accepted exactly when it equals the token plain decoding draws there,
`sample_at(row i, params, p+i+1)`; the first mismatch is replaced by that token (the bonus), and after k
accepted drafts the bonus is drawn from row k. Greedy: argmax. With temperature > 0 the random stream is a
function of (seed, position), so each accepted token and the bonus are what plain sampling gives at that
position: the same seed gives the same text with and without speculation, and the output distribution is
the target's (the draft only decides how many positions one pass settles)."""

from __future__ import annotations

import torch

from p2pk3.engine.sampling import sample_at
from p2pk3.params import SamplingParams


def verify_draft(
    logits: torch.Tensor, draft: list[int] | tuple[int, ...], params: SamplingParams, start: int
) -> tuple[list[int], int]:
    """logits [k+1, V] of positions start .. start+k -> (accepted drafts, the token after them)."""
    k = len(draft)
    if logits.shape[0] != k + 1:
        raise ValueError(f"{k} drafted tokens need {k + 1} logits rows, got {logits.shape[0]}")
    if params.temperature == 0:
        best = torch.argmax(logits.detach().float(), -1).tolist()  # one call for every row
        for i, d in enumerate(draft):
            if best[i] != d:
                return list(draft[:i]), int(best[i])
        return list(draft), int(best[k])
    for i, d in enumerate(draft):
        y = sample_at(logits[i], params, start + i + 1)
        if y != d:
            return list(draft[:i]), y
    return list(draft), sample_at(logits[k], params, start + k + 1)

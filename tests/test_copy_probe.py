"""tools/copy_probe.py's score against plainly written predictors: one that copies perfectly from its context,
one that never looks back. And tools/train_docs.py's copy-task rows (`repeated`)."""

from __future__ import annotations

import random

import torch

from tools.copy_probe import copy_accuracy
from tools.train_docs import repeated


def copier(seq: list[int]) -> list[int]:
    """Next token = the one that followed the last earlier occurrence of the current token (-1: none)."""
    out = []
    for t, x in enumerate(seq):
        prev = [s for s in range(t) if seq[s] == x]
        out.append(seq[prev[-1] + 1] if prev else -1)
    return out


def passages(n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    return [rng.sample(range(1000), length) for _ in range(n)]  # distinct tokens: nothing repeats in one copy


def test_a_perfect_copier_scores_one_on_the_second_copy_and_nothing_on_the_first():
    assert copy_accuracy(copier, passages(5, 12)) == (0.0, 1.0)


def test_a_predictor_that_never_looks_back_scores_the_two_copies_alike():
    bigram = {}  # a fixed next-token table learnt from other text: the same guess in both copies
    rng = random.Random(1)
    for p in passages(5, 12):
        for a, b in zip(p, p[1:]):
            bigram[a] = b if rng.random() < 0.5 else -1
    first, second = copy_accuracy(lambda seq: [bigram.get(x, -1) for x in seq], passages(5, 12))
    assert 0.2 < first < 0.8 and first == second


def test_a_copy_task_row_is_its_first_half_written_again_at_the_same_length():
    for n in (257, 256, 9):
        row = torch.arange(100, 100 + n)
        out = repeated(row)
        half = (n + 1) // 2
        assert len(out) == n
        assert out[:half].tolist() == list(range(100, 100 + half))
        assert out[half:].tolist() == list(range(100, 100 + n - half))

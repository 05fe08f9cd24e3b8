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


def _small_k3(variant: str = "train"):
    from p2pk3.model.stage import K3Stage, StagePlan
    from tools.trainlib.model import init_stage, tiny_config

    cfg = tiny_config(128, 0, 1, 2, hidden=64, layers=5, kda_heads=2, kda_dim=32, experts=4, topk=2, moe_inter=32)
    stage = K3Stage(cfg, StagePlan.whole(cfg))
    init_stage(stage, 0, variant)
    return stage


def test_the_init_variants_change_only_what_they_name():
    """tools/trainlib INIT_VARIANTS (`copy_probe --learn --init`, `train_docs --fresh-init`): each changes its
    own tensors, to the stated scale, and nothing else; the decay of `kda-slow` is recomputed here from K3's
    gate (g = lb * sigmoid(A * (a + dt_bias)), a = 0 at the start)."""
    import math

    import pytest

    from tools.trainlib.model import INIT_VARIANTS

    base = {n: p.detach().clone() for n, p in _small_k3().named_parameters()}
    cases = (
        ("train", ()),
        ("mla-fanin", ("q_b_proj.weight", "kv_b_proj.weight")),
        ("mla-q-fanin", (".q_b_proj.weight",)),
        ("mla-kv-fanin", ("kv_b_proj.weight",)),
        ("qk-fanin", ("q_b_proj.weight", "kv_b_proj.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight")),
        ("kda-slow", ("dt_bias",)),
    )
    assert {name for name, _ in cases} == set(INIT_VARIANTS)  # every variant is checked here
    for name, changed in cases:
        stage = _small_k3(name)
        for n, p in stage.named_parameters():
            if not n.endswith(changed) or not changed:
                assert torch.equal(p, base[n]), f"{name} changed {n}"
                continue
            assert not torch.equal(p, base[n]), f"{name} left {n} as it was"
            if n.endswith("weight"):  # N(0, 1 / fan_in): the sample's std within 10 %
                assert abs(p.std().item() * math.sqrt(p.shape[1]) - 1) < 0.1, n
            else:  # the per-token decay exp(g) lies in [exp(-0.1), exp(-0.001)]
                attn = stage.get_submodule(n.rsplit(".", 1)[0])
                A = attn.A_log[: attn.H].exp().repeat_interleave(attn.K)
                decay = torch.exp(stage.cfg.kda_gate_lower_bound * torch.sigmoid(A * p))
                assert decay.min() >= math.exp(-0.1) - 1e-6 and decay.max() <= math.exp(-0.001) + 1e-6, n
                rate = -decay.log()  # log-uniform over the range: its ends are reached within a factor of 2
                assert rate.max() > 0.05 and rate.min() < 0.002, n
    with pytest.raises(ValueError, match="unknown init variant 'mla'; one of train, "):
        _small_k3("mla")


def test_a_redraw_replaces_the_variants_tensors_of_a_trained_stage_and_keeps_the_rest():
    """`train_docs --redraw mla-fanin`: a warm start's MLA up-projections drawn at 1/fan_in, nothing else moved."""
    import math

    from tools.trainlib.model import redraw

    stage = _small_k3()
    with torch.no_grad():
        for p in stage.parameters():  # stands in for trained weights: none of them at their start
            p.add_(0.01)
    trained = {n: p.detach().clone() for n, p in stage.named_parameters()}
    names = redraw(stage, "mla-fanin", 0)
    mla = sorted(n for n in trained if n.endswith(("q_b_proj.weight", "kv_b_proj.weight")))
    assert sorted(names) == mla and len(mla) == 4  # two MLA layers x (query, key/value)
    for n, p in stage.named_parameters():
        if n in mla:
            assert abs(p.std().item() * math.sqrt(p.shape[1]) - 1) < 0.1 and abs(p.mean().item()) < 0.05, n
        else:
            assert torch.equal(p, trained[n]), n


def test_mla_scores_are_the_weights_the_layer_attends_with():
    """copy_probe.mla_scores against the layer itself: its weights, applied here to the values, gated and
    projected as spec 3.1 writes it, give the output the model's GatedMLA computed in a forward pass."""
    from p2pk3.model.kimi_k3 import GatedMLA
    from tools.copy_probe import mla_scores
    from tools.trainlib.evaluate import forward_batch

    stage = _small_k3("mla-fanin")  # scores of order one: far from uniform, so a wrong scale or mask shows
    attn = next(m for m in stage.modules() if isinstance(m, GatedMLA))
    seen = {}
    attn.register_forward_hook(lambda m, args, out: seen.update(x=args[0].detach(), out=out.detach()))
    with torch.no_grad():
        forward_batch(stage, torch.randint(3, 128, (1, 20)))
        x, c = seen["x"], stage.cfg
        w = mla_scores(attn, x)  # [H, T, T]
        assert torch.allclose(w.sum(-1), torch.ones(w.shape[:2])) and (w.triu(1) == 0).all()
        ckv = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[:, : c.kv_lora_rank])
        _, w_uv = attn._wkv()
        v = torch.einsum("lr,hdr->hld", ckv, w_uv)
        o = torch.einsum("htl,hld->thd", w, v).reshape(len(x), -1)
        o = o * torch.sigmoid(attn.g_proj(x))
        assert torch.allclose(attn.o_proj(o), seen["out"], atol=1e-5)


def test_the_attention_profile_reads_an_induction_head_and_a_uniform_one(monkeypatch):
    """attention_profile's bookkeeping on weights written here: one layer attends exactly to the token to
    copy (entropy 0, weight 1), another uniformly over its keys (entropy 1, weight = 1 / keys)."""
    import math

    import tools.copy_probe as cp
    from p2pk3.model.kimi_k3 import GatedMLA

    stage = _small_k3()
    first = min(m.layer_idx for m in stage.modules() if isinstance(m, GatedMLA))

    def written(attn, x):
        T, n = len(x), len(x) // 2
        w = torch.tril(torch.ones(T, T))
        if attn.layer_idx == first:  # induction: the token after the query's earlier occurrence
            w = torch.zeros(T, T)
            for t in range(T):
                w[t, t - n + 1 if t >= n else 0] = 1.0
        return (w / w.sum(-1, keepdim=True)).expand(attn.H, T, T)

    monkeypatch.setattr(cp, "mla_scores", written)
    rng = random.Random(2)
    prof = cp.attention_profile(stage, [rng.sample(range(3, 128), 10) for _ in range(3)])
    n = 10
    uniform = sum(1 / (t + 1) for t in range(n, 2 * n - 1)) / (n - 1)
    ent, on_copy, uni = prof[first]
    assert ent == 0.0 and on_copy == 1.0 and math.isclose(uni, uniform)
    for k, (ent, on_copy, uni) in prof.items():
        if k != first:
            assert math.isclose(ent, 1.0, rel_tol=1e-5) and math.isclose(on_copy, uniform, rel_tol=1e-5)
            assert math.isclose(uni, uniform)


def test_first_tokens_of_a_prefix_are_those_of_the_whole_text():
    """The probe encodes only a prefix of each document; its first n tokens must be the whole document's,
    checked against encoding the whole text with the shipped tokenizer, on prose, code, long runs of one
    punctuation mark or of spaces across the cut (a long run of spaces is ~31 characters a token, so the first prefix
    can be too short), and texts shorter than n tokens."""
    from p2pk3.tokenizer import load_tokenizer
    from tools.copy_probe import first_tokens

    tok = load_tokenizer("p2pk3/assets/k3-docs")
    rng = random.Random(1)
    words = "the file descriptor returns a value os.path.join(a, b) -> None\n    def f(x):\n".split(" ")
    texts = []
    for i in range(30):
        parts = [rng.choice(words) for _ in range(rng.randrange(5, 400))]
        if i % 3 == 0:
            parts.insert(rng.randrange(len(parts)), "=" * rng.randrange(50, 900))
        if i % 4 == 0:
            parts.insert(rng.randrange(len(parts)), " " * rng.randrange(50, 900))
        texts.append(" ".join(parts))
    texts += [" " * 3000 + "the end of it " * 50, "word " * 40 + " " * 5000 + "x = 1\n" * 60]  # ~31 spaces a token
    for text in texts:
        whole = tok.encode(text)
        for n in (8, 64, 128):
            assert first_tokens(tok, text, n)[:n] == whole[:n]
            assert len(first_tokens(tok, text, n)) >= min(n, len(whole))

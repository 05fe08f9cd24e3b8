"""How much a model copies from its context: next-token accuracy on the first and the second copy of a
held-out passage written twice. A model that copies predicts the second copy far better than the first;
one that does not scores the two alike. The skill every open answer figure of the demo model waits on
(issue 27: the asked name in the answer and in a tool call) is this copy; docs/quality.md has the figures.

    python -m tools.copy_probe MODEL_OR_CKPT [MORE ...] [--corpus runs/corpus] [--passages 24] [--tokens 64]
    python -m tools.copy_probe --learn 1500      # how fast a fresh small K3 learns to copy, beside a plain
                                                 # torch.nn transformer on the same task (minutes per 100 steps)
    python -m tools.copy_probe --learn 600 --init mla-fanin --no-oracle   # from another start (INIT_VARIANTS)
    python -m tools.copy_probe --learn 800 --vocab 4064 --copy-vocab 128   # a curriculum's first ids
    python -m tools.copy_probe runs/NAME/ckpt.pt --random-ids 128   # random ids, as train_docs --copy-vocab

MODEL_OR_CKPT: an exported model folder (p2pk3/assets/k3-docs) or a training run's checkpoint
(runs/NAME/ckpt.pt, master.pt; its tokenizer is the run's)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tools.trainlib.model import INIT_VARIANTS


def random_passages(tok, corpus: str | None, count: int, tokens: int, ids: int, seed: int = 0) -> list[list[int]]:
    """`count` passages of `tokens` random ids: from the train text's `ids` most frequent ones (train_docs
    `copy_pool`, the ids `--copy-vocab` trains the copy on), or from every non-special id (`ids` 0). Random ids
    leave copying the only way to predict a second copy (a first copy is at chance)."""
    from tools import doc_corpus
    from tools.train_docs import copy_pool, encode_stream

    high = min(tok.special.values())
    if ids:
        train = doc_corpus.split_documents(doc_corpus.load_documents(corpus))["train"]
        pool = copy_pool(torch.tensor(encode_stream(tok, train)), high, ids)
    else:
        pool = torch.arange(high)
    gen = torch.Generator().manual_seed(seed)
    return [pool[torch.randint(0, len(pool), (tokens,), generator=gen)].tolist() for _ in range(count)]


def copy_accuracy(predict: Callable[[list[int]], list[int]], passages: Sequence[list[int]]) -> tuple[float, float]:
    """(first copy, second copy) mean next-token accuracy. `predict(seq)[t]` is the model's next token after
    seq[: t + 1]. Each passage p is scored as p + p: the first copy on its own tokens 1..n-1, the second on
    its tokens 1..n-1 again (the first token of each copy is not scored: nothing before it predicts it)."""
    first = second = 0.0
    for p in passages:
        n = len(p)
        seq = list(p) + list(p)
        pred = predict(seq)
        first += sum(pred[t] == seq[t + 1] for t in range(n - 1)) / (n - 1)
        second += sum(pred[t] == seq[t + 1] for t in range(n, 2 * n - 1)) / (n - 1)
    return first / len(passages), second / len(passages)


def load(src: str | Path):
    """(stage in eval mode, tokenizer) from an export folder or a run's ckpt.pt / master.pt."""
    from p2pk3.model.config import K3Config
    from p2pk3.model.stage import K3Stage, StagePlan
    from p2pk3.tokenizer import load_tokenizer
    from tools.trainlib.evaluate import load_shipped
    from tools.trainlib.model import init_stage

    src = Path(src)
    if src.suffix != ".pt":
        return load_shipped(src).eval(), load_tokenizer(src)
    ck = torch.load(src, weights_only=False)
    cfg = K3Config.from_hf_dict(ck["config"])
    stage = K3Stage(cfg, StagePlan.whole(cfg))
    init_stage(stage, 0)  # the training layout (float master experts), then the run's weights
    stage.load_state_dict(ck["stage"])
    return stage.eval(), load_tokenizer(src.parent / "tokenizer")


def heldout_passages(tok, corpus: str | None, count: int, tokens: int) -> list[list[int]]:
    """The first `tokens` tokens of the first `count` held-out documents (tools/doc_corpus splits)."""
    from tools import doc_corpus

    docs = doc_corpus.load_documents(corpus)
    held = doc_corpus.split_documents(docs)["heldout"]
    out = []
    for k in sorted(held):
        ids = first_tokens(tok, held[k], tokens)
        if len(ids) >= tokens:
            out.append(ids[:tokens])
        if len(out) == count:
            break
    if not out:
        raise SystemExit(f"no held-out document has {tokens} tokens: lower --tokens")
    return out


def first_tokens(tok, text: str, n: int, margin: int = 16) -> list[int]:
    """The tokens of `text` up to the n-th, encoding only a prefix of it: a prefix's encoding agrees with the
    whole text's except in its last pre-token (byte-level BPE merges never cross one), so a prefix that yields
    n + `margin` tokens gives the first n exactly; else the prefix is doubled (at most the whole text)."""
    cut = 8 * (n + margin)
    while True:
        ids = tok.encode(text[:cut])
        if cut >= len(text) or len(ids) >= n + margin:
            return ids[: n + margin] if cut < len(text) else ids
        cut *= 2


def stage_predictor(stage) -> Callable[[list[int]], list[int]]:
    from tools.trainlib.evaluate import forward_batch

    @torch.inference_mode()
    def predict(seq: list[int]) -> list[int]:
        return forward_batch(stage, torch.tensor([seq])).argmax(-1).tolist()

    return predict


def mla_scores(attn, x: torch.Tensor) -> torch.Tensor:
    """One GatedMLA layer's attention weights [H, T, T] for x [T, D], one causal sequence, written out here
    from its weights as spec 3.1's expanded form (the model's own `_naive` with the cache taken out)."""
    c = attn.cfg
    dn, R = c.qk_nope_head_dim, c.kv_lora_rank
    q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(len(x), attn.H, c.q_head_dim)
    kv = attn.kv_a_proj_with_mqa(x)
    ckv, k_pe = attn.kv_a_layernorm(kv[:, :R]), kv[:, R:]
    w_uk, _ = attn._wkv()
    k_nope = torch.einsum("lr,hdr->hld", ckv, w_uk)
    sc = torch.einsum("thd,hld->htl", q[..., :dn], k_nope) + torch.einsum("thd,ld->htl", q[..., dn:], k_pe)
    sc = sc.float() * c.q_head_dim**-0.5
    mask = torch.ones(len(x), len(x), dtype=torch.bool).triu(1)
    return torch.softmax(sc.masked_fill(mask, -float("inf")), -1)


@torch.inference_mode()
def attention_profile(stage, passages: Sequence[list[int]]) -> dict[int, tuple[float, float, float]]:
    """Per MLA layer, over the passages written twice (each run alone): (entropy of a second-copy query's
    weights / log of its key count: 1.0 is uniform; the weight it puts on the token to copy, the one after
    its earlier occurrence; that weight under uniform attention, 1 / key count), averaged over queries and
    heads. An induction head puts most of its weight there; a near-uniform layer 1 / key count."""
    from p2pk3.model.kimi_k3 import GatedMLA
    from tools.trainlib.evaluate import forward_batch

    inputs: dict[int, torch.Tensor] = {}
    hooks = [
        m.register_forward_pre_hook(lambda m, args: inputs.__setitem__(m.layer_idx, args[0].detach()))
        for m in stage.modules()
        if isinstance(m, GatedMLA)
    ]
    mods = {m.layer_idx: m for m in stage.modules() if isinstance(m, GatedMLA)}
    sums: dict[int, list[float]] = {k: [0.0, 0.0, 0.0] for k in mods}
    count = 0
    try:
        for p in passages:
            n = len(p)
            forward_batch(stage, torch.tensor([list(p) + list(p)]))
            for k, m in mods.items():
                w = mla_scores(m, inputs[k])  # [H, 2n, 2n]
                for t in range(n, 2 * n - 1):  # second-copy queries; the token to copy sits at t - n + 1
                    row = w[:, t, : t + 1]
                    ent = -(row * row.clamp_min(1e-30).log()).sum(-1) / math.log(t + 1)
                    sums[k][0] += ent.mean().item()
                    sums[k][1] += row[:, t - n + 1].mean().item()
                    sums[k][2] += 1 / (t + 1)
            count += n - 1
    finally:
        for h in hooks:
            h.remove()
    return {k: (a / count, b / count, u / count) for k, (a, b, u) in sums.items()}


def plain_transformer(vocab: int, T: int, D: int = 64, layers: int = 2) -> torch.nn.Module:
    """The oracle of `learn`: torch.nn's pre-norm causal transformer with learned positions."""
    nn = torch.nn

    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.pos, self.out = nn.Embedding(vocab, D), nn.Embedding(T, D), nn.Linear(D, vocab)
            layer = nn.TransformerEncoderLayer(D, 4, 4 * D, 0.0, batch_first=True, norm_first=True)
            self.body = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

        def forward(self, x):
            mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            return self.out(self.body(self.emb(x) + self.pos(torch.arange(x.shape[1])), mask=mask, is_causal=True))

    return Plain()


def learn(
    steps: int,
    lr: float,
    every: int = 100,
    vocab: int = 128,
    L: int = 16,
    B: int = 32,
    init: str = "train",
    oracle: bool = True,
    copy_vocab: int | None = None,
) -> dict[str, int | None]:
    """Train a fresh small K3 (tools/trainlib `tiny_config`, hidden 64, 5 layers: 3 KDA + 2 MLA, started as the
    training script starts it with the variant `init` of tools/trainlib INIT_VARIANTS) and, unless `oracle` is
    off, `plain_transformer` side by side on random passages of L tokens written twice; print the loss and the
    second copy's accuracy of both every `every` steps. A copier's loss falls from ln(vocab) towards half of it. Returns, per model, the first
    printed step whose second-copy accuracy is at least 0.5 (None: never). `copy_vocab`: the passages are drawn from
    the first copy_vocab ids only (a curriculum), and each printed step also gives the second copy of a batch
    drawn from the whole vocabulary, not trained on: whether the copy learned on a few ids is a copy of any."""
    import torch.nn.functional as F

    from p2pk3.model.stage import K3Stage, StagePlan
    from p2pk3_kernels import kda_ref
    from tools.trainlib.evaluate import forward_batch
    from tools.trainlib.model import init_stage, tiny_config

    kda_ref.CHUNK = 16
    torch.manual_seed(0)
    cfg = tiny_config(vocab, 0, 1, 2, hidden=64, layers=5, kda_heads=2, kda_dim=32, experts=4, topk=2, moe_inter=32)
    k3 = K3Stage(cfg, StagePlan.whole(cfg))
    init_stage(k3, 0, init)
    models = {f"small K3 ({init})": (k3, lambda x: forward_batch(k3, x).reshape(*x.shape, -1))}
    if oracle:
        models["plain transformer"] = (plain := plain_transformer(vocab, 2 * L), plain)
    opts = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr) for k, (m, _) in models.items()}
    copied: dict[str, int | None] = dict.fromkeys(models)
    for step in range(steps + 1):
        x = torch.randint(3, min(vocab, 3 + copy_vocab) if copy_vocab else vocab, (B, L))
        seq = torch.cat([x, x], 1)
        row = []
        for k, (m, fwd) in models.items():
            m.train()
            lg = fwd(seq[:, :-1])
            loss = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), seq[:, 1:].reshape(-1))
            opts[k].zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            opts[k].step()
            acc = (lg[:, L:].argmax(-1) == seq[:, L + 1 :]).float().mean().item()
            row.append(f"{k}: loss {loss.item():.3f}, second copy {acc:.2f}")
            if copy_vocab and step % every == 0:
                m.eval()
                with torch.no_grad():
                    y = torch.randint(3, vocab, (B, L))
                    ys = torch.cat([y, y], 1)
                    wide = (fwd(ys[:, :-1])[:, L:].argmax(-1) == ys[:, L + 1 :]).float().mean().item()
                row[-1] += f" (all {vocab} ids: {wide:.2f})"
            if step % every == 0 and acc >= 0.5 and copied[k] is None:
                copied[k] = step
        if step % every == 0:
            print(f"step {step:5d}  " + "   ".join(row), flush=True)
    for k, s in copied.items():
        print(f"{k}: second copy >= 0.5 {'from step ' + str(s) if s is not None else f'not within {steps} steps'}")
    return copied


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="export folders or runs/NAME/ckpt.pt")
    ap.add_argument("--learn", type=int, default=0, metavar="STEPS", help="the copy task from scratch (above)")
    ap.add_argument("--lr", type=float, default=1e-3, help="--learn: AdamW learning rate of both models")
    ap.add_argument("--init", choices=sorted(INIT_VARIANTS), default="train", help="--learn: the small K3's start")
    ap.add_argument("--no-oracle", action="store_true", help="--learn: train the small K3 alone")
    ap.add_argument("--vocab", type=int, default=128, help="--learn: the small models' vocabulary")
    ap.add_argument(
        "--copy-vocab", type=int, default=None, help="--learn: passages from the first N ids only (a curriculum)"
    )
    ap.add_argument(
        "--attention", action="store_true", help="also each MLA layer's sharpness and weight on the copied token"
    )
    ap.add_argument("--corpus", default="runs/corpus", help="tools.doc_corpus cache (default runs/corpus)")
    ap.add_argument("--passages", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument(
        "--random-ids",
        type=int,
        default=None,
        metavar="N",
        help="passages of random ids instead of held-out text: from the train text's N most frequent (as "
        "train_docs --copy-vocab N draws them), 0 for every non-special id",
    )
    a = ap.parse_args(argv)
    if a.learn:
        learn(a.learn, a.lr, vocab=a.vocab, init=a.init, oracle=not a.no_oracle, copy_vocab=a.copy_vocab)
    for m in a.models:
        stage, tok = load(m)
        if a.random_ids is None:
            passages = heldout_passages(tok, a.corpus, a.passages, a.tokens)
        else:
            passages = random_passages(tok, a.corpus, a.passages, a.tokens, a.random_ids)
        first, second = copy_accuracy(stage_predictor(stage), passages)
        what = "held-out passage" if a.random_ids is None else f"passage of random ids ({a.random_ids or 'all'})"
        print(
            f"{m}: {what} written twice, next-token accuracy: first copy {first:.2f}, "
            f"second copy {second:.2f} ({second / max(first, 1e-9):.2f}x)"
        )
        if a.attention:
            for k, (ent, on_copy, uniform) in attention_profile(stage, passages).items():
                print(
                    f"   MLA layer {k}: entropy {ent:.2f} of uniform's; weight on the token to copy {on_copy:.3f} "
                    f"({on_copy / uniform:.1f}x uniform's {uniform:.3f})"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How much a model copies from its context: next-token accuracy on the first and the second copy of a
held-out passage written twice. A model that copies predicts the second copy far better than the first;
one that does not scores the two alike. The skill every open answer figure of the demo model waits on
(issue 27: the asked name in the answer and in a tool call) is this copy; docs/quality.md has the figures.

    python -m tools.copy_probe MODEL_OR_CKPT [MORE ...] [--corpus runs/corpus] [--passages 24] [--tokens 64]
    python -m tools.copy_probe --learn 1500      # how fast a fresh small K3 learns to copy, beside a plain
                                                 # torch.nn transformer on the same task (minutes per 100 steps)

MODEL_OR_CKPT: an exported model folder (p2pk3/assets/k3-docs) or a training run's checkpoint
(runs/NAME/ckpt.pt, master.pt; its tokenizer is the run's)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path

import torch


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
    out = [ids[:tokens] for ids in (tok.encode(held[k]) for k in sorted(held)) if len(ids) >= tokens]
    if not out:
        raise SystemExit(f"no held-out document has {tokens} tokens: lower --tokens")
    return out[:count]


def stage_predictor(stage) -> Callable[[list[int]], list[int]]:
    from tools.trainlib.evaluate import forward_batch

    @torch.inference_mode()
    def predict(seq: list[int]) -> list[int]:
        return forward_batch(stage, torch.tensor([seq])).argmax(-1).tolist()

    return predict


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


def learn(steps: int, lr: float, every: int = 100, vocab: int = 128, L: int = 16, B: int = 32) -> None:
    """Train a fresh small K3 (tools/trainlib `tiny_config`, hidden 64, 5 layers: 3 KDA + 2 MLA, as the
    training script initialises it) and `plain_transformer` side by side on random passages of L tokens
    written twice; print the loss and the second copy's accuracy of both every `every` steps. A copier's
    loss falls from ln(vocab) towards half of it."""
    import torch.nn.functional as F

    from p2pk3.model.stage import K3Stage, StagePlan
    from p2pk3_kernels import kda_ref
    from tools.trainlib.evaluate import forward_batch
    from tools.trainlib.model import init_stage, tiny_config

    kda_ref.CHUNK = 16
    torch.manual_seed(0)
    cfg = tiny_config(vocab, 0, 1, 2, hidden=64, layers=5, kda_heads=2, kda_dim=32, experts=4, topk=2, moe_inter=32)
    k3 = K3Stage(cfg, StagePlan.whole(cfg))
    init_stage(k3, 0)
    models = {
        "small K3": (k3, lambda x: forward_batch(k3, x).reshape(*x.shape, -1)),
        "plain transformer": (plain := plain_transformer(vocab, 2 * L), plain),
    }
    opts = {k: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=lr) for k, (m, _) in models.items()}
    for step in range(steps + 1):
        x = torch.randint(3, vocab, (B, L))
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
        if step % every == 0:
            print(f"step {step:5d}  " + "   ".join(row), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="export folders or runs/NAME/ckpt.pt")
    ap.add_argument("--learn", type=int, default=0, metavar="STEPS", help="the copy task from scratch (above)")
    ap.add_argument("--lr", type=float, default=1e-3, help="--learn: AdamW learning rate of both models")
    ap.add_argument("--corpus", default="runs/corpus", help="tools.doc_corpus cache (default runs/corpus)")
    ap.add_argument("--passages", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args(argv)
    if a.learn:
        learn(a.learn, a.lr)
    for m in a.models:
        stage, tok = load(m)
        first, second = copy_accuracy(stage_predictor(stage), heldout_passages(tok, a.corpus, a.passages, a.tokens))
        print(f"{m}: held-out passage written twice, next-token accuracy: first copy {first:.2f}, "
              f"second copy {second:.2f} ({second / max(first, 1e-9):.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

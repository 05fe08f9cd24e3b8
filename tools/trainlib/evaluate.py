"""Running a trained stage: the training / scoring forward (`forward_batch`), held-out NLL and perplexity in
non-overlapping windows, the unigram baseline, greedy decoding with the serving path, the export reloaded
through the real loader, the same numbers through a local ring of daemons, and the eval slice that ships
with a model (tests/test_shipped_model.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from p2pk3.model.cache import Span
from p2pk3.model.config import K3Config
from p2pk3.model.stage import K3Stage, StagePlan, build_stage


def forward_batch(stage: K3Stage, x: torch.Tensor, logits: str = "all") -> torch.Tensor:
    """x [B, T] -> logits [B*T, V] through a throw-away cache, one session per row."""
    B, T = x.shape
    cache = stage.new_cache(max_sessions=B, max_tokens=B * T, block_size=T)
    segs = []
    for b in range(B):
        cache.open(f"s{b}")
        segs.append(Span(f"s{b}", 0, T))
    return stage(segs, cache, tokens=x.reshape(-1), logits=logits)


@torch.no_grad()
def nll_windows(stage: K3Stage, ids: list[int], T: int, batch: int = 8) -> tuple[float, int]:
    """Sum of next-token NLL over `ids` cut into non-overlapping windows of T+1 tokens (fresh context per
    window; the last partial window is dropped). Returns (sum nll, tokens scored)."""
    was = stage.training
    stage.eval()
    n_win = (len(ids) - 1) // T
    xs = torch.tensor([ids[w * T : w * T + T + 1] for w in range(n_win)], dtype=torch.long)
    tot, cnt = 0.0, 0
    with torch.inference_mode():
        for i in range(0, n_win, batch):
            xb = xs[i : i + batch]
            lg = forward_batch(stage, xb[:, :-1])
            tot += float(F.cross_entropy(lg.float(), xb[:, 1:].reshape(-1), reduction="sum"))
            cnt += xb[:, 1:].numel()
    stage.train(was)
    return tot, cnt


def perplexity(stage: K3Stage, ids: list[int], T: int) -> float:
    tot, cnt = nll_windows(stage, ids, T)
    return math.exp(tot / cnt)


def unigram_ppl(train_ids: list[int], eval_ids: list[int], vocab: int, T: int | None = None) -> float:
    """Add-one smoothed unigram of the train tokens, scored on the same targets as `nll_windows`."""
    cnt = torch.bincount(torch.tensor(train_ids), minlength=vocab).double() + 1
    logp = (cnt / cnt.sum()).log()
    if T is not None:
        n_win = (len(eval_ids) - 1) // T
        tgt = [eval_ids[w * T + 1 + j] for w in range(n_win) for j in range(T)]
    else:
        tgt = eval_ids[1:]
    return math.exp(-float(logp[torch.tensor(tgt)].mean()))


@torch.no_grad()
def greedy(
    stage: K3Stage, prompt: list[int], max_new: int, stop: set[int] = frozenset(), session: str = "g"
) -> list[int]:
    """Greedy decoding with the serving path: one prefill segment, then one-token decode segments."""
    stage.eval()
    with torch.inference_mode():
        cache = stage.new_cache(max_sessions=1, max_tokens=len(prompt) + max_new + 1, block_size=64)
        cache.open(session)
        lg = stage([Span(session, 0, len(prompt))], cache, tokens=torch.tensor(prompt), logits="last")
        out: list[int] = []
        pos = len(prompt)
        for _ in range(max_new):
            nxt = int(lg[-1].argmax())
            out.append(nxt)
            if nxt in stop:
                break
            lg = stage([Span(session, pos, 1)], cache, tokens=torch.tensor([nxt]), logits="last")
            pos += 1
    return out


def load_shipped(model_dir: str | Path, dtype=torch.float32) -> K3Stage:
    """The exported model through the real loader (`load_stage_weights`) and `build_stage`."""
    from p2pk3.checkpoint.loader import load_stage_weights

    cfg = K3Config.from_pretrained(model_dir)
    plan = StagePlan.whole(cfg)
    sd = load_stage_weights(model_dir, cfg, plan.layers, embed=True, head=True)
    return build_stage(cfg, plan, sd, dtype=dtype)


def ring_eval(
    model_dir: str | Path,
    ids: list[int],
    T: int,
    nodes: int,
    prompts: list[list[int]] = (),
    stops: list[set[int]] = (),
    max_new: int = 48,
) -> tuple[float, list[list[int]]]:
    """Held-out perplexity (same windows as `nll_windows`) and greedy completions through a local ring of
    `nodes` `p2pk3 node` daemons (p2pk3.node.local.LocalRing): the served path, not this process's model."""
    import asyncio

    from p2pk3.engine.sampling import SamplingParams
    from p2pk3.node.local import LocalRing

    n_win = (len(ids) - 1) // T
    with LocalRing(model_dir, nodes) as ring:

        async def go():
            c = await ring.client()
            tot, cnt, outs = 0.0, 0, []
            try:
                for w in range(n_win):
                    win = ids[w * T : w * T + T + 1]
                    r = await c.generate(win[:-1], SamplingParams(max_tokens=0), logits=True)
                    lg = torch.from_numpy(r.logits)[:T]
                    tot += float(F.cross_entropy(lg.float(), torch.tensor(win[1:]), reduction="sum"))
                    cnt += T
                for p, st in zip(prompts, stops):
                    r = await c.generate(p, SamplingParams(max_tokens=max_new, stop_ids=tuple(sorted(st))))
                    outs.append(list(r.tokens))
            finally:
                c.close()
            return math.exp(tot / cnt), outs

        return asyncio.run(go())


EVAL_FILE = "heldout_eval.json"
EVAL_WINDOWS = 4  # the shipped-model test scores EVAL_WINDOWS windows of `seq` tokens of held-out text


def write_eval_slice(
    out_dir: str | Path, tok, held_text: str, uni_counts: torch.Tensor, stage: K3Stage, T: int
) -> dict:
    """A fixed held-out slice for tests/test_shipped_model.py, stored with the model (independent of the
    Python version's pydoc text): the text, how to tokenize it, the perplexity of the export on it and of the
    add-one unigram of the train split."""
    n_tok = EVAL_WINDOWS * T + 1
    cut = held_text
    for end in range(2000, len(held_text), 500):  # shortest prefix (at a line end) giving enough tokens
        nl = held_text.find("\n", end)
        cut = held_text[: nl if nl > 0 else len(held_text)]
        if len([tok.bos_id] + tok.encode(cut)) >= n_tok + 8:
            break
    ids = ([tok.bos_id] + tok.encode(cut))[:n_tok]
    assert len(ids) == n_tok, "held-out text too short for the eval slice"
    logp = (uni_counts / uni_counts.sum()).log()
    uni = math.exp(-float(logp[torch.tensor(ids[1:])].mean()))
    ppl = perplexity(stage, ids, T)
    rec = {
        "text": cut,
        "prepend_bos": True,
        "num_tokens": n_tok,
        "window": T,
        "windows": EVAL_WINDOWS,
        "ppl_mxfp4": ppl,
        "unigram_ppl": uni,
        "note": "held-out topics (never trained on); ppl over non-overlapping windows, fresh context per window",
    }
    (Path(out_dir) / EVAL_FILE).write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
    return rec

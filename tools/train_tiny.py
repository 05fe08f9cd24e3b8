"""Train a small model of exactly the Kimi K3 architecture on CPU and export it in the K3 checkpoint layout.
(One script over 500 lines: corpus, tokenizer, training loop and export are the steps of one reproducible run.)

    python -m tools.train_tiny --minutes 20 --run runs/tiny-k3-pydoc --export p2pk3/assets/tiny-k3-pydoc

Data: the text that ships with CPython, `pydoc_data.topics.topics` (topic -> reference text). Topics are split
by a hash of their name (`split_of`): ~10% of the topics (5% of the text) are HELD OUT (never seen by the
tokenizer or the model: only the final perplexity reads them), a few more are a VALIDATION split (loss curve /
model selection), the rest is TRAIN. Topics nest, so paragraphs of held-out (validation) topics are removed
from the validation and train (train) texts (`split_topics`; `overlap` measures what is left). Training documents are `[BOS] topic text [EOS]` plus synthetic chat Q/A pairs
built from the train topics' section headings (`chat_documents`), in the K3 chat template, so that the
special tokens and the template are exercised.

Model: `tiny_config` — every structural feature of K3 (KDA + gated MLA in the K3 cadence with the last two
layers MLA, dense layer 0, Stable LatentMoE with sigmoid router + correction bias, shared expert, SiTU-GLU,
AttnRes blocks), trained through the SAME forward the engine serves with (`K3Stage` over a throw-away
`StageCache`, one session per sequence). The routed experts are trained quantization-aware: float master
weights, forward through an MXFP4 fake quantizer with a straight-through gradient; the export quantizes the
masters with the same quantizer, so the shipped MXFP4 experts are exactly what the training forward used.

Router balancing (no aux loss, spec section 7): after every step the `e_score_correction_bias` of each MoE
layer moves towards balanced load with a simple form of K3's quantile balancing (`qb_update`; `--balance sign`
uses DeepSeek-V3's sign rule instead).

Outputs in --run: train.log (also stdout), loss.png, metrics.json, master.pt (fp32 master weights, canonical
names + float experts), samples; in --export: the checkpoint + tokenizer + model card + `heldout_eval.json`
(a fixed held-out slice with its recorded perplexity, for tests/test_shipped_model.py). `--finish` redoes
the export and evaluation from master.pt (`--ring N` adds the perplexity through a local ring of N daemons).
Quality numbers: docs/quality.md.

Speed: one torch thread (fastest on a shared 2-core box); ~2.2 s per 8 x 128-token step, dominated by the
KDA chunk reference (kernels/kda_ref.py `_chunk_one`: [H, C, C, K] tensors per 64-token chunk, one sequence
at a time).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pk3.model.cache import Span  # noqa: E402
from p2pk3.model.config import TINY_K3, K3Config, _k3_full_attn  # noqa: E402
from p2pk3.model.kimi_k3 import (K3Stage, KimiDeltaAttention, LatentMoE, StagePlan, build_stage,  # noqa: E402
                                  module_to_checkpoint)

HELDOUT_PCT = 10  # sha256(name) % 100 < 10 -> held out (7 topics, ~5% of the text on CPython 3.11)
VAL_PCT = 8  # of the rest, sha256("val/" + name) % 100 < 8 -> validation
SYSTEM_PROMPT = "You are a helpful assistant that knows the Python language reference."


# ------------------------------------------------------------------------------------------------ data
def _h(s: str) -> int:
    return int(hashlib.sha256(s.encode()).hexdigest()[:8], 16) % 100


def split_of(name: str) -> str:
    if _h(name) < HELDOUT_PCT:
        return "heldout"
    if _h("val/" + name) < VAL_PCT:
        return "val"
    return "train"


def load_topics() -> dict[str, str]:
    import pydoc_data.topics

    return {k: pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)}


def _paragraphs(text: str) -> list[str]:
    return re.split(r"\n[ \t]*\n", text)


def _dedup(text: str, banned: set[str]) -> str:
    """`text` without the paragraphs (>= 40 chars, exact match after strip) listed in `banned`."""
    return "\n\n".join(p for p in _paragraphs(text) if p.strip() not in banned)


def _para_set(texts) -> set[str]:
    return {p.strip() for t in texts for p in _paragraphs(t) if len(p.strip()) >= 40}


def split_topics(topics: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """topic -> text per split. pydoc topics nest (e.g. `specialnames` contains all of `attribute-access`),
    so a topic-level split alone leaks: every paragraph of a held-out topic is removed from the train and
    validation texts, and every validation paragraph from the train texts."""
    topics = load_topics() if topics is None else topics
    out: dict[str, dict[str, str]] = {"train": {}, "val": {}, "heldout": {}}
    for k, v in topics.items():
        out[split_of(k)][k] = v
    held = _para_set(out["heldout"].values())
    out["val"] = {k: _dedup(v, held) for k, v in out["val"].items()}
    val = _para_set(out["val"].values())
    out["train"] = {k: _dedup(v, held | val) for k, v in out["train"].items()}
    return out


def overlap(held: dict[str, str], train: dict[str, str], n: int = 8) -> float:
    """Fraction of the held-out word n-grams that also occur in the train text (a leak check)."""
    def grams(t: str) -> set[tuple[str, ...]]:
        w = t.split()
        return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}
    h = grams("\n".join(held.values()))
    tr = grams("\n".join(train.values()))
    return len(h & tr) / max(1, len(h))


_HEAD = re.compile(r"^(\S[^\n]*)\n([*=\-^~]+)\n", re.M)


def _first_sentences(text: str, max_chars: int = 300) -> str:
    """First prose paragraph (not an indented code block / grammar), cut to whole sentences."""
    for para in re.split(r"\n\s*\n", text):
        if not para.strip() or para.startswith(" ") or _HEAD.match(para + "\n"):
            continue
        p = " ".join(para.split())
        if len(p) < 40:
            continue
        sents = re.split(r"(?<=[.!?])\s+(?=[A-Z\"])", p)
        out = ""
        for s in sents:
            if out and len(out) + len(s) > max_chars:
                break
            out = (out + " " + s).strip()
        return out
    return ""


def chat_pairs(topics: dict[str, str]) -> list[tuple[str, str]]:
    """(question, answer) from every section heading of the given topics: answer = first sentences."""
    pairs = []
    for text in topics.values():
        heads = [m for m in _HEAD.finditer(text) if len(m.group(2)) == len(m.group(1))]
        for j, m in enumerate(heads):
            end = heads[j + 1].start() if j + 1 < len(heads) else len(text)
            ans = _first_sentences(text[m.end():end])
            if ans:
                pairs.append((m.group(1).strip(), ans))
    return pairs


QUESTION_FORMS = ("Tell me about {h}.", "What does the Python reference say about {h}?", "Explain {h}.")


def chat_documents(topics: dict[str, str]) -> list[list[dict]]:
    rng = random.Random(0)
    docs = []
    for h, ans in chat_pairs(topics):
        for form in QUESTION_FORMS[:2]:
            msgs = [{"role": "user", "content": form.format(h=h)}, {"role": "assistant", "content": ans}]
            if rng.random() < 0.5:
                msgs.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
            docs.append(msgs)
    return docs


def encode_documents(tok, texts: dict[str, str], chats: list[list[dict]] = ()) -> list[int]:
    """One token stream: `[BOS] text [EOS]` per topic, then `chat ... <|im_end|> [EOS]` per chat."""
    ids: list[int] = []
    for v in texts.values():
        ids += [tok.bos_id] + tok.encode(v) + [tok.eos_id]
    for msgs in chats:
        ids += tok.apply_chat_template(msgs, add_generation_prompt=False) + [tok.eos_id]
    return ids


# ----------------------------------------------------------------------------------------------- model
def tiny_config(vocab_size: int, bos: int, eos: int, pad: int, *, hidden: int = 128, layers: int = 9,
                kda_heads: int = 2, kda_dim: int = 32, experts: int = 16, topk: int = 2, moe_inter: int = 64) -> K3Config:
    """A small K3. `layers` = 9 keeps K3's pattern exactly: 1-indexed MLA layers 4, 8 and 9 (every 4th plus
    the last, so the last two are MLA, as 92 and 93 in K3); dense layer 0; MoE elsewhere."""
    return TINY_K3.replace(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
        bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        full_attn_layers=_k3_full_attn(layers),
        kda_num_heads=kda_heads, kda_head_dim=kda_dim,
        num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=4 * hidden, num_experts=experts, num_experts_per_token=topk, num_shared_experts=1,
        moe_intermediate_size=moe_inter, routed_expert_hidden_size=hidden // 2, attn_res_block_size=3,
    )


@torch.no_grad()
def init_stage(stage: K3Stage, seed: int) -> None:
    """Random start. Projections N(0, 0.02) (output projections / 1/sqrt(2L), GPT-2 style), norms 1, KDA
    A_log = log U(1, 16) on the real heads (zero padding), dt_bias set so that the initial per-channel decay
    exp(g) spans exp(-0.01)..exp(-1) (log-uniform, like Mamba's dt init), short convs N(0,1)/sqrt(kernel),
    AttnRes pseudo-queries 0 (uniform mix at start, as in the AttnRes paper), router bias 0, routed experts
    as float masters N(0, 0.02) (QAT)."""
    g = torch.Generator().manual_seed(seed)
    cfg = stage.cfg
    L = cfg.num_hidden_layers
    for name, p in stage.named_parameters():
        if name.endswith("e_score_correction_bias"):
            p.zero_()
            p.requires_grad_(False)  # moved by the balancing rule, not by gradients
        elif module_to_checkpoint(name).endswith("_res_proj.weight"):
            p.zero_()
        elif "conv1d" in name:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        elif name.endswith("A_log") or name.endswith("dt_bias"):
            pass  # below, per module
        elif p.dim() == 1:
            p.fill_(1.0)
        else:
            std = 0.02 / math.sqrt(2 * L) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=g) * std)
    for m in stage.modules():
        if isinstance(m, KimiDeltaAttention):
            H, K = m.H, m.K
            A = torch.empty(H).uniform_(1.0, 16.0, generator=g)
            m.A_log.zero_()
            m.A_log[:H] = A.log()
            lb = cfg.kda_gate_lower_bound
            # g = lb * sigmoid(A * (a + dt_bias)); with a ~ 0 choose dt_bias for a target g in [-1, -0.01]
            tgt = torch.exp(torch.empty(H, K).uniform_(math.log(0.01), math.log(1.0), generator=g))
            s = (tgt / -lb).clamp(1e-6, 1 - 1e-6)
            m.dt_bias.copy_((torch.log(s / (1 - s)) / A[:, None]).reshape(-1))
    for m in stage.modules():
        if isinstance(m, LatentMoE):
            E, W, I = len(m.held), cfg.expert_width, cfg.moe_intermediate_size
            m.enable_master_experts({
                "w1": torch.randn((E, I, W), generator=g) * 0.02,
                "w3": torch.randn((E, I, W), generator=g) * 0.02,
                "w2": torch.randn((E, W, I), generator=g) * 0.02 / math.sqrt(2 * L),
            })
            for b in ("w1_packed", "w1_scale", "w2_packed", "w2_scale", "w3_packed", "w3_scale"):
                delattr(m, b)  # the packed buffers are unused in training; keep them out of state_dict()


def moe_layers(stage: K3Stage) -> dict[int, LatentMoE]:
    return {m.layer_idx: m for m in stage.modules() if isinstance(m, LatentMoE)}


def canonical_state_dict(stage: K3Stage) -> dict[str, torch.Tensor]:
    """Canonical checkpoint names -> fp32 tensors; routed experts as float `experts.E.wK.weight`."""
    sd: dict[str, torch.Tensor] = {}
    for n, p in stage.named_parameters():
        if re.search(r"\.w[123]_master$", n):
            pre, w = n.rsplit(".", 1)
            for e in range(p.shape[0]):
                sd[f"{pre}.experts.{e}.{w[:2]}.weight"] = p[e].detach().clone()
        else:
            sd[module_to_checkpoint(n)] = p.detach().clone()
    return sd


# ----------------------------------------------------------------------------------------- balancing
class RouterTap:
    """Forward hooks on every router: keep the fp32 sigmoid scores of the last training forward."""

    def __init__(self, stage: K3Stage):
        self.scores: dict[int, torch.Tensor] = {}
        self.handles = []
        for i, moe in moe_layers(stage).items():
            self.handles.append(moe.gate.register_forward_hook(self._hook(i)))

    def _hook(self, i: int):
        def fn(mod, args, out):
            if mod.training:
                with torch.no_grad():
                    self.scores[i] = torch.sigmoid(args[0].detach().float() @ mod.weight.detach().float().T)
        return fn


@torch.no_grad()
def qb_update(bias: torch.Tensor, s: torch.Tensor, k: int, rate: float) -> None:
    """Quantile balancing, simple form (spec section 7). s [N, n] sigmoid scores, bias [n] (selection uses s + bias).

    For token t and expert e let c[t, e] be the k-th largest biased score among the OTHER experts (= the
    (k+1)-th largest overall if e is in t's top-k, else the k-th): e is admitted iff s[t, e] + b_e > c[t, e].
    With the other biases fixed, the bias that gives e exactly the target load m = N k / n is the m-th
    smallest d[t, e] = c[t, e] - s[t, e] (midpoint of the m-th and (m+1)-th). Blend towards it by `rate` (an EMA over
    steps) and subtract the mean (only differences matter for top-k)."""
    N, n = s.shape
    z = s + bias
    top = torch.topk(z, k + 1, dim=-1).values  # [N, k+1]
    chosen = torch.zeros_like(z, dtype=torch.bool).scatter_(1, torch.topk(z, k, dim=-1).indices, True)
    c = torch.where(chosen, top[:, k:k + 1], top[:, k - 1:k])
    d = (c - s).sort(0).values  # [N, n] ascending per expert
    m = N * k // n
    tgt = 0.5 * (d[m - 1] + d[min(m, N - 1)])
    bias.mul_(1 - rate).add_(rate * tgt)
    bias.sub_(bias.mean())


@torch.no_grad()
def sign_update(bias: torch.Tensor, s: torch.Tensor, k: int, rate: float) -> None:
    """DeepSeek-V3 aux-loss-free rule: b_e += rate * sign(target - load_e)."""
    N, n = s.shape
    load = torch.bincount(torch.topk(s + bias, k, dim=-1).indices.flatten(), minlength=n).float()
    bias.add_(rate * torch.sign(N * k / n - load))
    bias.sub_(bias.mean())


def imbalance(ids: torch.Tensor, n: int) -> float:
    """max expert load / mean expert load (1.0 = perfectly balanced)."""
    load = torch.bincount(ids.flatten(), minlength=n).float()
    return float(load.max() / load.mean())


# ----------------------------------------------------------------------------------------- run model
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
    xs = torch.tensor([ids[w * T: w * T + T + 1] for w in range(n_win)], dtype=torch.long)
    tot, cnt = 0.0, 0
    with torch.inference_mode():
        for i in range(0, n_win, batch):
            xb = xs[i:i + batch]
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
def greedy(stage: K3Stage, prompt: list[int], max_new: int, stop: set[int] = frozenset(), session: str = "g") -> list[int]:
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


SAMPLE_PROMPTS = [
    ("text", 'The "while" statement\n*********************\n\n'),
    ("text", "The \"for\" statement is used to"),
    ("text", "Strings are"),
    ("chat", "Tell me about the \"if\" statement."),
    ("chat", "What does the Python reference say about Dictionaries?"),
]


def samples(stage: K3Stage, tok, max_new: int = 48) -> list[tuple[str, str]]:
    return [(name, tok.decode(greedy(stage, ids, max_new, stop))) for name, ids, stop in sample_prompts(tok)]


def load_shipped(model_dir: str | Path, dtype=torch.float32) -> K3Stage:
    """The exported model through the real loader (`load_stage_weights`) and `build_stage`."""
    from p2pk3.checkpoint.loader import load_stage_weights

    cfg = K3Config.from_pretrained(model_dir)
    plan = StagePlan.whole(cfg)
    sd = load_stage_weights(model_dir, cfg, plan.layers, embed=True, head=True)
    return build_stage(cfg, plan, sd, dtype=dtype)


# ------------------------------------------------------------------------------------------------ main
def log(msg: str, fh=None) -> None:
    print(msg, flush=True)
    if fh is not None:
        fh.write(msg + "\n")
        fh.flush()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="wall-time budget of the training loop")
    ap.add_argument("--steps", type=int, default=None, help="fixed number of steps (default: fit --minutes)")
    ap.add_argument("--run", default="runs/tiny-k3-pydoc")
    ap.add_argument("--export", default=None, help="write the checkpoint here (e.g. p2pk3/assets/tiny-k3-pydoc)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=9)
    ap.add_argument("--kda-heads", type=int, default=2)
    ap.add_argument("--kda-dim", type=int, default=32)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--moe-inter", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--balance", choices=["qb", "sign", "none"], default="qb")
    ap.add_argument("--balance-rate", type=float, default=None, help="qb: EMA rate (0.1); sign: step (1e-3)")
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a shared 2-core box)")
    ap.add_argument("--profile", action="store_true", help="time 3 steps with cProfile and exit")
    ap.add_argument("--finish", action="store_true", help="skip training: export + evaluate the run's master.pt")
    ap.add_argument("--ring", type=int, default=0, help="with --finish: also score through a local ring of N daemons")
    a = ap.parse_args(argv)

    torch.manual_seed(a.seed)
    random.seed(a.seed)
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.finish:
        finish(a.run, a.export, ring=a.ring)
        return 0
    run = Path(a.run)
    run.mkdir(parents=True, exist_ok=True)
    fh = open(run / "train.log", "a" if a.profile else "w")

    # ---- data + tokenizer (train split only)
    from p2pk3.tokenizer import load_tokenizer
    from p2pk3.tokenizer.bpe import save_hf, train_bpe

    sp = split_topics()
    tok_dir = run / "tokenizer"
    save_hf(train_bpe(list(sp["train"].values()), a.vocab), tok_dir)
    tok = load_tokenizer(tok_dir)
    chats = chat_documents(sp["train"])
    train_ids = encode_documents(tok, sp["train"], chats)
    val_ids = encode_documents(tok, sp["val"])
    held_ids = encode_documents(tok, sp["heldout"])
    log(f"topics: train {len(sp['train'])} val {len(sp['val'])} heldout {len(sp['heldout'])} {sorted(sp['heldout'])}", fh)
    log(f"tokens: train {len(train_ids)} (incl. {len(chats)} chats) val {len(val_ids)} heldout {len(held_ids)}; vocab {tok.vocab_size}", fh)

    cfg = tiny_config(tok.vocab_size, tok.bos_id, tok.im_end_id, tok.pad_id, hidden=a.hidden, layers=a.layers,
                      kda_heads=a.kda_heads, kda_dim=a.kda_dim, experts=a.experts, topk=a.topk, moe_inter=a.moe_inter)
    stage = K3Stage(cfg, StagePlan.whole(cfg))
    init_stage(stage, a.seed)
    stage.train()
    n_params = sum(p.numel() for p in stage.parameters())
    n_exp = sum(p.numel() for n, p in stage.named_parameters() if n.endswith("_master"))
    log(f"config: {json.dumps({k: v for k, v in cfg.to_dict().items() if k != 'quant'})}", fh)
    log(f"layer types: {cfg.layer_types}; params {n_params / 1e6:.2f}M ({n_exp / 1e6:.2f}M routed expert)", fh)

    decay = [p for n, p in stage.named_parameters() if p.requires_grad and p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in stage.named_parameters() if p.requires_grad and not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    tap = RouterTap(stage)
    moes = moe_layers(stage)
    k, n_exp_l = cfg.num_experts_per_token, cfg.num_experts
    rate = a.balance_rate if a.balance_rate is not None else (0.1 if a.balance == "qb" else 1e-3)
    upd = {"qb": qb_update, "sign": sign_update}.get(a.balance)

    B, T = a.batch, a.seq
    gen = torch.Generator().manual_seed(a.seed)
    data = torch.tensor(train_ids, dtype=torch.long)

    def get_batch() -> torch.Tensor:
        starts = torch.randint(0, len(train_ids) - T - 1, (B,), generator=gen)
        return torch.stack([data[s:s + T + 1] for s in starts.tolist()])

    def train_step(step: int, total: int) -> tuple[float, float]:
        lr = a.lr * min(1.0, (step + 1) / a.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, total)))))
        for gr in opt.param_groups:
            gr["lr"] = lr
        xb = get_batch()
        lg = forward_batch(stage, xb[:, :-1])
        loss = F.cross_entropy(lg, xb[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(stage.parameters(), 1.0)
        opt.step()
        imb = [imbalance(m.last_ids, n_exp_l) for m in moes.values()]
        if upd is not None:
            for i, m in moes.items():
                upd(m.gate.e_score_correction_bias.data, tap.scores[i], k, rate)
        return float(loss.detach()), sum(imb) / len(imb)

    if a.profile:
        import cProfile
        import pstats

        train_step(0, 100)
        t0 = time.time()
        pr = cProfile.Profile()
        pr.enable()
        for s in range(3):
            train_step(s, 100)
        pr.disable()
        log(f"profile: {(time.time() - t0) / 3:.2f} s/step at B={B} T={T}", fh)
        pstats.Stats(pr).sort_stats("cumulative").print_stats(35)
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        return 0

    # ---- train
    budget = a.minutes * 60
    hist: dict[str, list] = {"step": [], "loss": [], "imb": [], "time": [], "val_step": [], "val_loss": []}
    t_start = time.time()
    total = a.steps or 10 ** 9
    step = 0
    best = (float("inf"), -1)
    best_sd = None
    while step < total:
        loss, imb = train_step(step, total)
        el = time.time() - t_start
        hist["step"].append(step)
        hist["loss"].append(loss)
        hist["imb"].append(imb)
        hist["time"].append(el)
        if a.steps is None and step == 4:  # fit the schedule into the budget from the first steps' speed
            per = el / 5
            est = int((budget - 30) / (per * (1 + 4.0 / a.eval_every))) if budget > 60 else int(budget / per)
            total = max(10, est)
            log(f"{per:.2f} s/step -> schedule of {total} steps", fh)
        if step % 10 == 0:
            log(f"step {step:5d}  loss {loss:.4f}  imbalance {imb:.2f}  {el:6.0f}s", fh)
        if (step + 1) % a.eval_every == 0 or step + 1 == total:
            tot, cnt = nll_windows(stage, val_ids, T)
            vl = tot / cnt
            hist["val_step"].append(step)
            hist["val_loss"].append(vl)
            log(f"step {step:5d}  val loss {vl:.4f} (ppl {math.exp(vl):.1f})", fh)
            if vl < best[0]:
                best = (vl, step)
                best_sd = {n: p.detach().clone() for n, p in stage.state_dict().items()}
        step += 1
        if time.time() - t_start > budget + 120:
            log("over the time budget: stopping", fh)
            break
    train_time = time.time() - t_start
    log(f"trained {step} steps in {train_time / 60:.1f} min; best val loss {best[0]:.4f} at step {best[1]}", fh)
    if best_sd is not None and best[1] != step - 1:
        stage.load_state_dict(best_sd)
        log(f"restored the weights of step {best[1]} (best validation loss)", fh)
    for h in tap.handles:
        h.remove()

    # ---- evaluate the master (fp32 weights, MXFP4 fake-quant experts = the QAT forward)
    uni = unigram_ppl(train_ids, held_ids, tok.vocab_size, T)
    ppl_master = perplexity(stage, held_ids, T)
    log(f"held-out perplexity: unigram {uni:.2f}  master {ppl_master:.2f}", fh)
    sd = canonical_state_dict(stage)
    torch.save({"config": cfg.to_hf_dict(), "state_dict": sd, "hist": hist, "args": vars(a)}, run / "master.pt")

    metrics = {"steps": step, "train_minutes": train_time / 60, "best_step": best[1], "unigram_ppl": uni,
               "master_ppl": ppl_master, "final_train_loss": sum(hist["loss"][-20:]) / len(hist["loss"][-20:]),
               "val_loss": best[0], "tokens_seen": step * B * T, "heldout_tokens_scored": ((len(held_ids) - 1) // T) * T,
               "heldout_topics": sorted(sp["heldout"]), "final_imbalance": sum(hist["imb"][-20:]) / len(hist["imb"][-20:]),
               "seq": T, "batch": B, "args": vars(a), "python": sys.version.split()[0], "torch": torch.__version__}

    # ---- plot
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        w = 10
        sm = [sum(hist["loss"][max(0, i - w + 1):i + 1]) / len(hist["loss"][max(0, i - w + 1):i + 1]) for i in range(len(hist["loss"]))]
        ax[0].plot(hist["step"], hist["loss"], alpha=0.3, label="train (per step)")
        ax[0].plot(hist["step"], sm, label=f"train ({w}-step mean)")
        ax[0].plot(hist["val_step"], hist["val_loss"], "o-", label="validation")
        ax[0].axhline(math.log(uni), color="gray", ls="--", label=f"unigram (held-out) {math.log(uni):.2f}")
        ax[0].set_xlabel("step")
        ax[0].set_ylabel("cross-entropy (nats/token)")
        ax[0].set_title(f"tiny K3 on pydoc topics ({step} steps, {train_time / 60:.0f} min CPU)")
        ax[0].legend()
        ax[1].plot(hist["step"], hist["imb"])
        ax[1].set_xlabel("step")
        ax[1].set_ylabel("max load / mean load (mean over MoE layers)")
        ax[1].set_title(f"router load imbalance ({a.balance})")
        fig.tight_layout()
        fig.savefig(run / "loss.png", dpi=110)
    except Exception as e:  # plotting is optional
        log(f"plot failed: {e}", fh)

    (run / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    fh.close()
    if a.export:
        finish(run, a.export)
    return 0


def finish(run: str | Path, export_dir: str | Path, ring: int = 0) -> dict:
    """Export `run`/master.pt to `export_dir`, reload it through the real loader, evaluate, sample; updates
    `run`/metrics.json. Separate from training so that it can be rerun (`--finish`)."""
    from p2pk3.tokenizer import load_tokenizer

    run = Path(run)
    fh = open(run / "train.log", "a")
    ck = torch.load(run / "master.pt", weights_only=False)
    cfg = K3Config.from_hf_dict(ck["config"])
    metrics = json.loads((run / "metrics.json").read_text())
    T = metrics["seq"]
    tok = load_tokenizer(run / "tokenizer")
    sp = split_topics()
    held_ids = encode_documents(tok, sp["heldout"])
    export(export_dir, cfg, ck["state_dict"], run / "tokenizer", metrics, held_ids)
    shipped = load_shipped(export_dir)
    ppl_mx = perplexity(shipped, held_ids, T)
    # reference rows: the master with unquantized float experts (what QAT gives up), the export in bf16 compute
    float_cfg = cfg.replace(quant=None)
    ppl_float = perplexity(build_stage(float_cfg, StagePlan.whole(float_cfg), ck["state_dict"]), held_ids, T)
    ppl_bf16 = perplexity(load_shipped(export_dir, dtype=torch.bfloat16), held_ids, T)
    metrics["master_float_experts_ppl"] = ppl_float
    metrics["mxfp4_bf16_ppl"] = ppl_bf16
    log(f"held-out perplexity: master with float experts {ppl_float:.2f}; export in bf16 compute {ppl_bf16:.2f}", fh)
    metrics["mxfp4_ppl"] = ppl_mx
    metrics["mxfp4_vs_master"] = ppl_mx / metrics["master_ppl"]
    log(f"held-out perplexity: exported MXFP4 via loader {ppl_mx:.2f} ({100 * (ppl_mx / metrics['master_ppl'] - 1):+.2f}% vs master)", fh)
    train_ids = encode_documents(tok, sp["train"], chat_documents(sp["train"]))
    counts = torch.bincount(torch.tensor(train_ids), minlength=tok.vocab_size).double() + 1
    ev = write_eval_slice(export_dir, tok, "\n\n".join(sp["heldout"].values()), counts, shipped, T)
    metrics["eval_slice"] = {k: ev[k] for k in ("num_tokens", "ppl_mxfp4", "unigram_ppl")}
    log(f"eval slice ({ev['num_tokens']} tokens): ppl {ev['ppl_mxfp4']:.2f} unigram {ev['unigram_ppl']:.2f}", fh)
    metrics["n_chats"] = len(chat_documents(sp["train"]))
    metrics["n_train_topics"] = len(sp["train"])
    metrics["params_m"] = sum(int(t.numel()) for n, t in ck["state_dict"].items()) / 1e6
    sm_out = samples(shipped, tok)
    metrics["samples"] = sm_out
    for p, c in sm_out:
        log(f"--- {p!r}\n{c!r}", fh)
    if ring:
        ring_ppl, ring_out = ring_eval(export_dir, held_ids, T, ring, [p for _, p, _ in sample_prompts(tok)],
                                       [s for _, _, s in sample_prompts(tok)])
        metrics["ring"] = {"nodes": ring, "ppl": ring_ppl, "samples": [tok.decode(o) for o in ring_out],
                           "samples_match_in_process": [tok.decode(o) for o in ring_out] == [o for _, o in sm_out]}
        log(f"held-out perplexity through a {ring}-node ring: {ring_ppl:.2f}; greedy samples identical to "
            f"in-process: {metrics['ring']['samples_match_in_process']}", fh)
    size = sum(f.stat().st_size for f in Path(export_dir).rglob("*") if f.is_file())
    metrics["export_bytes"] = size
    log(f"export: {export_dir} {size / 1e6:.2f} MB", fh)
    (run / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_model_card(export_dir, cfg, metrics)
    fh.close()
    return metrics


def export(out_dir: str | Path, cfg: K3Config, sd: dict[str, torch.Tensor], tok_dir: Path, metrics: dict,
           held_ids: list[int]) -> None:
    import shutil

    from p2pk3.checkpoint.tiny import write_checkpoint

    out = Path(out_dir)
    if out.exists():
        for f in out.iterdir():
            if f.is_file():
                f.unlink()
    # A_log: the model holds the zero-padded [max(H, K)] vector already
    write_checkpoint(out, cfg, seed=0, shards=2, state_dict=sd)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)
    tc = json.loads((tok_dir / "tokenizer_config.json").read_text())
    gen = {"bos_token_id": tc["bos_token_id"], "eos_token_id": tc["stop_token_ids"], "pad_token_id": tc["pad_token_id"],
           "do_sample": False, "max_new_tokens": 128}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def ring_eval(model_dir: str | Path, ids: list[int], T: int, nodes: int, prompts: list[list[int]] = (),
              stops: list[set[int]] = (), max_new: int = 48) -> tuple[float, list[list[int]]]:
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
                    win = ids[w * T: w * T + T + 1]
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


def sample_prompts(tok) -> list[tuple[str, list[int], set[int]]]:
    out = []
    for kind, p in SAMPLE_PROMPTS:
        if kind == "chat":
            out.append((f"[{kind}] {p}", tok.apply_chat_template([{"role": "user", "content": p}]), {tok.im_end_id, tok.eos_id}))
        else:
            out.append((f"[{kind}] {p}", [tok.bos_id] + tok.encode(p), {tok.eos_id}))
    return out


EVAL_FILE = "heldout_eval.json"
EVAL_WINDOWS = 4  # the shipped-model test scores EVAL_WINDOWS windows of `seq` tokens of held-out text


def write_eval_slice(out_dir: str | Path, tok, held_text: str, uni_counts: torch.Tensor, stage: K3Stage, T: int) -> dict:
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
    rec = {"text": cut, "prepend_bos": True, "num_tokens": n_tok, "window": T, "windows": EVAL_WINDOWS,
           "ppl_mxfp4": ppl, "unigram_ppl": uni,
           "note": "held-out topics (never trained on); ppl over non-overlapping windows, fresh context per window"}
    (Path(out_dir) / EVAL_FILE).write_text(json.dumps(rec, indent=1, ensure_ascii=False) + "\n")
    return rec


def write_model_card(out_dir: str | Path, cfg: K3Config, metrics: dict) -> None:
    from tools.model_card import architecture_table

    c = cfg
    size = metrics.get("export_bytes", 0) / 1e6
    samples_md = "\n".join(f"prompt {json.dumps(p, ensure_ascii=False)}\n```text\n{o[:400]}\n```\n"
                           for p, o in metrics.get("samples", []))
    card = f"""# tiny-k3-pydoc

A {metrics.get('params_m', 0):.1f}M-parameter model with **exactly the Kimi K3 architecture** (text tower),
trained from scratch on CPU in {metrics['train_minutes']:.0f} minutes on the Python language reference that
ships with CPython (`pydoc_data.topics`). It is the embedded default model of p2pk3: small enough to ship in
the wheel ({size:.1f} MB), real enough to exercise every code path of the engine (KDA, gated MLA, AttnRes,
Stable LatentMoE with MXFP4 experts) and to produce readable, on-topic (if often wrong) text.

It is a toy: it has seen ~{metrics['tokens_seen'] / 1e3:.0f}K tokens. Do not expect facts.

## Architecture (K3 layout, shrunk)

{architecture_table(c)}

Checkpoint layout as published for K3: `config.json` (`kimi_k3` wrapper with `text_config` and
`quantization_config`), sharded safetensors with `model.safetensors.index.json`, text weights under
`language_model.`, bf16 except the fp32 KDA conv / `A_log` (zero-padded) / `dt_bias` / `o_norm` and router
correction bias, routed experts as `weight_packed` / `weight_scale` uint8.

## Tokenizer

`tokenizer.json` (Hugging Face, byte-level BPE, Kimi K2's pre-tokenizer regex) trained on the train split only.
{c.vocab_size - 32} BPE ids, then 32 special slots laid out like Kimi's: `[BOS]` {c.vocab_size - 32},
`[EOS]` {c.vocab_size - 31}, `<|im_end|>` {c.vocab_size - 30}, `<|im_user|>` {c.vocab_size - 29},
`<|im_assistant|>` {c.vocab_size - 28}, `<|im_system|>` {c.vocab_size - 22}, `<|im_middle|>` {c.vocab_size - 15},
`[UNK]` {c.vocab_size - 2}, `[PAD]` {c.vocab_size - 1}, the rest `<|reserved_token_i|>`. Stop ids: `[EOS]` and
`<|im_end|>`. Chat format (Jinja template in `tokenizer_config.json`):

```
<|im_system|>system<|im_middle|>...<|im_end|><|im_user|>user<|im_middle|>...<|im_end|><|im_assistant|>assistant<|im_middle|>
```

## Training

`python -m tools.train_tiny --minutes 20 --run runs/tiny-k3-pydoc --export p2pk3/assets/tiny-k3-pydoc`
(seed 0, {metrics['steps']} AdamW steps of {metrics['batch']} x {metrics['seq']} tokens, warmup + cosine,
1 CPU thread, Python {metrics.get('python')}, torch {metrics.get('torch')}). Data: the {metrics.get('n_train_topics', '')} train topics
of `pydoc_data.topics` as `[BOS] text [EOS]` documents plus {metrics.get('n_chats', '')} synthetic chat Q/A pairs built from
their section headings (answer = the section's first sentences). Topics are split by a hash of their
name; the held-out topics ({', '.join(metrics['heldout_topics'])}) are used only for the numbers below.
Routed experts are trained quantization-aware (MXFP4 fake quantization, straight-through gradient); the
router correction bias is set by a simple quantile-balancing rule (no aux loss).

## Quality (held-out topics, {metrics['heldout_tokens_scored']} tokens, windows of {metrics['seq']})

| | perplexity |
|---|---|
| add-one unigram (train split) | {metrics['unigram_ppl']:.1f} |
| fp32 master weights (QAT forward) | {metrics['master_ppl']:.1f} |
| fp32 master weights, float (unquantized) experts | {metrics.get('master_float_experts_ppl', float('nan')):.1f} |
| this checkpoint (bf16 + MXFP4 experts, real loader), fp32 compute | {metrics.get('mxfp4_ppl', float('nan')):.1f} |
| this checkpoint, bf16 compute | {metrics.get('mxfp4_bf16_ppl', float('nan')):.1f} |
| this checkpoint through a {metrics.get('ring', {}).get('nodes', 4)}-node local ring (`p2pk3 node` daemons) | {metrics.get('ring', {}).get('ppl', float('nan')):.1f} |

Non-overlapping windows of {metrics['seq']} tokens, fresh context per window. Details: docs/quality.md.

Greedy samples (this checkpoint):

{samples_md}

## Integrity

`p2pk3-manifest.json` beside the weights records the size and SHA-256 of every file here but this card;
`p2pk3 generate`, `p2pk3 local` and every node check the shards against it at load, as they check a
downloaded model (a changed shard stops them, naming the file). A retrained or re-exported model must
regenerate it: `p2pk3 manifest p2pk3/assets/tiny-k3-pydoc` (tests/test_cli_plan_deploy.py fails until it matches).

## License / provenance

Weights trained by p2pk3 from random initialisation. Training text: the Python documentation shipped with
CPython (Copyright Python Software Foundation, PSF License).
"""
    (Path(out_dir) / "README.md").write_text(card)


if __name__ == "__main__":
    raise SystemExit(main())

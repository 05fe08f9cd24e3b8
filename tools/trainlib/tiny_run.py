"""The tiny-k3-pydoc run (tools/train_tiny.py has the whole story): `train` (tokenizer, model, QAT training
loop with router balancing, plot, metrics, master.pt) and `finish` (export, reload, evaluate, sample).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from p2pk3.model.config import K3Config
from p2pk3.model.stage import K3Stage, StagePlan, build_stage

from .balance import RouterTap, imbalance, qb_update, sign_update
from .evaluate import (
    forward_batch,
    greedy,
    load_shipped,
    nll_windows,
    perplexity,
    ring_eval,
    unigram_ppl,
    write_eval_slice,
)
from .export import export
from .model import canonical_state_dict, config_from_args, init_stage, moe_layers
from .pydoc_topics import chat_documents, encode_documents, split_topics
from .runlog import log
from .tiny_card import write_model_card

SAMPLE_PROMPTS = [
    ("text", 'The "while" statement\n*********************\n\n'),
    ("text", 'The "for" statement is used to'),
    ("text", "Strings are"),
    ("chat", 'Tell me about the "if" statement.'),
    ("chat", "What does the Python reference say about Dictionaries?"),
]


def samples(stage: K3Stage, tok, max_new: int = 48) -> list[tuple[str, str]]:
    return [(name, tok.decode(greedy(stage, ids, max_new, stop))) for name, ids, stop in sample_prompts(tok)]


def sample_prompts(tok) -> list[tuple[str, list[int], set[int]]]:
    out = []
    for kind, p in SAMPLE_PROMPTS:
        if kind == "chat":
            out.append(
                (
                    f"[{kind}] {p}",
                    tok.apply_chat_template([{"role": "user", "content": p}]),
                    {tok.im_end_id, tok.eos_id},
                )
            )
        else:
            out.append((f"[{kind}] {p}", [tok.bos_id] + tok.encode(p), {tok.eos_id}))
    return out


def train(a) -> int:
    """Train (arguments of tools/train_tiny.py), write the run's outputs, and export when `a.export`."""
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
    log(
        f"topics: train {len(sp['train'])} val {len(sp['val'])} heldout {len(sp['heldout'])} {sorted(sp['heldout'])}",
        fh,
    )
    log(
        f"tokens: train {len(train_ids)} (incl. {len(chats)} chats) val {len(val_ids)} heldout {len(held_ids)}; vocab {tok.vocab_size}",
        fh,
    )

    cfg = config_from_args(tok, a)
    stage = K3Stage(cfg, StagePlan.whole(cfg))
    init_stage(stage, a.seed)
    stage.train()
    n_params = sum(p.numel() for p in stage.parameters())
    n_exp = sum(p.numel() for n, p in stage.named_parameters() if n.endswith("_master"))
    log(f"config: {json.dumps({k: v for k, v in cfg.to_dict().items() if k != 'quant'})}", fh)
    log(f"layer types: {cfg.layer_types}; params {n_params / 1e6:.2f}M ({n_exp / 1e6:.2f}M routed expert)", fh)

    decay = [p for n, p in stage.named_parameters() if p.requires_grad and p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in stage.named_parameters() if p.requires_grad and not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
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
        return torch.stack([data[s : s + T + 1] for s in starts.tolist()])

    def train_step(step: int, total: int) -> tuple[float, float]:
        lr = (
            a.lr
            * min(1.0, (step + 1) / a.warmup)
            * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, total)))))
        )
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
    total = a.steps or 10**9
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

    metrics = {
        "steps": step,
        "train_minutes": train_time / 60,
        "best_step": best[1],
        "unigram_ppl": uni,
        "master_ppl": ppl_master,
        "final_train_loss": sum(hist["loss"][-20:]) / len(hist["loss"][-20:]),
        "val_loss": best[0],
        "tokens_seen": step * B * T,
        "heldout_tokens_scored": ((len(held_ids) - 1) // T) * T,
        "heldout_topics": sorted(sp["heldout"]),
        "final_imbalance": sum(hist["imb"][-20:]) / len(hist["imb"][-20:]),
        "seq": T,
        "batch": B,
        "args": vars(a),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }

    # ---- plot
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        w = 10
        sm = [
            sum(hist["loss"][max(0, i - w + 1) : i + 1]) / len(hist["loss"][max(0, i - w + 1) : i + 1])
            for i in range(len(hist["loss"]))
        ]
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
    log(
        f"held-out perplexity: exported MXFP4 via loader {ppl_mx:.2f} ({100 * (ppl_mx / metrics['master_ppl'] - 1):+.2f}% vs master)",
        fh,
    )
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
        ring_ppl, ring_out = ring_eval(
            export_dir,
            held_ids,
            T,
            ring,
            [p for _, p, _ in sample_prompts(tok)],
            [s for _, _, s in sample_prompts(tok)],
        )
        metrics["ring"] = {
            "nodes": ring,
            "ppl": ring_ppl,
            "samples": [tok.decode(o) for o in ring_out],
            "samples_match_in_process": [tok.decode(o) for o in ring_out] == [o for _, o in sm_out],
        }
        log(
            f"held-out perplexity through a {ring}-node ring: {ring_ppl:.2f}; greedy samples identical to "
            f"in-process: {metrics['ring']['samples_match_in_process']}",
            fh,
        )
    size = sum(f.stat().st_size for f in Path(export_dir).rglob("*") if f.is_file())
    metrics["export_bytes"] = size
    log(f"export: {export_dir} {size / 1e6:.2f} MB", fh)
    (run / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    write_model_card(export_dir, cfg, metrics)
    fh.close()
    return metrics

"""Train the demo K3 on the CPython documentation and the Linux man pages, fine-tune it on chat pairs, export.

    python -m tools.train_docs --minutes 75 --chat-minutes 15 --run runs/k3-docs --export p2pk3/assets/k3-docs
    python -m tools.train_docs --run runs/k3-docs --resume      # continue a run from its last checkpoint
    python -m tools.train_docs --run runs/k3-docs --finish --export p2pk3/assets/k3-docs --ring 4

The sibling of tools/train_tiny.py (the 135 K-token pydoc model): the same model code, initialisation,
MXFP4 QAT experts, router balancing and export (the training library tools/trainlib/), on ~20x more text and in two phases.

Data (tools/doc_corpus/): the reStructuredText sources of the Python 3.11 documentation (Debian
`python3.11-doc`) stripped to prose and code blocks, and the `manpages` / `manpages-dev` pages rendered with
groff; deduplicated by paragraph; split by document (5% held out, 3% validation). The tokenizer is trained on
the train split only.

Phase 1 (`pretrain`): `[BOS] document [EOS]` stream, random windows of `--seq` tokens, warmup + cosine.
Phase 2 (`chat`): question/answer pairs built from the train documents' own structure (`qa_pairs`: a defined
name or heading -> "What does X do?", its first paragraph -> the answer), rendered with the model's chat
template, packed into rows; the loss is on the answer tokens (and the closing `<|im_end|>`) only. A quarter of
each batch stays plain text, so that the model keeps its language model.

Resumable: `ckpt.pt` in --run (weights, optimizer, data generator, phase, step, schedule, history) is
rewritten every `--ckpt-minutes` and at each phase end; `--resume` continues from it with the same schedule
and the run's own options, except: `--extend-to N` lengthens the current phase's schedule to N steps (the
cosine stretched from the current step; a schedule of steps then, not of minutes), `--threads`, and the
options of a phase not started yet (`--minutes`, `--chat-minutes`, `--chat-steps`, `--chat-lr`,
`--chat-batch`, `--chat-seq`, `--renamed-copies`, `--unquoted-copies`).
Outputs: train.log, loss.png, metrics.json, master.pt (fp32 masters, canonical names), the export + model card.

Speed: the KDA prefill reference runs with 16-token chunks here (`kda_ref.CHUNK`; any chunk is the same
recurrence up to rounding) and folds the batch's equal-length rows into one call: ~3x faster training steps
than the serving default of 64-token chunks on this 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pk3.model.config import K3Config  # noqa: E402
from p2pk3.model.stage import K3Stage, StagePlan  # noqa: E402
from p2pk3_kernels import kda_ref  # noqa: E402
from tools import doc_corpus  # noqa: E402
from tools.trainlib.balance import RouterTap, imbalance, qb_update  # noqa: E402
from tools.trainlib import lineage  # noqa: E402
from tools.trainlib.evaluate import forward_batch  # noqa: E402
from tools.trainlib.export import export  # noqa: E402
from tools.trainlib.model import (  # noqa: E402
    INIT_VARIANTS,
    canonical_state_dict,
    config_from_args,
    init_stage,
    moe_layers,
    redraw,
)
from tools.trainlib.runlog import log  # noqa: E402
from tools.trainlib.warm_start import export_config, load_export, upgrade_tokenizer  # noqa: E402

TRAIN_CHUNK = 16
# given on --resume before the chat phase has started: they win over the run's own
CHAT_OPTIONS = ("chat_steps", "chat_lr", "chat_batch", "chat_seq", "renamed_copies", "unquoted_copies")
VAL_CHAT_ROWS = 64  # validation answer loss over the first 64 packed rows (a fixed set; ~30 s)
SYSTEM_PROMPT = "You are a helpful assistant that knows the Python documentation and the Linux manual pages."
QUESTION_SYSTEM_RATE = 0.3  # fraction of chat examples rendered with the system prompt (the REPL sends none)


# ------------------------------------------------------------------------------------------------ data
def encode_stream(tok, docs: dict[str, str]) -> list[int]:
    ids: list[int] = []
    for v in docs.values():
        ids += [tok.bos_id] + tok.encode(v) + [tok.eos_id]
    return ids


def chat_example(tok, question: str, answer: str, system: str | None) -> tuple[list[int], list[int]]:
    """(ids, loss mask over the targets ids[1:]): 1 on the answer and its `<|im_end|>`, 0 on the prompt."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return conversation_example(tok, msgs + [{"role": "assistant", "content": answer}])


def conversation_example(tok, msgs: list[dict], tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """(ids, loss mask over the targets ids[1:]) of a whole conversation: 1 on every assistant turn (its
    text, tool calls and `<|im_end|>`), 0 on the rest (system, user, tool results, the role headers)."""
    render = tok.chat.apply_chat_template  # p2pk3.tokenizer.chat.ChatTokenizer: the checkpoint's template
    full = render(msgs, add_generation_prompt=False, tools=tools)
    mask = [0] * len(full)
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = render(msgs[:i], add_generation_prompt=True, tools=tools)
        upto = render(msgs[: i + 1], add_generation_prompt=False, tools=tools)
        assert full[: len(upto)] == upto and upto[: len(prompt)] == prompt, (
            "chat template: a conversation's prefix does not render as a prefix"
        )
        mask[len(prompt) : len(upto)] = [1] * (len(upto) - len(prompt))
    return [tok.bos_id] + full + [tok.eos_id], mask + [0]


def pack_rows(
    examples: list[tuple[list[int], list[int]]], T: int, pad: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Examples (shuffled) packed greedily into rows of T+1 ids; mask [rows, T] over the targets."""
    rng = random.Random(seed)
    ex = [e for e in examples if len(e[0]) <= T + 1]
    rng.shuffle(ex)
    rows, masks, cur, cm = [], [], [], []
    for ids, m in ex:
        if len(cur) + len(ids) > T + 1:
            rows.append(cur + [pad] * (T + 1 - len(cur)))
            masks.append(cm + [0] * (T - len(cm)))
            cur, cm = [], []
        if cur:
            cm.append(0)  # the target linking the previous example to this one's [BOS]
        cur = cur + ids
        cm = cm + m
    if cur:
        rows.append(cur + [pad] * (T + 1 - len(cur)))
        masks.append(cm + [0] * (T - len(cm)))
    return torch.tensor(rows, dtype=torch.long), torch.tensor([m[:T] for m in masks], dtype=torch.float32)


def chat_set(tok, pairs, seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [
        chat_example(tok, q, a, SYSTEM_PROMPT if rng.random() < QUESTION_SYSTEM_RATE else None) for q, a, _ in pairs
    ]


def conversation_set(
    tok, items, index: dict, seed: int, renamed: int = 0, unquoted: int = 0
) -> list[tuple[list[int], list[int]]]:
    """Tool conversations, multi-turn conversations, reworded questions and the same about made-up names
    (tools/doc_corpus/agent.py); `renamed`: how many times the made-up-name set, each with other names (0: none;
    2 made it ~40 % of the chat set in the fourth run, which did worse: docs/quality.md); `unquoted`: how many
    times more the tool conversations about man pages and modules (agent.unquoted), each time with real names and
    with new made-up ones."""
    from p2pk3.agent.doctools import DocTools
    from tools.doc_corpus import agent

    rng = random.Random(seed)
    convs = agent.tool_conversations(items, DocTools(index), seed) + agent.multi_turn(items, seed)
    convs += agent.paraphrased(items, seed)
    convs += [c for k in range(renamed) for c in agent.renamed(items, DocTools(index), seed + k)]
    few = agent.unquoted(items)
    for k in range(unquoted):
        convs += agent.tool_conversations(few, DocTools(index), seed + 100 + k)
        convs += agent.renamed(few, DocTools(index), seed + 200 + k)
    out = []
    for msgs, tools in convs:
        if rng.random() < QUESTION_SYSTEM_RATE:
            msgs = [{"role": "system", "content": SYSTEM_PROMPT}] + msgs
        out.append(conversation_example(tok, msgs, tools))
    return out


class Data:
    """Every split's token streams and chat rows, built once per run (and rebuilt identically on resume)."""

    def __init__(
        self,
        run: Path,
        vocab: int,
        T: int,
        corpus: str | None,
        chat_T: int,
        init_from: str | None,
        renamed: int = 0,
        unquoted: int = 0,
    ):
        from p2pk3.tokenizer import load_tokenizer
        from p2pk3.tokenizer.bpe import save_hf, train_bpe
        from tools.doc_corpus import agent
        from tools.doc_corpus.qa import _qa_items

        docs = doc_corpus.load_documents(corpus)
        self.split = doc_corpus.split_documents(docs)
        tok_dir = run / "tokenizer"
        if init_from and not (tok_dir / "tokenizer.json").exists():
            upgrade_tokenizer(init_from, tok_dir)  # the checkpoint's ids, today's special names and template
        if not (tok_dir / "tokenizer.json").exists():
            save_hf(train_bpe(list(self.split["train"].values()), vocab), tok_dir)
        self.tok_dir = tok_dir
        self.tok = tok = load_tokenizer(tok_dir)
        self.ids = {k: encode_stream(tok, v) for k, v in self.split.items()}
        self.pairs = {k: doc_corpus.qa_pairs(v) for k, v in self.split.items()}
        items = {k: _qa_items(v) for k, v in self.split.items()}
        self.index = agent.doc_index([it for k in ("train", "val", "heldout") for it in items[k]])
        (run / "doc_index.json").write_text(json.dumps(self.index, ensure_ascii=False))  # shipped by export
        self.chat = {
            k: pack_rows(
                chat_set(tok, self.pairs[k], 1) + conversation_set(tok, items[k], self.index, 3, renamed, unquoted),
                chat_T,
                tok.pad_id,
                2,
            )
            for k in ("train", "val")
        }
        self.chars = {k: sum(len(t) for t in v.values()) for k, v in self.split.items()}
        if len(self.chat["train"][0]) == 0:
            raise SystemExit(f"no chat example fits in --seq {T} tokens: raise --seq")


# ------------------------------------------------------------------------------------------------ train
def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    return (
        peak
        * min(1.0, (step + 1) / warmup)
        * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, total)))))
    )


@torch.no_grad()
def masked_nll(stage: K3Stage, rows: torch.Tensor, mask: torch.Tensor, batch: int = 8) -> float:
    """Mean NLL of the masked targets (answer tokens) over all rows."""
    was = stage.training
    stage.eval()
    tot, cnt = 0.0, 0.0
    with torch.inference_mode():
        for i in range(0, len(rows), batch):
            xb, mb = rows[i : i + batch], mask[i : i + batch]
            lg = forward_batch(stage, xb[:, :-1])
            nll = F.cross_entropy(lg.float(), xb[:, 1:].reshape(-1), reduction="none")
            tot += float((nll * mb.reshape(-1)).sum())
            cnt += float(mb.sum())
    stage.train(was)
    return tot / max(1.0, cnt)


@torch.no_grad()
def stream_nll(stage: K3Stage, ids: list[int], T: int, max_windows: int, batch: int = 8) -> float:
    """Mean next-token NLL over (at most `max_windows`, evenly spread) non-overlapping windows of T+1."""
    n_win = (len(ids) - 1) // T
    pick = sorted({int(i * n_win / max_windows) for i in range(max_windows)}) if n_win > max_windows else range(n_win)
    xs = torch.tensor([ids[w * T : w * T + T + 1] for w in pick], dtype=torch.long)
    return masked_nll(stage, xs, torch.ones(len(xs), T), batch)


def repeated(row: torch.Tensor) -> torch.Tensor:
    """The row's first half, then the same tokens again (as many as fit): a copy-task row of the same length.
    Natural text teaches a small model little in-context copying in a few million tokens (docs/quality.md,
    "Why the demo model does not copy"); a passage written twice rewards exactly that."""
    half = (len(row) + 1) // 2
    return torch.cat([row[:half], row[: len(row) - half]])


def random_copies(
    n: int, high: int, gen: torch.Generator, pool: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A row of n tokens made of random spans (8-32 ids drawn from [0, high), no special token; from `pool` where
    given, the ids a copy curriculum starts with) each written twice, and the
    loss mask of its n - 1 targets: only a second copy's tokens after its first, the ones that copying alone
    predicts. Natural text written twice (`repeated`) is half predictable without copying, and a warm-started
    model did not learn to copy from it (docs/quality.md); random spans leave copying the only way down."""
    row, mask = [], []
    while len(row) < n:
        length = int(torch.randint(8, 33, (1,), generator=gen))
        span = torch.randint(0, high if pool is None else len(pool), (length,), generator=gen)
        span = (span if pool is None else pool[span]).tolist()
        row += span + span
        mask += [0.0] * (len(span) + 1) + [1.0] * (len(span) - 1)
    # mask[j] weighs the prediction of row[j] (the first token has none): targets are row[1:], so drop one
    return torch.tensor(row[:n]), torch.tensor(mask[1:n])


def copy_pool(text: torch.Tensor, high: int, n: int) -> torch.Tensor:
    """`--copy-vocab`: the `n` most frequent ids below `high` (no special one) of the token stream `text`."""
    counts = torch.bincount(text, minlength=high)[:high]
    return counts.topk(min(n, high)).indices


def save_ckpt(path: Path, state: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def train(a) -> int:
    kda_ref.CHUNK = TRAIN_CHUNK
    run = Path(a.run)
    run.mkdir(parents=True, exist_ok=True)
    ck_path = run / "ckpt.pt"
    if a.resume and not ck_path.exists():
        raise SystemExit(f"--resume: there is no checkpoint {ck_path} (start the run without --resume)")
    ck = torch.load(ck_path, weights_only=False) if a.resume else None
    if ck is not None:  # the run's own settings, except what this invocation names: --stop-after-steps,
        # --export, --threads, and the budget and options of a phase not started yet (--minutes / --chat-minutes /
        # CHAT_OPTIONS given again)
        keep = {
            "resume": True,
            "extend_to": a.extend_to,
            "stop_after_steps": a.stop_after_steps,
            "export": a.export or ck["args"].get("export"),
        }
        if a.threads is not None:  # the machine's, not the run's
            keep["threads"] = a.threads
        for k, phase in (("minutes", "pretrain"), ("chat_minutes", "chat")):
            if getattr(a, k) is not None and ck["state"]["phase"] == phase and ck["state"]["total"] is None:
                keep[k] = getattr(a, k)
        chat_started = ck["state"]["phase"] == "done" or (
            ck["state"]["phase"] == "chat" and ck["state"]["total"] is not None
        )
        given = [k for k in CHAT_OPTIONS if getattr(a, k) is not None]
        if given and chat_started:
            flags = ", ".join("--" + k.replace("_", "-") for k in given)
            raise SystemExit(f"{flags}: the run's chat phase has started with its own; resume without them")
        keep.update({k: getattr(a, k) for k in given})  # the chat phase is still to come: these win
        a = argparse.Namespace(**{**vars(a), **ck["args"], **keep})  # options newer than the run: defaults
    defaults = {
        "minutes": 75.0,
        "chat_minutes": 15.0,
        "threads": 2,
        "chat_lr": 1e-3,
        "renamed_copies": 0,
        "unquoted_copies": 0,
    }
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    fh = open(run / "train.log", "a" if ck else "w")
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    torch.set_num_threads(a.threads)
    B, T = a.batch, a.seq
    t0 = time.time()
    CB, CT = a.chat_batch or B, a.chat_seq or T
    data = Data(run, a.vocab, T, a.corpus, CT, a.init_from, a.renamed_copies, a.unquoted_copies)
    tok = data.tok
    log(
        f"data ({time.time() - t0:.0f} s): documents "
        + ", ".join(f"{k} {len(v)}" for k, v in data.split.items())
        + "; chars "
        + ", ".join(f"{k} {v / 1e6:.2f}M" for k, v in data.chars.items())
        + "; tokens "
        + ", ".join(f"{k} {len(v) / 1e6:.2f}M" for k, v in data.ids.items())
        + "; chat pairs "
        + ", ".join(f"{k} {len(v)}" for k, v in data.pairs.items())
        + f"; chat rows train {len(data.chat['train'][0])} val {len(data.chat['val'][0])}; vocab {tok.vocab_size}",
        fh,
    )

    if a.init_from:  # warm start: the checkpoint's architecture and weights (tools/trainlib/warm_start.py)
        cfg = export_config(a.init_from)
    else:
        cfg = config_from_args(tok, a)
    stage = K3Stage(cfg, StagePlan.whole(cfg))
    init_stage(stage, a.seed, getattr(a, "fresh_init", "train"))  # a warm start's weights replace it below
    if a.init_from and ck is None:
        n = load_export(stage, a.init_from)
        log(f"warm start from {a.init_from}: {n} tensors", fh)
        if getattr(a, "redraw", None):  # these tensors start afresh (the rest keeps what it learnt)
            drawn = redraw(stage, a.redraw, a.seed)
            log(f"redrawn as in init variant {a.redraw}: {len(drawn)} tensors ({', '.join(drawn[:4])}, ...)", fh)
        lineage.write(run, lineage.runs_through(a.init_from))  # before an export into the same folder replaces it
    stage.train()
    decay = [p for n, p in stage.named_parameters() if p.requires_grad and p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in stage.named_parameters() if p.requires_grad and not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(a.seed)
    state = {
        "phase": "pretrain",
        "step": 0,
        "total": None,
        "elapsed": {"pretrain": 0.0, "chat": 0.0},
        "hist": {
            "pretrain": {"step": [], "loss": [], "imb": [], "time": [], "val_step": [], "val_loss": []},
            "chat": {"step": [], "loss": [], "imb": [], "time": [], "val_step": [], "val_loss": [], "val_text": []},
        },
    }
    if ck is not None:
        stage.load_state_dict(ck["stage"])
        opt.load_state_dict(ck["opt"])
        gen.set_state(ck["gen"])
        state = ck["state"]
        log(f"resumed: phase {state['phase']} step {state['step']} of {state['total']}", fh)
        if getattr(a, "extend_to", None):
            if state["total"] is None or a.extend_to < state["step"]:
                raise SystemExit(
                    f"--extend-to {a.extend_to}: phase {state['phase']} is at step {state['step']} "
                    f"of {state['total'] or 'a schedule not set yet'}; give a step count past the current one"
                )
            log(f"[{state['phase']}] schedule {state['total']} -> {a.extend_to} steps (--extend-to)", fh)
            state["total"] = a.extend_to
            state["extended"] = state["phase"]  # a schedule of steps now, not of --minutes
    else:
        n_params = sum(p.numel() for p in stage.parameters())
        n_exp = sum(p.numel() for n, p in stage.named_parameters() if n.endswith("_master"))
        log(f"config: {json.dumps({k: v for k, v in cfg.to_dict().items() if k != 'quant'})}", fh)
        log(f"layer types: {cfg.layer_types}; params {n_params / 1e6:.2f}M ({n_exp / 1e6:.2f}M routed expert)", fh)
    tap = RouterTap(stage)
    moes = moe_layers(stage)
    k, n_e = cfg.num_experts_per_token, cfg.num_experts
    text = torch.tensor(data.ids["train"], dtype=torch.long)
    crow, cmask = data.chat["train"]
    pool = copy_pool(text, min(tok.special.values()), a.copy_vocab) if getattr(a, "copy_vocab", None) else None
    vrow, vmask = data.chat["val"]

    def batch(phase: str) -> tuple[torch.Tensor, torch.Tensor]:
        rows, T_ = (B, T) if phase == "pretrain" else (CB, CT)
        n_text = rows if phase == "pretrain" else max(1, rows // 4)
        starts = torch.randint(0, len(text) - T_ - 1, (n_text,), generator=gen)
        xs = [text[s : s + T_ + 1] for s in starts.tolist()]
        if a.repeat_share:  # a passage written twice: its second copy is predictable only by copying
            for i in (torch.rand(n_text, generator=gen) < a.repeat_share).nonzero().flatten().tolist():
                xs[i] = repeated(xs[i])
        ms = [torch.ones(T_)] * n_text
        if getattr(a, "random_copy_share", 0):  # random spans written twice: the loss on second copies only
            for i in (torch.rand(n_text, generator=gen) < a.random_copy_share).nonzero().flatten().tolist():
                xs[i], ms[i] = random_copies(T_ + 1, min(tok.special.values()), gen, pool)
        if n_text < rows:
            pick = torch.randint(0, len(crow), (rows - n_text,), generator=gen)
            xs += [crow[i] for i in pick.tolist()]
            ms += [cmask[i] for i in pick.tolist()]
        return torch.stack(xs), torch.stack(ms)

    def step_once(phase: str, step: int, total: int) -> tuple[float, float]:
        peak = a.lr if phase == "pretrain" else a.chat_lr
        for gr in opt.param_groups:
            gr["lr"] = lr_at(step, total, peak, a.warmup if phase == "pretrain" else 10)
        xb, mb = batch(phase)
        lg = forward_batch(stage, xb[:, :-1])
        nll = F.cross_entropy(lg, xb[:, 1:].reshape(-1), reduction="none")
        loss = (nll * mb.reshape(-1)).sum() / mb.sum().clamp(min=1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(stage.parameters(), 1.0)
        opt.step()
        imb = [imbalance(m.last_ids, n_e) for m in moes.values()]
        for i, m in moes.items():
            qb_update(m.gate.e_score_correction_bias.data, tap.scores[i], k, 0.1)
        return float(loss.detach()), sum(imb) / len(imb)

    def checkpoint() -> None:
        save_ckpt(
            ck_path,
            {
                "stage": stage.state_dict(),
                "opt": opt.state_dict(),
                "gen": gen.get_state(),
                "state": state,
                "args": vars(a),
                "config": cfg.to_hf_dict(),
            },
        )

    last_ck = time.time()
    done_here = 0  # steps run by this process (--stop-after-steps)
    for phase, minutes, fixed in (("pretrain", a.minutes, a.steps), ("chat", a.chat_minutes, a.chat_steps)):
        if state["phase"] != phase:
            continue
        if fixed and state["total"] is None:
            state["total"] = fixed
        h = state["hist"][phase]
        t_phase = time.time() - state["elapsed"][phase]
        budget = minutes * 60
        while state["total"] is None or state["step"] < state["total"]:
            step = state["step"]
            loss, imb = step_once(phase, step, state["total"] or 10**9)
            el = time.time() - t_phase
            state["elapsed"][phase] = el
            h["step"].append(step)
            h["loss"].append(loss)
            h["imb"].append(imb)
            h["time"].append(el)
            if step == 4 and state["total"] is None:
                state["t4"] = el
            if state["total"] is None and step == 14:  # the schedule from the speed of steps 5..14
                per = (el - state.pop("t4")) / 10
                state["total"] = max(15, int((budget - el) / (per * (1 + 3.0 / a.eval_every))) + 15)
                log(f"[{phase}] {per:.2f} s/step -> schedule of {state['total']} steps", fh)
            if step % 10 == 0:
                log(f"[{phase}] step {step:5d}  loss {loss:.4f}  imbalance {imb:.2f}  {el:6.0f}s", fh)
            if (step + 1) % a.eval_every == 0 or step + 1 == state["total"]:
                vt = stream_nll(stage, data.ids["val"], T, 24)
                h["val_step"].append(step)
                if phase == "pretrain":
                    h["val_loss"].append(vt)
                    log(f"[{phase}] step {step:5d}  val loss {vt:.4f} (ppl {math.exp(vt):.1f})", fh)
                else:
                    va = masked_nll(stage, vrow[:VAL_CHAT_ROWS], vmask[:VAL_CHAT_ROWS])
                    h["val_loss"].append(va)
                    h["val_text"].append(vt)
                    log(f"[{phase}] step {step:5d}  val answer loss {va:.4f}  val text loss {vt:.4f}", fh)
            state["step"] = step + 1
            done_here += 1
            if (
                a.stop_after_steps
                and done_here >= a.stop_after_steps
                and (state["total"] is None or state["step"] < state["total"])
            ):
                checkpoint()  # as if the process had been killed right after a checkpoint
                log(f"[{phase}] stopping after {done_here} steps (--stop-after-steps); continue with --resume", fh)
                fh.close()
                return 0
            if time.time() - last_ck > a.ckpt_minutes * 60:
                checkpoint()
                last_ck = time.time()
            if not fixed and state.get("extended") != phase and el > budget + 300:  # a fixed one runs whole
                log(f"[{phase}] over the time budget: stopping", fh)
                break
        log(f"[{phase}] {state['step']} steps in {state['elapsed'][phase] / 60:.1f} min", fh)
        state.update(phase="chat" if phase == "pretrain" else "done", step=0, total=None)
        checkpoint()
        last_ck = time.time()
    for hd in tap.handles:
        hd.remove()
    if state["phase"] == "done":
        sd = canonical_state_dict(stage)
        torch.save(
            {
                "config": cfg.to_hf_dict(),
                "state_dict": sd,
                "stage": stage.state_dict(),
                "state": state,
                "args": vars(a),
            },
            run / "master.pt",
        )
        plot(run, state, a)
        log("wrote master.pt", fh)
    fh.close()
    if a.export:
        finish(run, a.export, ring=a.ring)
    return 0


def plot(run: Path, state: dict, a) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    hp, hc = state["hist"]["pretrain"], state["hist"]["chat"]
    off = len(hp["step"])
    fig, ax = plt.subplots(1, 2, figsize=(12, 4))

    def smooth(v, w=20):
        return [sum(v[max(0, i - w + 1) : i + 1]) / len(v[max(0, i - w + 1) : i + 1]) for i in range(len(v))]

    ax[0].plot(hp["step"], smooth(hp["loss"]), label="pretrain: train text (20-step mean)")
    ax[0].plot(hp["val_step"], hp["val_loss"], "o-", ms=3, label="pretrain: validation text")
    if hc["step"]:
        ax[0].plot([s + off for s in hc["step"]], smooth(hc["loss"]), label="chat: train batch (answers + text)")
        ax[0].plot([s + off for s in hc["val_step"]], hc["val_loss"], "s-", ms=3, label="chat: validation answers")
        ax[0].plot([s + off for s in hc["val_step"]], hc["val_text"], "^-", ms=3, label="chat: validation text")
        ax[0].axvline(off, color="gray", ls=":")
    ax[0].set_xlabel("step")
    ax[0].set_ylabel("cross-entropy (nats/token)")
    mins = (state["elapsed"]["pretrain"] + state["elapsed"]["chat"]) / 60
    ax[0].set_title(f"K3 demo on Python docs + man pages ({mins:.0f} min CPU)")
    ax[0].legend(fontsize=8)
    ax[1].plot(hp["step"] + [s + off for s in hc["step"]], hp["imb"] + hc["imb"])
    ax[1].set_xlabel("step")
    ax[1].set_ylabel("max load / mean load (mean over MoE layers)")
    ax[1].set_title("router load imbalance (quantile balancing)")
    fig.tight_layout()
    fig.savefig(run / "loss.png", dpi=110)


# ------------------------------------------------------------------------------------------------ finish
def finish(run: str | Path, export_dir: str | Path, ring: int = 0) -> dict:
    """Export master.pt in the published layout, reload it through the real loader and record its numbers
    (the comparison with the old model and the question set: tools/eval_demo.py)."""
    from tools.eval_demo import evaluate_export

    run = Path(run)
    mk = torch.load(run / "master.pt", weights_only=False)
    cfg = K3Config.from_hf_dict(mk["config"])
    a = argparse.Namespace(**mk["args"])
    # what a warm start continued: recorded in the run when it started, else read before the export replaces it
    if not (run / lineage.FILE).exists():  # a run started before lineage: recorded once, so finishing twice counts once
        lineage.write(run, lineage.runs_through(getattr(a, "init_from", None)))
    earlier = lineage.runs_before(run)
    export(export_dir, cfg, mk["state_dict"], run / "tokenizer", {}, [])
    master = K3Stage(cfg, StagePlan.whole(cfg))  # the training module: float master experts, QAT forward
    init_stage(master, 0)
    master.load_state_dict(mk["stage"] if "stage" in mk else torch.load(run / "ckpt.pt", weights_only=False)["stage"])
    metrics = evaluate_export(run, export_dir, master, mk["state"], a, ring=ring, earlier_runs=earlier)
    (run / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=None, help="wall-time budget of phase 1 (pretraining; 75)")
    ap.add_argument("--chat-minutes", type=float, default=None, help="wall-time budget of phase 2 (chat pairs; 15)")
    ap.add_argument("--run", default="runs/k3-docs")
    ap.add_argument("--export", default=None, help="write the checkpoint here (e.g. p2pk3/assets/k3-docs)")
    ap.add_argument("--corpus", default=None, help="cache file/dir of tools.doc_corpus (default: build)")
    ap.add_argument("--resume", action="store_true", help="continue --run from its ckpt.pt")
    ap.add_argument("--finish", action="store_true", help="skip training: export + evaluate the run's master.pt")
    ap.add_argument("--ring", type=int, default=0, help="with the export: also score through a local ring of N daemons")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=13)
    ap.add_argument("--kda-heads", type=int, default=4)
    ap.add_argument("--kda-dim", type=int, default=32)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--moe-inter", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--chat-batch", type=int, default=None, help="rows per chat-phase batch (default --batch)")
    ap.add_argument("--chat-seq", type=int, default=None, help="tokens per chat-phase row (default --seq)")
    ap.add_argument(
        "--init-from",
        default=None,
        help="warm start from this checkpoint (e.g. p2pk3/assets/k3-docs) or training run folder (its ckpt.pt: a "
        "curriculum of runs, each with its own options): weights, tokenizer",
    )
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--chat-lr", type=float, default=None, help="peak learning rate of phase 2 (1e-3)")
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--ckpt-minutes", type=float, default=10.0)
    ap.add_argument("--steps", type=int, default=None, help="fixed phase-1 steps instead of fitting --minutes")
    ap.add_argument(
        "--chat-steps", type=int, default=None, help="fixed phase-2 steps instead of fitting --chat-minutes"
    )
    ap.add_argument("--stop-after-steps", type=int, default=None, help="stop (with a checkpoint) after N steps")
    ap.add_argument(
        "--renamed-copies",
        type=int,
        default=None,
        help="chat phase: add the conversations about made-up names (doc_corpus.agent.renamed) this many times",
    )
    ap.add_argument(
        "--unquoted-copies",
        type=int,
        default=None,
        help="chat phase: add the tool conversations about man pages and modules (names the question does not "
        "quote) this many times more, with real and with made-up names",
    )
    ap.add_argument(
        "--repeat-share",
        type=float,
        default=0.0,
        help="share of plain-text rows written as a passage twice, a copy task (0: none)",
    )
    ap.add_argument(
        "--random-copy-share",
        type=float,
        default=0.0,
        help="share of plain-text rows replaced by random token spans each written twice, the loss on the "
        "second copies only: a copy task no language model solves without copying (0: none)",
    )
    ap.add_argument(
        "--copy-vocab",
        type=int,
        default=None,
        metavar="N",
        help="--random-copy-share: draw the spans from the train text's N most frequent ids (a copy curriculum: "
        "a small model learns the copy over 128 ids within a few hundred steps and not over 4,064; docs/quality.md)",
    )
    ap.add_argument(
        "--fresh-init",
        choices=sorted(INIT_VARIANTS),
        default="train",
        help="a fresh run's start (tools/trainlib INIT_VARIANTS; mla-fanin learns to copy, docs/quality.md)",
    )
    ap.add_argument(
        "--redraw",
        choices=sorted(set(INIT_VARIANTS) - {"train"}),
        default=None,
        help="with --init-from: draw the tensors this init variant sets afresh, keep the rest (e.g. mla-fanin)",
    )
    ap.add_argument(
        "--extend-to",
        type=int,
        default=None,
        help="with --resume: the current phase's schedule runs to N steps (its cosine stretched from here)",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (2; on --resume, given wins)")
    a = ap.parse_args(argv)
    if a.init_from and a.fresh_init != "train":
        ap.error("--fresh-init sets a fresh run's start; --init-from starts from a checkpoint's weights instead")
    if a.redraw and not a.init_from:
        ap.error("--redraw redraws tensors of a warm start (--init-from); a fresh run takes --fresh-init")
    if a.extend_to is not None and not a.resume:
        ap.error("--extend-to lengthens a resumed run's schedule; a new run takes --steps / --chat-steps")
    if a.finish:
        finish(a.run, a.export, ring=a.ring)
        return 0
    return train(a)


if __name__ == "__main__":
    raise SystemExit(main())

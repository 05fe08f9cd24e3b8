"""tools/train_docs.py on a small synthetic corpus (CI has no Debian doc packages): the chat loss mask covers
exactly the answer, packing keeps every example whole, and a run interrupted after a checkpoint and resumed
ends with exactly the weights of an uninterrupted run."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tools import doc_corpus
from tools import train_docs as td

WORDS = (
    "file directory process signal memory buffer string list value return error mode path user "
    "time number option command output input system call function module object class"
).split()


def synthetic_corpus(tmp: Path) -> Path:
    rng = random.Random(0)
    docs = {}
    for i in range(120):

        def sent(n=10):
            return " ".join(rng.choice(WORDS) for _ in range(n)).capitalize() + "."

        docs[f"man/cmd{i}.1"] = (
            f"NAME\n\ncmd{i} - {sent(5)[:-1].lower()}\n\nDESCRIPTION\n\n{sent()} {sent()}\n\n"
            f"{sent()} {sent()} {sent()}\n"
        )
        docs[f"py/m{i}"] = f"m{i}.f(x)\n\n{sent()} {sent()}\n\n    m{i}.f(3)\n\nm{i}.g()\n\n{sent()} {sent()}\n"
    cache = tmp / "corpus"
    cache.mkdir()
    (cache / "docs.json").write_text(json.dumps(dict(sorted(docs.items()))))
    (cache / "docs.meta.json").write_text(json.dumps({"version": doc_corpus.VERSION, "documents": len(docs)}))
    return cache


ARGS = [
    "--vocab",
    "640",
    "--hidden",
    "64",
    "--layers",
    "5",
    "--kda-heads",
    "2",
    "--kda-dim",
    "16",
    "--experts",
    "4",
    "--moe-inter",
    "32",
    "--batch",
    "4",
    "--seq",
    "64",
    "--steps",
    "6",
    "--chat-steps",
    "4",
    "--eval-every",
    "3",
    "--threads",
    "1",
    "--warmup",
    "2",
]


def test_chat_example_masks_exactly_the_answer(tmp_path):
    from p2pk3.tokenizer import load_tokenizer
    from p2pk3.tokenizer.bpe import save_hf, train_bpe

    save_hf(train_bpe(["What does the ls command do? List the files. " * 50], 300), tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    for system in (None, "Be brief."):
        ids, mask = td.chat_example(tok, "What does the ls command do?", "List the files.", system)
        assert len(mask) == len(ids) - 1 and ids[0] == tok.bos_id and ids[-1] == tok.eos_id
        targets = [t for t, m in zip(ids[1:], mask) if m]
        assert tok.decode(targets) == "List the files.<|im_end|>"  # the answer and its end, nothing else
        assert tok.decode(ids[1 : ids.index(tok.im_end_id) + 1]).startswith(
            "<|im_system|>" if system else "<|im_user|>"
        )
    rows, masks = td.pack_rows(
        [td.chat_example(tok, f"Q{i}?", "A" * (i % 7 + 1), None) for i in range(40)], 48, tok.pad_id, 0
    )
    assert rows.shape[1] == 49 and masks.shape == (rows.shape[0], 48)
    answers = sum(
        tok.decode([int(t) for t, m in zip(r[1:], mk) if m]).count("<|im_end|>") for r, mk in zip(rows, masks)
    )
    assert answers == 40  # every example packed whole, none cut across rows


@pytest.mark.slow
def test_resumed_run_equals_an_uninterrupted_one(tmp_path):
    cache = synthetic_corpus(tmp_path)
    assert td.main(ARGS + ["--run", str(tmp_path / "a"), "--corpus", str(cache)]) == 0
    assert td.main(ARGS + ["--run", str(tmp_path / "b"), "--corpus", str(cache), "--stop-after-steps", "4"]) == 0
    assert not (tmp_path / "b" / "master.pt").exists()  # stopped in phase 1
    assert td.main(["--run", str(tmp_path / "b"), "--resume", "--stop-after-steps", "4"]) == 0  # into phase 2
    assert not (tmp_path / "b" / "master.pt").exists()
    assert td.main(["--run", str(tmp_path / "b"), "--resume"]) == 0
    a = torch.load(tmp_path / "a" / "master.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "master.pt", weights_only=False)
    assert a["state_dict"].keys() == b["state_dict"].keys()
    for k in a["state_dict"]:
        assert torch.equal(a["state_dict"][k], b["state_dict"][k]), k
    for phase in ("pretrain", "chat"):
        assert a["state"]["hist"][phase]["loss"] == b["state"]["hist"][phase]["loss"]
        assert len(a["state"]["hist"][phase]["loss"]) == (6 if phase == "pretrain" else 4)


def test_conversation_example_masks_every_assistant_turn_and_nothing_else(tmp_path):
    """A tool conversation through the shipped template: the loss targets are exactly the assistant's
    parts (its tool-call section, its final answer, each closing <|im_end|>), written out here by hand."""
    from p2pk3.engine.reference import default_model_dir
    from p2pk3.tokenizer import load_tokenizer

    from tools.trainlib.warm_start import upgrade_tokenizer

    tok = load_tokenizer(upgrade_tokenizer(default_model_dir(), tmp_path / "tok"))
    call = {
        "id": "functions.python_doc:0",
        "type": "function",
        "function": {"name": "python_doc", "arguments": '{"name": "len"}'},
    }
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does `len` do?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.python_doc:0", "content": "Return the length of an object."},
        {"role": "assistant", "content": "It returns the length."},
        {"role": "user", "content": "Thanks!"},
        {"role": "assistant", "content": "You are welcome."},
    ]
    ids, mask = td.conversation_example(tok, msgs, [{"type": "function", "function": {"name": "python_doc"}}])
    assert len(mask) == len(ids) - 1 and ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    spans, cur = [], []
    for t, m in zip(ids[1:], mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(tok.decode(cur, skip_special=False))
            cur = []
    assert spans == [
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.python_doc:0<|tool_call_argument_begin|>"
        '{"name": "len"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "It returns the length.<|im_end|>",
        "You are welcome.<|im_end|>",
    ]


def test_warm_start_computes_what_the_exported_checkpoint_computes(tmp_path):
    """--init-from: a trained stage exported (BF16 + MXFP4 experts) and loaded back into a fresh training
    stage gives the logits that the real loader's inference stage gives for the same checkpoint."""
    from p2pk3.checkpoint.tiny import write_checkpoint
    from p2pk3.model.stage import K3Stage, StagePlan
    from tools.trainlib.evaluate import forward_batch, load_shipped
    from tools.trainlib.model import canonical_state_dict, init_stage, tiny_config
    from tools.trainlib.warm_start import export_config, load_export

    cfg = tiny_config(300, 268, 270, 299, hidden=64, layers=5, kda_heads=2, kda_dim=16, experts=4, moe_inter=32)
    trained = K3Stage(cfg, StagePlan.whole(cfg))
    init_stage(trained, seed=1)
    with torch.no_grad():  # weights that are not the init's (a warm start must not be the init by chance)
        for n, p in trained.named_parameters():
            if not n.endswith("A_log"):  # (its padding past the real heads stays zero)
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
    write_checkpoint(tmp_path / "ck", cfg, seed=0, shards=2, state_dict=canonical_state_dict(trained))
    warm = K3Stage(export_config(tmp_path / "ck"), StagePlan.whole(cfg))
    init_stage(warm, seed=7)
    assert load_export(warm, tmp_path / "ck") > 0
    warm.eval()
    x = torch.randint(0, 268, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = forward_batch(load_shipped(tmp_path / "ck"), x)
        got = forward_batch(warm, x)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()
    cold = K3Stage(cfg, StagePlan.whole(cfg))  # the oracle can tell: a stage that did not load differs
    init_stage(cold, seed=7)
    cold.eval()
    with torch.inference_mode():
        assert not torch.allclose(forward_batch(cold, x), want, atol=1e-2)


def test_a_warm_start_counts_every_run_its_weights_went_through(tmp_path, monkeypatch):
    """training_runs.json (tools/trainlib/lineage.py): an export from scratch lists one run; a warm start from
    it that exports into the same folder lists both, the model card sums them, and finishing again counts the
    run once. The oracle is the step counts and shapes of ARGS, multiplied out here. (The card's sample
    answers are cut to 4 tokens: they are not what this checks, and 64 cost most of the test's time.)"""
    from tools import eval_demo
    from tools.trainlib import lineage

    full = eval_demo.answer
    monkeypatch.setattr(eval_demo, "answer", lambda stage, tok, q, max_new=4: full(stage, tok, q, max_new))

    cache = synthetic_corpus(tmp_path)
    model = tmp_path / "model"
    assert td.main(ARGS + ["--run", str(tmp_path / "a"), "--corpus", str(cache), "--export", str(model)]) == 0
    text, chat = 6 * 4 * 64, 4 * 4 * 64  # --steps 6 / --chat-steps 4 of --batch 4 x --seq 64
    one = json.loads((model / lineage.FILE).read_text())
    assert [(r["warm_start"], r["text_tokens"], r["chat_tokens"]) for r in one] == [(False, text, chat)]
    warm = ARGS + ["--run", str(tmp_path / "b"), "--corpus", str(cache), "--init-from", str(model)]
    assert td.main(warm + ["--steps", "3", "--chat-steps", "2", "--export", str(model)]) == 0
    two = json.loads((model / lineage.FILE).read_text())
    assert [(r["warm_start"], r["text_tokens"], r["chat_tokens"]) for r in two] == [
        (False, text, chat),
        (True, text // 2, chat // 2),
    ]
    card = (model / "README.md").read_text()
    assert f"seen {(text + text // 2) / 1e6:.2f}M tokens of text" in card and "in 2 runs" in card
    td.finish(tmp_path / "b", model)  # again: the earlier runs come from the run's own record, not the export
    assert json.loads((model / lineage.FILE).read_text()) == two


def test_tuned_defaults_are_named_in_the_model_card(tmp_path):
    from tools.model_card import refresh_sampling_line
    from tools.tune_defaults import write_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "repetition_penalty": 1.0}))
    (tmp_path / "README.md").write_text(
        "## Sampling defaults\n\n`generation_config.json`: greedy, repetition penalty 1.0, chosen by measurement on"
        " validation questions\n"
    )
    write_defaults(tmp_path, 0.7, 0.9, 1.2)
    card = (tmp_path / "README.md").read_text()
    assert "`generation_config.json`: temperature 0.7, top_p 0.9, repetition penalty 1.2, chosen by measurement" in card
    assert "1.0" not in card
    write_defaults(tmp_path, 0.0, 1.0, 1.0, 0.6)  # the output-only penalty, written and named
    assert json.loads((tmp_path / "generation_config.json").read_text())["frequency_penalty"] == 0.6
    card = (tmp_path / "README.md").read_text()
    assert "`generation_config.json`: greedy, repetition penalty 1.0, frequency penalty 0.6, chosen by" in card
    write_defaults(tmp_path, 0.0, 1.0, 1.2)
    assert "frequency_penalty" not in json.loads((tmp_path / "generation_config.json").read_text())
    assert not refresh_sampling_line(tmp_path / "nowhere")


def test_the_model_card_command_names_every_option_a_run_changed():
    from tools.model_card import budget_flags

    run = {"minutes": 60.0, "chat_minutes": 36.0, "steps": 60, "chat_steps": None, "lr": 5e-4, "chat_lr": 1e-3}
    run |= {"warmup": 20, "chat_batch": 4, "chat_seq": 512, "renamed_copies": 2, "repeat_share": 0.25}
    want = "--minutes 60 --chat-minutes 36 --steps 60 --lr 0.0005 --warmup 20 --chat-batch 4 --chat-seq 512"
    assert (
        budget_flags(run) == want + " --renamed-copies 2 --repeat-share 0.25"
    )  # chat_lr is the default, chat_steps unset
    assert budget_flags({"minutes": 75.0, "chat_minutes": 15.0, "lr": 3e-3}) == "--minutes 75 --chat-minutes 15"
    assert (
        budget_flags({"minutes": 75.0, "chat_minutes": 15.0, "repeat_share": 0.0}) == "--minutes 75 --chat-minutes 15"
    )
    short = {"minutes": 75.0, "chat_minutes": 15.0}
    assert budget_flags(short | {"fresh_init": "train", "redraw": None}) == "--minutes 75 --chat-minutes 15"
    assert budget_flags(short | {"fresh_init": "mla-fanin"}) == "--minutes 75 --chat-minutes 15 --fresh-init mla-fanin"
    assert budget_flags(short | {"redraw": "mla-fanin"}) == "--minutes 75 --chat-minutes 15 --redraw mla-fanin"


def test_a_fresh_start_and_a_redraw_are_refused_where_they_do_not_apply(capsys):
    import pytest

    import tools.train_docs as td

    with pytest.raises(SystemExit) as e:
        td.main(["--init-from", "p2pk3/assets/k3-docs", "--fresh-init", "mla-fanin"])
    assert e.value.code == 2 and "--fresh-init sets a fresh run's start" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        td.main(["--redraw", "mla-fanin"])
    assert e.value.code == 2 and "--redraw redraws tensors of a warm start (--init-from)" in capsys.readouterr().err


@pytest.mark.slow
def test_extend_to_lengthens_a_resumed_schedule_and_nothing_else(tmp_path, capsys):
    """A run planned for 6 steps, stopped at 3 and resumed with --extend-to 8: 8 pretraining steps in all,
    the first 3 exactly those of the planned run, the rest on the cosine of 8 steps, then a chat phase of the
    --chat-steps given on that resume; a count short of where the run is, no --resume, or chat options once
    the chat phase has started are refused."""
    cache = synthetic_corpus(tmp_path)
    base = ARGS + ["--corpus", str(cache)]
    assert td.main(base + ["--run", str(tmp_path / "a"), "--stop-after-steps", "3"]) == 0
    planned = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=False)["state"]
    with pytest.raises(SystemExit) as e:
        td.main(["--run", str(tmp_path / "a"), "--resume", "--extend-to", "2"])
    assert "--extend-to 2: phase pretrain is at step 3 of 6" in str(e.value)
    seen = []
    real = td.lr_at

    def spy(step, total, peak, warmup, floor=0.1):
        seen.append((step, total))
        return real(step, total, peak, warmup, floor)

    td.lr_at = spy
    try:
        args = ["--run", str(tmp_path / "a"), "--resume", "--extend-to", "8", "--threads", "1", "--chat-steps", "3"]
        assert td.main(args) == 0
    finally:
        td.lr_at = real
    m = torch.load(tmp_path / "a" / "master.pt", weights_only=False)
    assert m["state"]["hist"]["pretrain"]["loss"][:3] == planned["hist"]["pretrain"]["loss"]
    assert len(m["state"]["hist"]["pretrain"]["loss"]) == 8 and len(m["state"]["hist"]["chat"]["loss"]) == 3
    assert sorted({s for s in seen if s[1] == 8}) == [(s, 8) for s in range(3, 8)]  # steps 3..7 on 8 (per group)
    assert m["args"]["threads"] == 1 and m["args"]["chat_lr"] == 1e-3  # the run's, not given again
    with pytest.raises(SystemExit) as e:
        td.main(["--run", str(tmp_path / "a"), "--resume", "--chat-lr", "0.01", "--renamed-copies", "1"])
    assert "--chat-lr, --renamed-copies: the run's chat phase has started" in str(e.value)
    with pytest.raises(SystemExit) as e:
        td.main(["--extend-to", "9"])
    assert e.value.code == 2 and "--extend-to lengthens a resumed run's schedule" in capsys.readouterr().err


def test_random_copies_mask_exactly_the_copied_tokens_of_each_second_copy():
    # the oracle: with ids from a huge range two spans never share a token, so each span's length is the
    # one shift at which the row repeats itself; the mask must cover a second copy's tokens after its first
    n, high = 700, 10**9
    row, mask = td.random_copies(n, high, torch.Generator().manual_seed(3))
    row = row.tolist()
    assert len(row) == n and mask.shape == (n - 1,) and set(mask.tolist()) <= {0.0, 1.0}
    assert all(0 <= t < high for t in row)
    want, p, spans = [0.0] * n, 0, 0
    while True:
        ls = [L for L in range(8, 33) if p + 2 * L <= n and row[p : p + L] == row[p + L : p + 2 * L]]
        if not ls:
            break
        assert len(ls) == 1, "two span lengths fit: the spans are not random"
        L = ls[0]
        for j in range(p + L + 1, p + 2 * L):
            want[j] = 1.0
        p, spans = p + 2 * L, spans + 1
    assert spans >= n // 70 and n - p < 64, "the row is not spans written twice to its end"
    assert mask.tolist()[: p - 1] == want[1:p]  # target j - 1 predicts row[j]
    # the cut-off tail: whatever it masks is a copy of a token one span length back
    for j in range(p, n):
        if mask[j - 1]:
            assert any(row[j] == row[j - L] for L in range(8, 33))


def test_random_copies_from_a_pool_draw_only_its_ids_and_mask_the_same_way():
    # a pool of ids far apart (no two spans' tokens collide by chance less than in the range above): every
    # token is a pool id, every pool id turns up, and the row is still spans written twice with the mask on
    # the second copies (checked as in the test above, on the row's own repetitions)
    pool = torch.tensor([5, 17, 400, 4000, 9])
    row, mask = td.random_copies(600, 10**9, torch.Generator().manual_seed(4), pool)
    row = row.tolist()
    assert set(row) == set(pool.tolist())
    for j in range(1, 600):
        if mask[j - 1]:
            assert any(row[j] == row[j - L] and row[j - 1] == row[j - 1 - L] for L in range(8, 33))
    assert 0.3 < float(mask.mean()) < 0.5  # about half of each pair, less the first token of each copy


def test_a_warm_start_from_a_run_folder_takes_its_stage_tokenizer_and_steps(tmp_path):
    """--init-from RUN (a curriculum stage): the stage starts as RUN's ckpt.pt holds it, tensor for tensor, with
    RUN's tokenizer, and the lineage counts RUN's steps so far (3 of 4 x 64 text tokens, no chat yet)."""
    from p2pk3.model.stage import K3Stage, StagePlan
    from tools.trainlib import lineage
    from tools.trainlib.model import init_stage
    from tools.trainlib.warm_start import export_config, load_export

    cache = synthetic_corpus(tmp_path)
    assert td.main(ARGS + ["--run", str(tmp_path / "a"), "--corpus", str(cache), "--stop-after-steps", "3"]) == 0
    held = torch.load(tmp_path / "a" / "ckpt.pt", weights_only=False)["stage"]
    warm = K3Stage(export_config(tmp_path / "a"), StagePlan.whole(export_config(tmp_path / "a")))
    init_stage(warm, seed=7)
    assert load_export(warm, tmp_path / "a") == len(held)
    got = warm.state_dict()
    assert got.keys() == held.keys() and all(torch.equal(got[k], held[k]) for k in held)
    args = ARGS + ["--run", str(tmp_path / "b"), "--corpus", str(cache), "--init-from", str(tmp_path / "a")]
    assert td.main(args + ["--steps", "1", "--chat-steps", "1"]) == 0
    runs = json.loads((tmp_path / "b" / lineage.FILE).read_text())
    assert [(r["warm_start"], r["text_tokens"], r["chat_tokens"]) for r in runs] == [(False, 3 * 4 * 64, 0)]
    for f in ("tokenizer.json",):
        assert (
            json.loads((tmp_path / "b" / "tokenizer" / f).read_text())["model"]
            == json.loads((tmp_path / "a" / "tokenizer" / f).read_text())["model"]
        )

"""The shipped models load through the real loader and still model held-out text as well as when they were
exported: the embedded default `k3-docs` (tools/train_docs.py) and the previous `tiny-k3-pydoc`
(tools/train_tiny.py), which ships beside it. Numbers in docs/quality.md."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2pk3.checkpoint.loader import load_stage_weights  # noqa: E402
from p2pk3.model.cache import Span  # noqa: E402
from p2pk3.model.config import K3Config  # noqa: E402
from p2pk3.model.stage import StagePlan, build_stage  # noqa: E402
from p2pk3.tokenizer import load_tokenizer  # noqa: E402

ASSETS = Path(__file__).resolve().parents[1] / "p2pk3" / "assets"
MAX_MIB = {"k3-docs": 30, "tiny-k3-pydoc": 15}  # the package stays small: a few tens of MB in all


@pytest.fixture(scope="module", params=sorted(MAX_MIB))
def model_dir(request):
    return ASSETS / request.param


def _load(model: Path):
    cfg = K3Config.from_pretrained(model)
    plan = StagePlan.whole(cfg)
    sd = load_stage_weights(model, cfg, plan.layers, embed=True, head=True)
    return cfg, build_stage(cfg, plan, sd), load_tokenizer(model)


@pytest.fixture(scope="module")
def shipped(model_dir):
    return _load(model_dir)


def test_the_default_is_the_docs_model():
    from p2pk3.engine.reference import default_model_dir

    assert default_model_dir() == ASSETS / "k3-docs"


def test_layout_and_size(model_dir):
    MODEL = model_dir
    files = {p.name for p in MODEL.iterdir()}
    assert {
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "README.md",
    } <= files
    index = json.loads((MODEL / "model.safetensors.index.json").read_text())
    text = [n for n in index["weight_map"] if not n.startswith(("vision_tower.", "mm_projector."))]
    assert text and all(n.startswith("language_model.") for n in text)
    assert any(n.endswith(".w1.weight_packed") for n in text)
    assert set(index["weight_map"].values()) <= files
    assert sum(p.stat().st_size for p in MODEL.rglob("*") if p.is_file()) <= MAX_MIB[MODEL.name] * 2**20
    cfg = K3Config.from_pretrained(MODEL)
    assert cfg.model_type == "kimi_k3" and cfg.quant is not None and cfg.attn_res_block_size
    assert cfg.layer_types[-2:] == ("mla", "mla") and cfg.layer_types[0] == "kda" and not cfg.is_moe_layer(0)


def test_tokenizer_round_trip(shipped):
    cfg, _, tok = shipped
    assert tok.vocab_size == cfg.vocab_size
    assert tok.bos_id == cfg.bos_token_id and cfg.eos_token_id in tok.eos_ids
    s = 'The "while" statement is used for repeated execution: while x < 10: x += 1  # ünïcödé 東京'
    assert tok.decode(tok.encode(s)) == s
    ids = tok.apply_chat_template([{"role": "user", "content": "Tell me about lists."}])
    assert (
        tok.decode(ids)
        == "<|im_user|>user<|im_middle|>Tell me about lists.<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )


def test_heldout_perplexity(shipped, model_dir):
    MODEL = model_dir
    _, stage, tok = shipped
    rec = json.loads((MODEL / "heldout_eval.json").read_text())
    ids = ([tok.bos_id] if rec["prepend_bos"] else []) + tok.encode(rec["text"])
    ids = ids[: rec["num_tokens"]]
    assert len(ids) == rec["num_tokens"]
    T, W = rec["window"], rec["windows"]
    x = torch.tensor([ids[w * T : w * T + T + 1] for w in range(W)])
    cache = stage.new_cache(max_sessions=W, max_tokens=W * T, block_size=T)
    spans = []
    for w in range(W):
        cache.open(f"w{w}")
        spans.append(Span(f"w{w}", 0, T))
    with torch.inference_mode():
        logits = stage(spans, cache, tokens=x[:, :-1].reshape(-1), logits="all")
    ppl = math.exp(float(F.cross_entropy(logits.float(), x[:, 1:].reshape(-1))))
    assert ppl <= 1.1 * rec["ppl_mxfp4"], (ppl, rec["ppl_mxfp4"])
    assert ppl >= 0.9 * rec["ppl_mxfp4"], (ppl, rec["ppl_mxfp4"])  # a big "improvement" means the slice changed
    assert ppl < 0.5 * rec["unigram_ppl"], (ppl, rec["unigram_ppl"])


def test_greedy_decode_matches_prefill(shipped):
    """Decoding token by token through the cache gives the same next-token choice as a full prefill."""
    _, stage, tok = shipped
    prompt = [tok.bos_id] + tok.encode('The "for" statement is used to')
    with torch.inference_mode():
        cache = stage.new_cache(max_sessions=2, max_tokens=256, block_size=64)
        cache.open("a")
        lg = stage([Span("a", 0, len(prompt))], cache, tokens=torch.tensor(prompt))
        out = []
        for _ in range(8):
            nxt = int(lg[-1].argmax())
            out.append(nxt)
            lg = stage([Span("a", len(prompt) + len(out) - 1, 1)], cache, tokens=torch.tensor([nxt]))
        cache.open("b")
        full = prompt + out[:-1]
        lg_full = stage([Span("b", 0, len(full))], cache, tokens=torch.tensor(full), logits="all")
    assert lg_full[len(prompt) - 1 :].argmax(-1).tolist() == out
    assert tok.decode(out).strip()  # says something


def test_the_docs_model_answers_in_the_chat_format():
    """Fine-tuned on chat pairs: asked in the chat template, it answers in words and closes with <|im_end|>."""
    _, stage, tok = _load(ASSETS / "k3-docs")
    closed = 0
    # (questions about Python names; about man pages it still loops into code examples: docs/quality.md)
    for q in ("What does `os.dup` do?", "What does `dict.get` do?", "What does `io.open` do?"):
        ids = tok.apply_chat_template([{"role": "user", "content": q}])
        cache = stage.new_cache(max_sessions=1, max_tokens=len(ids) + 130, block_size=64)
        cache.open("q")
        out: list[int] = []
        with torch.inference_mode():
            lg = stage([Span("q", 0, len(ids))], cache, tokens=torch.tensor(ids))
            for _ in range(128):
                nxt = int(lg[-1].argmax())
                out.append(nxt)
                if nxt in tok.eos_ids:
                    break
                lg = stage([Span("q", len(ids) + len(out) - 1, 1)], cache, tokens=torch.tensor([nxt]))
        text = tok.decode([t for t in out if t not in tok.eos_ids])
        assert len(text.split()) >= 5, (q, text)  # a sentence, not an immediate stop
        closed += out[-1] == tok.im_end_id
    assert closed >= 2, "the answers should end with <|im_end|> (the chat fine-tune)"

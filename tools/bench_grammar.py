"""Grammar-engine benchmark: xgrammar vs llguidance, token-mask time per token for response_format.

    PYTHONPATH=. python tools/bench_grammar.py                  # embedded 4,096-id vocab + a 160k BPE vocab
    PYTHONPATH=. python tools/bench_grammar.py --tokens 300 --vocab160 /tmp/v160.json

Needs both engines: `pip install xgrammar llguidance` (only llguidance is a p2pk3 dependency).

For each vocabulary and each case (json_object and three json_schema cases) it compiles the grammar in both
engines (timed), then walks one trajectory of up to --tokens tokens: at each step both engines compute
their next-token bitmask (each timed), the step's token is sampled from seeded random logits under the AND
of the two masks (so both engines do the same work on the same tokens), and both advance. Printed: tokenizer
set-up time, compile time, mean / median / p99 mask time per token of each engine and the ratio
xgrammar / llguidance. Both engines use the same bounded whitespace (at most 32 whitespace characters
between JSON tokens), as `p2pk3.agent.grammar` does.

The 160k vocabulary: no tiktoken vocabulary file ships offline, so a byte-level BPE of 160,000 ids is
trained with `tokenizers` on this Python's own sources (stdlib + a few installed packages, ~130 MB, a few
minutes on two cores), cached at --vocab160 (default: $TMPDIR/p2pk3-bench-v160k.json).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import sysconfig
import tempfile
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from p2pk3.agent.vocab import token_bytes  # noqa: E402
from p2pk3.tokenizer import HFTokenizer, load_tokenizer  # noqa: E402

WS = 32  # bounded whitespace between JSON tokens, both engines

CASES = {
    "json_object": {"type": "object"},
    "flat+enum": {
        "type": "object",
        "additionalProperties": False,
        "required": ["name", "age", "role"],
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer"},
            "role": {"enum": ["admin", "user", "guest"]},
        },
    },
    "nested+arrays": {
        "type": "object",
        "additionalProperties": False,
        "required": ["items", "meta"],
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 6,
                "items": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["id", "tags"],
                    "properties": {
                        "id": {"type": "integer"},
                        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}},
                    },
                },
            },
            "meta": {
                "type": "object",
                "additionalProperties": False,
                "required": ["ok"],
                "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
            },
        },
    },
    "tool-call args": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city", "unit", "days", "include"],
        "properties": {
            "city": {"type": "string", "maxLength": 32},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "include": {"type": "array", "items": {"enum": ["wind", "rain", "uv"]}, "maxItems": 3},
        },
    },
}


def synthetic_vocab(path: pathlib.Path, size: int = 160_000) -> pathlib.Path:
    """A byte-level BPE tokenizer.json of `size` ids trained on local Python sources (cached at path)."""
    if path.exists():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    keep = (
        "transformers",
        "sympy",
        "pip",
        "setuptools",
        "aiohttp",
        "jinja2",
        "rich",
        "click",
        "pygments",
        "hypothesis",
    )
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    files += sorted(p for p in (root / "site-packages").rglob("*.py") if p.parts[len(root.parts) + 1] in keep)
    print(f"training a {size}-id byte-level BPE on {len(files)} local .py files ...", flush=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size - 1,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|eos|>"],
    )
    tok.train_from_iterator((p.read_text(errors="replace") for p in files), trainer)
    if tok.get_vocab_size() < size - 1:
        print(f"  (the corpus gives {tok.get_vocab_size()} ids; padding to {size} with unused ids)")
    tok.save(str(path))
    return path


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, tokens: list[bytes], special: set[int], stop: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        vocab = [b"" if i in special else t for i, t in enumerate(tokens)]  # empty = special: never allowed
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(tokens), stop_token_ids=stop)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self.n = len(tokens)

    def matcher(self, schema: dict):
        g = self.compiler.compile_json_schema(json.dumps(schema), max_whitespace_cnt=WS)
        m = self.xgr.GrammarMatcher(g)
        return m, self.xgr.allocate_token_bitmask(1, self.n)

    def fill(self, m, bm) -> torch.Tensor:
        m.fill_next_token_bitmask(bm)
        return bm

    def accept(self, m, t: int) -> bool:
        return m.accept_token(t)


class LLGuidance:
    """llguidance through p2pk3's own wrapper (p2pk3.agent.grammar), so the figures are the ones we get."""

    name = "llguidance"

    def __init__(self, tokenizer, tokens: list[bytes], stop: list[int]):
        from p2pk3.agent.grammar import GrammarMatcher, GrammarTokenizer

        self.matcher_cls = GrammarMatcher
        self.gtok = GrammarTokenizer(tokenizer, vocab_size=len(tokens), stop_ids=stop)

    def matcher(self, schema: dict):
        m = self.matcher_cls(self.gtok, {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}})
        return m, None

    def fill(self, m, bm) -> torch.Tensor:
        return m.bitmask()

    def accept(self, m, t: int) -> bool:
        m.advance(t)
        return True


def bits(bm: torch.Tensor, n: int) -> torch.Tensor:
    """int32 bitmask (1, ceil(n/32)) -> bool (n,)."""
    shifts = torch.arange(32, dtype=torch.int32)
    return ((bm[0].unsqueeze(1) >> shifts) & 1).bool().flatten()[:n]


def bench(label: str, tokenizer, n_tokens: int, seed: int) -> list[tuple]:
    tokens, special = token_bytes(tokenizer)
    stop = sorted(tokenizer.eos_ids)
    if not stop:  # a vocabulary without an end token (an older cached file): one extra special id ends outputs
        stop = [len(tokens)]
        tokens.append(b"<|eos|>")
        special.add(stop[0])
    engines, rows = [], []
    for make in (lambda: XGrammar(tokenizer, tokens, special, stop), lambda: LLGuidance(tokenizer, tokens, stop)):
        t0 = time.perf_counter()
        engines.append(make())
        cls = type(engines[-1])
        print(f"[{label}] {cls.name}: tokenizer set-up {1e3 * (time.perf_counter() - t0):.0f} ms", flush=True)
    n = len(tokens)
    for case, schema in CASES.items():
        state, compile_ms = [], []
        for e in engines:
            t0 = time.perf_counter()
            state.append(e.matcher(schema))
            compile_ms.append(1e3 * (time.perf_counter() - t0))
        gen = torch.Generator().manual_seed(seed)
        times: list[list[float]] = [[] for _ in engines]
        steps = 0
        for _ in range(n_tokens):
            allowed = torch.ones(n, dtype=torch.bool)
            for k, (e, (m, bm)) in enumerate(zip(engines, state)):
                t0 = time.perf_counter()
                mask = e.fill(m, bm)
                times[k].append(time.perf_counter() - t0)
                allowed &= bits(mask, n)
            if not allowed.any():
                break
            logits = torch.randn(n, generator=gen).masked_fill(~allowed, float("-inf"))
            t = int(torch.multinomial(torch.softmax(logits, 0), 1, generator=gen))
            ok = [e.accept(m, t) for e, (m, _) in zip(engines, state)]
            if not all(ok):
                raise RuntimeError(f"{case}: token {t} accepted by {ok}")
            steps += 1
            if t in stop:
                break
        for k, e in enumerate(engines):
            first, us = 1e3 * times[k][0], [1e6 * x for x in times[k][1:]] or [float("nan")]
            rows.append(
                (
                    label,
                    case,
                    e.name,
                    compile_ms[k],
                    first,
                    steps,
                    statistics.mean(us),
                    statistics.median(us),
                    sorted(us)[int(0.99 * (len(us) - 1))],
                )
            )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=200, help="tokens per trajectory (max)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--vocab160", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()) / "p2pk3-bench-v160k.json"
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    import importlib.metadata as md

    try:  # imported before the timed set-up
        import llguidance  # noqa: F401
        import xgrammar  # noqa: F401
    except ImportError as e:
        sys.exit(f"bench_grammar needs both engines: pip install xgrammar llguidance ({e})")

    print("xgrammar", md.version("xgrammar"), "| llguidance", md.version("llguidance"), "| torch", torch.__version__)
    embedded = load_tokenizer(ROOT / "p2pk3/assets/k3-docs")
    v160 = HFTokenizer(synthetic_vocab(args.vocab160), {"eos_token": "<|eos|>"})
    rows = bench(f"embedded {embedded.vocab_size}", embedded, args.tokens, args.seed)
    rows += bench(f"bpe {v160.vocab_size}", v160, args.tokens, args.seed)
    print(
        "\ncompile: building the matcher for the schema; first mask: the first token's mask (llguidance builds "
        "its lexer lazily there);\nmean/p50/p99: every later token's mask"
    )
    print(
        f"{'vocab':<14} {'case':<15} {'engine':<11} {'compile ms':>10} {'1st mask ms':>11} {'tokens':>6} "
        f"{'mean us':>8} {'p50 us':>8} {'p99 us':>8}"
    )
    for r in rows:
        print(
            f"{r[0]:<14} {r[1]:<15} {r[2]:<11} {r[3]:>10.1f} {r[4]:>11.1f} {r[5]:>6} {r[6]:>8.1f} {r[7]:>8.1f} "
            f"{r[8]:>8.1f}"
        )
    print(
        "\nratios xgrammar / llguidance (> 1: llguidance faster); on a shared machine the median is the figure to trust"
    )
    print(f"{'vocab':<14} {'case':<15} {'p50 mask':>9} {'mean mask':>10} {'compile+1st mask':>17}")
    for a, b in zip(rows[::2], rows[1::2]):
        print(f"{a[0]:<14} {a[1]:<15} {a[7] / b[7]:>9.2f} {a[6] / b[6]:>10.2f} {(a[3] + a[4]) / (b[3] + b[4]):>17.2f}")


if __name__ == "__main__":
    main()

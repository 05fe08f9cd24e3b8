"""In-process engine: a chain of stages on this host (one stage = the whole model, or several layer
ranges that pass a Hop exactly as the ring does). Used by `p2pk3 score`, the tests, and as the
single-process oracle the distributed ring must match."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from p2pk3 import default_model_dir  # noqa: F401  (re-exported: the embedded default model)
from p2pk3.checkpoint.stage import load_stage
from p2pk3.model.cache import Span
from p2pk3.model.config import K3Config
from p2pk3.model.stage import K3Stage, StagePlan

from .sampler import SessionSampler, grammar_tokenizer
from .sampling import SamplingParams, fresh_seed, sample_at


def configure_cpu_threads(cfg: K3Config, threads: int | None = None) -> int:
    """Intra-op threads for CPU runs. Small models run far faster on one thread: their ops are too small to
    split, and on a loaded machine OpenMP workers spinning for a core cost 10-100x (measured: a tiny-K3
    decode step 26 ms on 1 thread vs 2.1 s on 2 threads with the other core busy). Explicit `threads` wins;
    P2PK3_THREADS overrides the automatic choice."""
    import os

    if threads is None:
        env = os.environ.get("P2PK3_THREADS")
        threads = int(env) if env else (1 if cfg.hidden_size < 2048 else (os.cpu_count() or 1))
    torch.set_num_threads(max(1, threads))
    return threads


class Pipeline:
    """Stages run one after another in this process, each with its own bounded cache."""

    def __init__(self, stages: list[K3Stage], max_sessions: int = 16, max_tokens: int = 8192, block_size: int = 64):
        self.stages = stages
        self.cfg = stages[0].cfg
        self.caches = [s.new_cache(max_sessions, max_tokens, block_size) for s in stages]
        self.suffix_index = None  # speculative decoding with `suffix`: made on first use, kept across calls
        self.last_stats: list[dict] = []  # per prompt, after a speculative generate
        self.last_logprobs: list[list | None] = []  # per prompt, after generate: TokenLogprobs when asked
        self.model_dir: Path | None = None  # (load sets it) the tokenizer of requests with a grammar

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        n_stages: int = 1,
        dtype="float32",
        device="cpu",
        plans: list[StagePlan] | None = None,
        formats=None,
        compile: bool | None = None,
        dequant_experts: bool | None = None,
        **cache_kw,
    ) -> "Pipeline":
        """`compile`: the stages' compiled decode step (p2pk3.model.compiled; None: on for CUDA, off on the CPU,
        P2PK3_COMPILE=1/0 overrides); `dequant_experts`: MXFP4 experts held dequantized (None: `checkpoint.stage.default_dequant_experts`)."""
        from p2pk3.deploy.integrity import check_checkpoint  # the shards against the manifest, as a node does

        cfg = K3Config.from_pretrained(model_dir)
        check_checkpoint(model_dir)
        if torch.device(device).type == "cpu":
            configure_cpu_threads(cfg)
        plans = plans or StagePlan.split_even(cfg, n_stages)
        pipe = cls(
            [
                load_stage(model_dir, p, dtype, device, cfg, formats, compile=compile, dequant_experts=dequant_experts)
                for p in plans
            ],
            **cache_kw,
        )
        pipe.model_dir = Path(model_dir)
        return pipe

    def _samplers(self, params: list[SamplingParams]) -> list[SessionSampler | None]:
        """The sampler of each session whose parameters go beyond sample_at (None: sample_at itself)."""
        out = []
        for p in params:
            if not (p.stateful or p.penalized or p.logprobs is not None):
                out.append(None)
                continue
            gtok = None
            if p.grammar is not None:
                if self.model_dir is None:
                    raise ValueError("a grammar needs the checkpoint's tokenizer: load the pipeline with Pipeline.load")
                gtok = grammar_tokenizer(self.model_dir, self.cfg.vocab_size)
            out.append(SessionSampler(p, gtok))
        return out

    @staticmethod
    def _draw(smp, row, params: SamplingParams, hist: list[int], n_prompt: int, lps: list | None) -> int:
        """The token after `hist` (the session's prompt + output so far), as the last stage draws it."""
        if smp is None:
            return sample_at(row, params, len(hist))
        smp.feed(len(smp.ids), hist[len(smp.ids) :], n_prompt)
        tok, lp = smp.sample(row, len(hist))
        if lps is not None:
            lps.append(lp)
        return tok

    def open(self, session: str) -> None:
        opened = []
        try:
            for c in self.caches:
                c.open(session)
                opened.append(c)
        except Exception:
            for c in opened:
                c.free(session)
            raise

    def close(self, session: str) -> None:
        for c in self.caches:
            if c.has(session):
                c.free(session)

    def length(self, session: str) -> int:
        return self.caches[0].get(session).length

    @torch.inference_mode()
    def forward(self, spans: list[Span], tokens: torch.Tensor, logits: str = "last") -> torch.Tensor:
        hop = None
        for stage, cache in zip(self.stages, self.caches):
            out = stage(spans, cache, tokens=tokens if stage.plan.embed else None, hop=hop, logits=logits)
            hop = out
        return out

    # ------------------------------------------------------------------ convenience
    def score(self, tokens: list[int], incremental: bool = False, session: str = "score") -> torch.Tensor:
        """Logits [T, V] (fp32) for every position, by one prefill or token by token (decode path)."""
        self.open(session)
        try:
            t = torch.tensor(tokens, dtype=torch.long)
            if not incremental:
                return self.forward([Span(session, 0, len(tokens))], t, logits="all")
            return torch.cat(
                [self.forward([Span(session, i, 1)], t[i : i + 1], logits="all") for i in range(len(tokens))]
            )
        finally:
            self.close(session)

    def _prefill(self, prompts: list[list[int]], ids: list[str], prefill_chunk: int) -> list[torch.Tensor]:
        """Chunked prefill of the sessions `ids` (opened): the last position's logits of each prompt."""
        pos, last = [0] * len(prompts), [None] * len(prompts)
        while any(pos[i] < len(p) for i, p in enumerate(prompts)):
            spans, toks, who = [], [], []
            for i, p in enumerate(prompts):
                if pos[i] < len(p):
                    n = min(prefill_chunk, len(p) - pos[i])
                    spans.append(Span(ids[i], pos[i], n))
                    toks.extend(p[pos[i] : pos[i] + n])
                    pos[i] += n
                    who.append(i)
            lg = self.forward(spans, torch.tensor(toks, dtype=torch.long))
            for row, i in enumerate(who):
                last[i] = lg[row]
        return last

    def generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams] | SamplingParams,
        prefill_chunk: int = 512,
        *,
        proposers: dict | None = None,
        draft_policy: str = "fixed",
    ) -> list[list[int]]:
        """Batched generation: prompts prefilled together (in chunks), then one decode step per round for
        every live session. Sessions whose params ask to `speculate` draft up to `draft_tokens` tokens per
        step that the same forward verifies (same tokens as without; `last_stats` has the counts).
        `proposers`: method -> factory of a session's proposer (default p2pk3.spec's); `draft_policy`:
        "fixed" (always draft_tokens, where the proposer has them) or "adaptive" (p2pk3.spec.draft_len)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if any(not p for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling parameter sets")
        ids = [f"gen{i}" for i in range(len(prompts))]
        params = [
            p if p.seed is not None or p.temperature == 0 else SamplingParams(**{**p.__dict__, "seed": fresh_seed()})
            for p in params
        ]
        smp = self._samplers(params)
        self.last_logprobs = [[] if p.logprobs is not None else None for p in params]
        if any(p.speculating for p in params):
            return self._generate_spec(prompts, params, ids, prefill_chunk, proposers or {}, draft_policy, smp)
        outs: list[list[int]] = [[] for _ in prompts]
        for s in ids:
            self.open(s)
        try:
            last = self._prefill(prompts, ids, prefill_chunk)
            live = [i for i in range(len(prompts)) if params[i].max_tokens > 0]
            while live:
                nxt = []
                for i in live:
                    tok = self._draw(
                        smp[i], last[i], params[i], prompts[i] + outs[i], len(prompts[i]), self.last_logprobs[i]
                    )
                    outs[i].append(tok)
                    if tok in params[i].stop_ids or len(outs[i]) >= params[i].max_tokens:
                        continue
                    nxt.append(i)
                live = nxt
                if not live:
                    break
                spans = [Span(ids[i], len(prompts[i]) + len(outs[i]) - 1, 1) for i in live]
                lg = self.forward(spans, torch.tensor([outs[i][-1] for i in live], dtype=torch.long))
                for row, i in enumerate(live):
                    last[i] = lg[row]
            return outs
        finally:
            for s in ids:
                self.close(s)

    def _generate_spec(self, prompts, params, ids, prefill_chunk, proposers, draft_policy, smp) -> list[list[int]]:
        """`generate` with speculative decoding: each round, every live session's last token plus its drafted
        tokens go through the stages as one span (a verify pass, with a rollback checkpoint on every stage);
        the longest prefix plain decoding would have produced is accepted, plus the token after it, and
        the caches are rolled back to the accepted position before the session's next span."""
        import time

        from p2pk3.spec.draft_len import DraftLength, PassCost
        from p2pk3.spec.proposers import NgramProposer, SuffixIndex, SuffixProposer
        from p2pk3.spec.verify import verify_draft

        if self.suffix_index is None:
            self.suffix_index = SuffixIndex()
        make = {"ngram": NgramProposer, "suffix": lambda: SuffixProposer(self.suffix_index), **proposers}
        prop = [make[p.speculate]() if p.speculating else None for p in params]
        dlen = [DraftLength() for _ in params]
        cost, vcost = PassCost(), PassCost()  # passes without / with drafts (another compute path)
        stats = [
            {
                "speculate": p.speculate,
                "proposed": 0,
                "accepted": 0,
                "passes": 0,
                "pass_tokens": 0,
                "draft_ns": 0,
                "drafts": 0,
            }
            for p in params
        ]
        for i, p in enumerate(params):
            if p.speculate == "suffix":
                self.suffix_index.add(prompts[i])
        outs: list[list[int]] = [[] for _ in prompts]
        for s in ids:
            self.open(s)
        try:
            last = self._prefill(prompts, ids, prefill_chunk)

            def take(i: int, toks: list[int]) -> bool:  # append up to a stop id / max_tokens; True: go on
                for t in toks:
                    outs[i].append(t)
                    stats[i]["pass_tokens"] += 1
                    if t in params[i].stop_ids or len(outs[i]) >= params[i].max_tokens:
                        return False
                return True

            for st in stats:
                st["passes"] += 1  # the prefill's last pass samples the first token
            live = [
                i
                for i in range(len(prompts))
                if params[i].max_tokens > 0
                and take(i, [self._draw(smp[i], last[i], params[i], prompts[i], len(prompts[i]), self.last_logprobs[i])])
            ]
            while live:
                spans, toks, drafts = [], [], []
                width, drafting = len(live), False
                for i in live:
                    hist = prompts[i] + outs[i]
                    p = len(hist) - 1  # position of the last accepted token, not yet in the caches
                    if self.length(ids[i]) > p:  # the previous pass's tail was rejected
                        for stage, cache in zip(self.stages, self.caches):
                            stage.rollback(cache, ids[i], p)
                    d: list[int] = []
                    kmax = min(params[i].draft_tokens, params[i].max_tokens - len(outs[i]) - 1)
                    if prop[i] is not None and kmax > 0:
                        k = (
                            kmax
                            if draft_policy == "fixed"
                            else dlen[i].choose(
                                kmax,
                                lambda k, w=width, v=drafting: (
                                    (vcost.estimate(w + k) or cost.estimate(w + k)) if v or k else cost.estimate(w)
                                ),
                            )
                        )
                        if k:
                            t0 = time.perf_counter_ns()
                            d = list(prop[i].propose(hist, k))[:k]
                            stats[i]["draft_ns"] += time.perf_counter_ns() - t0
                            stats[i]["drafts"] += 1
                    width += len(d)
                    drafting = drafting or bool(d)
                    spans.append(Span(ids[i], p, 1 + len(d), verify=bool(d)))
                    toks.extend([hist[-1], *d])
                    drafts.append(d)
                t0 = time.perf_counter()
                lg = self.forward(spans, torch.tensor(toks, dtype=torch.long), logits="all")
                (vcost if drafting else cost).observe(width, 1000 * (time.perf_counter() - t0))
                nxt, r = [], 0
                for i, sp, d in zip(live, spans, drafts):
                    rows = lg[r : r + sp.length]
                    r += sp.length
                    hist = prompts[i] + outs[i]
                    if d and smp[i] is not None:
                        smp[i].feed(len(smp[i].ids), hist[len(smp[i].ids) :], len(prompts[i]))
                        acc, tok, lps = smp[i].verify(rows, d, sp.start)
                        if self.last_logprobs[i] is not None:
                            self.last_logprobs[i].extend(lps)
                    elif d:
                        acc, tok = verify_draft(rows, d, params[i], sp.start)
                    else:
                        acc = []
                        tok = self._draw(smp[i], rows[-1], params[i], hist, len(prompts[i]), self.last_logprobs[i])
                    st = stats[i]
                    if prop[i] is not None:
                        dlen[i].observe(len(d), len(acc))
                    st["proposed"] += len(d)
                    st["accepted"] += len(acc)
                    st["passes"] += 1
                    if take(i, acc + [tok]):
                        nxt.append(i)
                live = nxt
            for i, p in enumerate(params):
                if p.speculate == "suffix" and outs[i]:
                    self.suffix_index.add(prompts[i][-8:] + outs[i])
            self.last_stats = [
                {
                    "speculate": st["speculate"],
                    "proposed": st["proposed"],
                    "accepted": st["accepted"],
                    "acceptance": st["accepted"] / st["proposed"] if st["proposed"] else None,
                    "passes": st["passes"],
                    "tokens_per_pass": st["pass_tokens"] / st["passes"] if st["passes"] else None,
                    "draft_us": st["draft_ns"] / 1000 / st["drafts"] if st["drafts"] else None,
                }
                for st in stats
            ]
            return outs
        finally:
            for s in ids:
                self.close(s)


def nll(logits: torch.Tensor, tokens: Iterable[int]) -> tuple[float, float]:
    """Mean next-token NLL over positions 0..T-2 and its perplexity."""
    t = torch.tensor(list(tokens), dtype=torch.long)
    loss = torch.nn.functional.cross_entropy(logits[:-1].float(), t[1:])
    return float(loss), float(torch.exp(loss))

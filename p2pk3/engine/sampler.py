"""One session's sampling where its tokens are drawn (the last pipeline stage, and the single-process
engine): penalties, logit_bias, the grammar mask, min_p, logprobs, around `sample_at`.

    smp = SessionSampler(params, grammar_tokenizer)      # per session (and epoch)
    smp.feed(start_pos, ids, output_from)                # the session's token ids, as the entry sends them
    token, lp = smp.sample(row, pos)                     # the token at `pos` from logits row (V,); lp: TokenLogprob | None
    accepted, token, lps = smp.verify(rows, draft, start)  # speculative decoding, drafts checked under the mask
    entries = smp.prompt_logprobs(rows, start, top)      # echo: the prompt tokens the rows predict

The order (vLLM's): logit_bias, repetition penalty (prompt + output), frequency / presence penalties
(output), the grammar mask, then `sample_at` (temperature, min_p, top-k, top-p, the (seed, position)
draw). Logprobs are those of the model's own distribution (the raw row, before all of that), as OpenAI
and vLLM report them; only the chosen token's and the top-N travel.

**State.** The history is the session's ids by position (`feed` overwrites from `start_pos` on, so a
rolled-back draft or a replay is undone by the next segment); the output is the ids from `output_from`.
The grammar matcher is kept in step with the output before each draw (`_sync`: it rolls back to the
common prefix and advances over the rest), so after a replay (a new epoch: prompt + output prefilled
again) the new holder rebuilds it from the ids alone, and a rejected draft never stays in it. A session
without grammar, penalties or prompt logprobs needs no history (`SamplingParams.stateful` is False) and
samples exactly as `sample_at` does: neutral parameters give bit-identical tokens.

Speculation: draft token i is accepted when it is what sampling under the mask (and the penalties, with
the drafts before it counted as output) draws at its position; the first mismatch is replaced by that
draw. So the accepted tokens are the ones plain decoding gives, and every one the grammar allows.

Used by p2pk3/node/stage_runner.py (the last stage) and p2pk3/engine/reference.py (so "ring == one
process" stays true with these parameters).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from p2pk3.agent.grammar import GrammarMatcher, GrammarTokenizer, GrammarViolation, matcher_for
from p2pk3.agent.logprobs import token_logprobs
from p2pk3.agent.penalties import Penalties, apply_penalties

from p2pk3.params import SamplingParams, TokenLogprob

from .sampling import sample_at

__all__ = ["SessionSampler", "SamplerError", "grammar_tokenizer"]


class SamplerError(ValueError):
    """The session's sampling cannot go on (a grammar that does not compile, ids that contradict the
    grammar, a gap in the history): only that session fails."""


_lock = threading.Lock()


@functools.lru_cache(maxsize=4)
def _load_gtok(model_dir: str, vocab_size: int) -> GrammarTokenizer:
    from p2pk3.tokenizer import ChatTokenizer

    return GrammarTokenizer(ChatTokenizer.from_pretrained(model_dir), vocab_size=vocab_size)


def grammar_tokenizer(model_dir: str | Path, vocab_size: int) -> GrammarTokenizer:
    """The grammar engine's view of a checkpoint's tokenizer (built once per process: ~3 s at 160k ids)."""
    with _lock:
        return _load_gtok(str(Path(model_dir).resolve()), int(vocab_size))


def _entries(lp, n: int) -> list[TokenLogprob]:
    return [
        TokenLogprob(lp.ids[i], lp.logprobs[i], tuple(lp.top_ids[i]), tuple(lp.top_logprobs[i])) for i in range(n)
    ]


UNKNOWN = -1  # a prompt position's id the sampler was not sent (below a cached prefix; never read)


class SessionSampler:
    """The sampling state of one session (module doc). `params` may come later than the first ids (a
    prompt's chunks before its last carry ids but nothing to sample): `configure` then."""

    def __init__(self, params: SamplingParams | None = None, gtok: GrammarTokenizer | None = None):
        self.ids: list[int] = []
        self.output_from = 0
        self.params: SamplingParams | None = None
        self.penalties: Penalties | None = None
        self.matcher: GrammarMatcher | None = None
        if params is not None:
            self.configure(params, gtok)

    def configure(self, params: SamplingParams, gtok: GrammarTokenizer | None = None) -> None:
        """Set the session's parameters (compiles the grammar; SamplerError if it does not compile)."""
        if params.needs_prompt_ids and UNKNOWN in self.ids[: self.output_from]:
            raise SamplerError(
                "this session started at a cached prefix, but its sampling (repetition penalty, prompt logprobs) "
                "needs the whole prompt's ids"
            )
        self.params = params
        pen = Penalties(
            params.frequency_penalty,
            params.presence_penalty,
            params.repetition_penalty,
            0.0,  # min_p is applied after the temperature, by sample_at
            dict(params.logit_bias),
        )
        self.penalties = None if pen.neutral else pen
        self.matcher = None
        if params.grammar is not None:
            if gtok is None:
                raise SamplerError("this stage has no tokenizer for the grammar engine (structured outputs)")
            try:
                self.matcher = matcher_for(gtok, params.grammar)
            except ValueError as e:  # GrammarError
                raise SamplerError(str(e)) from None

    # -- history -----------------------------------------------------------------------------------------
    def feed(self, start: int, ids: Sequence[int], output_from: int) -> None:
        """The ids at positions start .. start + len(ids) - 1 (what a segment carries). A session that starts at
        a cached prefix (p2pk3/node/prefix_match.py) begins inside its prompt: when the sampler needs no
        prompt ids (`SamplingParams.needs_prompt_ids`), the positions below are held as UNKNOWN."""
        if len(self.ids) < start <= output_from and (self.params is None or not self.params.needs_prompt_ids):
            self.ids.extend([UNKNOWN] * (start - len(self.ids)))
        if start > len(self.ids):  # (position 0 always fits: a replay starts there)
            raise SamplerError(
                f"the sampler knows positions 0..{len(self.ids) - 1} of the session, not {start} "
                "(a segment's ids were lost on the way)"
            )
        del self.ids[start:]
        self.ids.extend(int(t) for t in ids)
        self.output_from = output_from

    def _history(self, pos: int) -> None:
        if len(self.ids) < pos:
            raise SamplerError(f"the sampler knows {len(self.ids)} ids of the session; position {pos} needs {pos}")

    def _sync(self, pos: int) -> None:
        """The matcher has accepted exactly the output before `pos`."""
        m = self.matcher
        want = self.ids[self.output_from : pos]
        have = m.tokens
        k = 0
        for a, b in zip(have, want):
            if a != b:
                break
            k += 1
        if k < len(have):
            m.rollback(len(have) - k)
        try:
            for t in want[k:]:
                if not self._constrained:  # a stop token ended the grammar: the rest is free
                    break
                m.advance(t)
        except GrammarViolation as e:
            raise SamplerError(f"the session's output so far is not allowed by its grammar: {e}") from None

    # -- drawing -----------------------------------------------------------------------------------------
    def _processed(self, row: torch.Tensor, pos: int, extra: Sequence[int] = ()) -> torch.Tensor:
        """The row after penalties and the grammar mask; `extra`: output ids after the history (drafts)."""
        if self.penalties is None and self.matcher is None:
            return row
        x = row.detach().float().clone()
        if self.penalties is not None:
            out = self.ids[self.output_from : pos] + list(extra)
            prompt = [self.ids[: self.output_from]] if self.params.needs_prompt_ids else None
            apply_penalties(x[None], [self.penalties], prompt_ids=prompt, output_ids=[out])
        if self._constrained:
            self.matcher.apply(x)
        return x

    @property
    def _constrained(self) -> bool:
        """The grammar masks the next token: it has one, and no stop token has ended it yet (what follows a
        stop token, with ignore_eos, is free)."""
        m = self.matcher
        return m is not None and not (m.tokens and m.tokens[-1] in m.gtok.stop_ids)

    def _draw(self, row: torch.Tensor, pos: int, extra: Sequence[int] = ()) -> int:
        constrained = self._constrained
        tok = sample_at(self._processed(row, pos, extra), self.params, pos)
        if constrained:
            try:
                self.matcher.advance(tok)
            except GrammarViolation as e:  # a mask that allows nothing at all (cannot happen with a valid grammar)
                raise SamplerError(str(e)) from None
        return tok

    def _logprobs(self, rows: torch.Tensor, toks: list[int]) -> list[TokenLogprob] | None:
        if self.params.logprobs is None:
            return None
        return _entries(token_logprobs(rows, toks, self.params.logprobs), len(toks))

    def sample(self, row: torch.Tensor, pos: int) -> tuple[int, TokenLogprob | None]:
        """The token at `pos` (the history must hold positions 0 .. pos - 1 when the session is stateful)."""
        if self.params.stateful:
            self._history(pos)
        if self.matcher is not None:
            self._sync(pos)
        tok = self._draw(row, pos)
        lps = self._logprobs(row[None], [tok])
        return tok, (lps[0] if lps else None)

    def verify(
        self, rows: torch.Tensor, draft: Sequence[int], start: int
    ) -> tuple[list[int], int, list[TokenLogprob] | None]:
        """rows (k+1, V) of positions start .. start+k (the last accepted token at `start`, then the draft)
        -> (accepted drafts, the token after them, their logprobs)."""
        k = len(draft)
        if rows.shape[0] != k + 1:
            raise ValueError(f"{k} drafted tokens need {k + 1} logits rows, got {rows.shape[0]}")
        if self.params.stateful:
            self._history(start + 1)
        if self.matcher is not None:
            self._sync(start + 1)
        acc: list[int] = []
        for i in range(k + 1):
            tok = self._draw(rows[i], start + i + 1, acc)
            if i == k or tok != draft[i]:
                break
            acc.append(tok)
        if len(self.ids) == start + 1:  # the entry takes the accepted drafts; its next segment starts after them
            self.ids.extend(acc)
        lps = self._logprobs(rows[: len(acc) + 1], acc + [tok])
        return acc, tok, lps

    def prompt_logprobs(self, rows: torch.Tensor, start: int, top: int) -> tuple[int, list[TokenLogprob]]:
        """(first position, entries) of the prompt tokens that rows (n, V) of positions start .. start+n-1
        predict (each row the next position's id, where it is known and is in the prompt)."""
        last = min(start + rows.shape[0] + 1, len(self.ids), self.output_from) - 2  # the last row that predicts one
        n = last - start + 1
        if n <= 0:
            return start + 1, []
        lp = token_logprobs(rows[:n], self.ids[start + 1 : start + 1 + n], top)
        return start + 1, _entries(lp, n)

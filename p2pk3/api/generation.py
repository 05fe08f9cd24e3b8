"""One generation request as a stream of text pieces, with stop sequences, usage and timing metrics.

    gen = Generation(cluster, tok, prompt_ids, params, stops, metrics, route, t_arrival)
    async with gen:                         # leaving the block cancels the request in the ring if it runs
        async for piece in gen.pieces():    # one str per generated token ("" while text is held back)
            ...
    gen.finish_reason, gen.completion_tokens

Tokens arrive from `Cluster.generate` (its `on_token` callback) into a queue; each is detokenized with the
tokenizer's stream decoder (complete characters only, special tokens dropped but for `keep_ids`, the
thinking and tool-call markers the answer's parsers read) and passed through the
stop-sequence matcher. A stop id (end of turn / EOS) ends the text: finish_reason "stop" (the ring ends the
session itself). A stop *sequence* match ends the text before it, and cancels the request in the ring (its
caches are freed). Running out of `max_tokens` is finish_reason "length". A cluster error before the first
token or during the stream is raised as ApiError from `pieces()`.

Logprobs (when the params ask): each token's `TokenLogprob` arrives with it; `logprobs` holds those of the
tokens that are part of the answer (not a stop id, nothing after a stop sequence), `take_logprobs()` the
ones not yet sent (a stream chunk carries those); `prompt_logprobs` (echo) is the reply's, once done.
"""

from __future__ import annotations

import asyncio
import time

from p2pk3.params import SamplingParams

from .stops import StopMatcher

_DONE = object()


class Generation:
    def __init__(
        self,
        cluster,
        tok,
        prompt_ids: list[int],
        params: SamplingParams,
        stops: list[str],
        metrics,
        route: str,
        t_arrival: float,
        keep_ids: frozenset[int] = frozenset(),
    ):
        self.cluster, self.tok = cluster, tok
        self.prompt_ids, self.params = prompt_ids, params
        self.matcher = StopMatcher(stops)
        self.keep_ids = keep_ids  # special tokens kept in the text (the markers of api/answer.py)
        self.metrics, self.route, self.t_arrival = metrics, route, t_arrival
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.text_parts: list[str] = []
        self._q: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._t_last: float | None = None
        self._arrived: list = []  # TokenLogprob per token received (on_logprob comes right after on_token)
        self.logprobs: list = []  # those of the answer's tokens
        self._sent_lps = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the ring took from its prefix cache (the entry's stats; 0 when the request was
        cancelled before its end, e.g. by a stop sequence)."""
        t = self._task
        if t is None or not t.done() or t.cancelled() or t.exception() is not None:
            return 0
        return int((getattr(t.result(), "stats", None) or {}).get("cached_tokens") or 0)

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    async def __aenter__(self) -> "Generation":
        extra = {}
        if self.params.logprobs is not None:  # (only then: a cluster object may not know the keyword)
            extra["on_logprob"] = lambda _t, lp: self._arrived.append(lp)
        self._task = asyncio.ensure_future(
            self.cluster.generate(self.prompt_ids, self.params, on_token=self._q.put_nowait, **extra)
        )
        self._task.add_done_callback(lambda _: self._q.put_nowait(_DONE))
        self.metrics.prompt.labels(self.route).inc(self.prompt_tokens)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.cancel()

    async def cancel(self) -> None:
        """Cancel the request in the ring (when it still runs) and wait until the cancel frame is out."""
        t = self._task
        if t is not None and not t.done():
            t.cancel()
            try:
                await t
            except BaseException:  # noqa: BLE001 - the cancelled request's own outcome does not matter
                pass

    def _timing(self) -> None:
        now = time.perf_counter()
        if self._t_last is None:
            self.metrics.ttft.labels(self.route).observe(now - self.t_arrival)
        else:
            self.metrics.itl.labels(self.route).observe(now - self._t_last)
        self._t_last = now
        self.metrics.generated.labels(self.route).inc()

    async def pieces(self):
        dec = self.tok.stream_decoder(keep=self.keep_ids)
        stop_ids = set(self.params.stop_ids)
        last = None
        while True:
            item = await self._q.get()
            if item is _DONE:
                break
            last = int(item)
            self.completion_tokens += 1
            self._timing()
            if self.finish_reason is not None:
                continue  # after a stop id: nothing more is text
            if last in stop_ids:
                self.finish_reason = "stop"
                yield self._emit(self.matcher.push(dec.flush()) + self.matcher.flush())
                continue
            if self.completion_tokens <= len(self._arrived):
                self.logprobs.append(self._arrived[self.completion_tokens - 1])
            text = self.matcher.push(dec.push(last))
            if self.matcher.stopped is not None:
                self.finish_reason = "stop"
                yield self._emit(text)
                if self.params.prompt_logprobs is None:
                    await self.cancel()
                    return
                await asyncio.wait([self._task])  # echo: the prompt's logprobs come with the reply's end
                return
            yield self._emit(text)
        exc = self._task.exception() if not self._task.cancelled() else None
        if exc is not None:
            raise exc
        if self.finish_reason is None:
            tail = self.matcher.push(dec.flush())
            if self.matcher.stopped is None:
                tail += self.matcher.flush()
            self.finish_reason = (
                "stop"
                if self.matcher.stopped is not None
                else ("length" if self.completion_tokens >= self.params.max_tokens else "stop")
            )
            if tail:
                yield self._emit(tail)

    def take_logprobs(self) -> list:
        """The answer's logprob entries not taken yet (what the next stream chunk carries)."""
        out = self.logprobs[self._sent_lps :]
        self._sent_lps = len(self.logprobs)
        return out

    @property
    def prompt_logprobs(self) -> list | None:
        """The prompt tokens' logprob entries (echo), once the request is done; None when not asked."""
        t = self._task
        if t is None or not t.done() or t.cancelled() or t.exception() is not None:
            return None
        return t.result().prompt_logprobs

    def _emit(self, text: str) -> str:
        if text:
            self.text_parts.append(text)
        return text

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

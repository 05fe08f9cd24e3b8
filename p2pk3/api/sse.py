"""Server-sent events as OpenAI streams them: `data: {json}\\n\\n` per chunk, `data: [DONE]\\n\\n` at the end."""

from __future__ import annotations

import json

from aiohttp import web


class SSE:
    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            },
        )

    @classmethod
    async def after_first(cls, request: web.Request, pieces) -> tuple["SSE", object]:
        """(the opened stream, the first piece or None): the stream opens only after the generation's first
        piece, so an error before the first token is still a plain HTTP error."""
        try:
            first = await pieces.__anext__()
        except StopAsyncIteration:
            first = None
        sse = cls(request)
        await sse.open()
        return sse, first

    async def open(self) -> None:
        await self.response.prepare(self.request)

    async def send(self, obj: dict, event: str | None = None) -> None:
        """One event (named `event` when given); raises ConnectionResetError when the client has gone away."""
        head = b"event: " + event.encode() + b"\n" if event else b""
        await self.response.write(
            head + b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
        )

    async def end(self) -> None:
        """The end of a stream without OpenAI's [DONE] (Anthropic's streams end after message_stop)."""
        await self.response.write_eof()

    async def done(self) -> None:
        await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()

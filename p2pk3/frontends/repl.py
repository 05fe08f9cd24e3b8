"""The chat REPL: a conversation with the cluster, one turn at a time.

    code = run_chat(client_factory, PromptBuilder.from_pretrained(model_dir), SamplingOverrides(max_tokens=256))

`client_factory` is an async callable returning a connected `Client` (`ring.client`, or a lambda around
`Client.for_topology(topo)`); it is called again after the connection to the entry was lost. Each turn
builds the prompt of the whole conversation through frontends/prompt.py (the checkpoint's chat template,
stop ids and generation_config defaults, as every front end does) and streams the answer through the
tokenizer's stream decoder (never half a UTF-8 character), then prints a one-line footer with the time
to first token and the decode speed.

On a terminal: readline history (saved in `history_file`), a line ending in `\\` continues on the next
line, a `\"\"\"` line opens a block that the next `\"\"\"` line closes, Ctrl-C during an answer stops it
(the request is cancelled in the ring, its caches freed) and keeps the REPL, Ctrl-C at the prompt drops
the line, Ctrl-D quits. Without a terminal each input line is one message (or a slash command) and each
answer is printed on its own line, footers go to stderr, so it can be scripted:

    printf 'What is a list?\\n/quit\\n' | p2pk3 chat --topology ring.toml

Slash commands: /reset, /system TEXT (no TEXT: no system prompt), /temp X, /max N, /stats, /help, /quit.

With `tools` (a frontends/tool_use.py ToolUse, `p2pk3 chat --tools docs`) every prompt declares them; when
the model calls one, the call and the start of its result are shown in one bracketed line (on stderr when
scripted), the result goes back to the model, and its next generation is shown, until it answers in text.
"""

from __future__ import annotations

import asyncio
import math
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Awaitable, Callable, TextIO

from p2pk3.node.client import RequestError, why
from p2pk3.params import MAX_TEMPERATURE, SamplingParams

from .prompt import PromptBuilder, PromptError, SamplingOverrides

PROMPT, MORE = ">>> ", "... "
BLOCK = '"""'
HELP = """commands:
  /reset          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt (/system alone removes it)
  /temp X         sampling temperature (0 = greedy)
  /max N          most tokens per answer
  /stats          the last answer's timings, this session's totals, the entry's status
  /quit           leave (also Ctrl-D)
a line ending in \\ continues on the next line; \"\"\" opens and closes a multi-line block;
Ctrl-C stops an answer"""


def banner(model: str) -> str:
    """The one greeting of every chat (p2pk3 chat, p2pk3 local --chat) on a terminal."""
    return f"chat with {model}: /help for commands, /quit or Ctrl-D to leave, Ctrl-C stops an answer"


class CommandError(ValueError):
    """A slash command used wrongly (said in one line; the REPL goes on)."""


@dataclass
class Conversation:
    sampling: SamplingOverrides  # what the user set (None fields: the checkpoint's defaults)
    system: str | None = None
    messages: list[dict] = field(default_factory=list)
    last: dict | None = None  # stats of the last answer
    last_params: SamplingParams | None = None  # what the last answer was sampled with
    answers: int = 0
    generated: int = 0
    stopped: int = 0

    def prompt(self, user: str) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system else []
        return [*sys_msg, *self.messages, {"role": "user", "content": user}]


def command(conv: Conversation, line: str) -> str | None:
    """Apply a slash command; returns the text to show, or None for /quit. Raises CommandError."""
    name, _, arg = line.strip().partition(" ")
    arg = arg.strip()
    if name in ("/quit", "/exit"):
        return None
    if name == "/help":
        return HELP
    if name == "/reset":
        n = len(conv.messages)
        conv.messages.clear()
        return f"[conversation reset: {n} messages forgotten]"
    if name == "/system":
        conv.system = arg or None
        return f"[system prompt: {arg!r}]" if arg else "[no system prompt]"
    if name == "/temp":
        try:
            t = float(arg)
            if not math.isfinite(t):
                raise ValueError
            conv.sampling = replace(conv.sampling, temperature=t)
        except ValueError:  # not a number, or outside the range (PromptError)
            raise CommandError(
                f"/temp takes a number in [0, {MAX_TEMPERATURE:g}], e.g. /temp 0.7 (got {arg!r})"
            ) from None
        return f"[temperature {t:g}]"
    if name == "/max":
        try:
            n = int(arg)
            if n < 1:
                raise ValueError
        except ValueError:
            raise CommandError(f"/max takes a whole number >= 1, e.g. /max 256 (got {arg!r})") from None
        conv.sampling = replace(conv.sampling, max_tokens=n)
        return f"[at most {n} tokens per answer]"
    if name == "/stats":
        return stats_text(conv)
    raise CommandError(f"unknown command {name!r} (/help lists them)")


def footer(stats: dict, n: int) -> str:
    ttft, tps = stats.get("ttft_s"), stats.get("decode_tokens_per_s")
    parts = [f"{n} tokens", f"time to first token {1000 * ttft:.0f} ms" if ttft is not None else "no token"]
    if tps:
        parts.append(f"{tps:.1f} tok/s")
    return "[" + " · ".join(parts) + "]"


def stats_text(conv: Conversation, status: dict | None = None) -> str:
    lines = [
        f"answers: {conv.answers} ({conv.stopped} stopped), tokens generated: {conv.generated}, "
        f"messages in the conversation: {len(conv.messages)}"
    ]
    if conv.last_params is not None:
        p = conv.last_params
        lines.append(
            f"sampling: temperature {p.temperature:g}, top_k {p.top_k}, top_p {p.top_p:g}, max {p.max_tokens} tokens"
        )
    else:
        a = conv.sampling
        shown = [
            f"{k} {'default' if v is None else f'{v:g}'}"
            for k, v in (("temperature", a.temperature), ("top_k", a.top_k), ("top_p", a.top_p), ("max", a.max_tokens))
        ]
        lines.append("sampling (default: the model's generation_config): " + ", ".join(shown))
    if conv.last and conv.last.get("stopped"):
        lines.append(f"last answer: stopped after {conv.last['generated_tokens']} tokens (no timings)")
    elif conv.last:
        s = conv.last
        lines.append(
            "last answer: "
            + footer(s, s.get("generated_tokens", 0))[1:-1]
            + f" · prompt {s.get('prompt_tokens', '?')} tokens"
            + (f" ({s['cached_tokens']} cached)" if s.get("cached_tokens") is not None else "")
            + f" · total {s.get('total_s') or 0:.2f} s"
        )
    if status:
        lines.append(
            f"entry {status.get('slot')} ({status.get('node')}): {status.get('live_sessions', 0)} live "
            f"sessions, {status.get('finished', 0)} finished, {status.get('cancelled', 0)} stopped by "
            f"their client, {status.get('failed', 0)} failed, "
            f"{status.get('tokens', 0)} tokens computed"
        )
    return "\n".join(lines)


class LineReader:
    """Input lines: readline on a terminal (with continuation and blocks), plain lines otherwise."""

    def __init__(self, stdin: TextIO, out: TextIO, interactive: bool, history_file: str | Path | None):
        self.stdin, self.out, self.interactive = stdin, out, interactive
        self.history_file = Path(history_file).expanduser() if history_file else None
        self.readline = None
        if interactive:
            try:
                import readline

                self.readline = readline
            except ImportError:  # pragma: no cover - no readline on this platform: plain input()
                pass
            if self.readline and self.history_file and self.history_file.exists():
                try:
                    self.readline.read_history_file(str(self.history_file))
                except OSError:
                    pass

    def save_history(self) -> None:
        if self.readline and self.history_file:
            try:
                self.history_file.parent.mkdir(parents=True, exist_ok=True)
                self.readline.set_history_length(1000)
                self.readline.write_history_file(str(self.history_file))
            except OSError:
                pass

    def _line(self, prompt: str) -> str:
        if self.interactive:
            return input(prompt)  # EOFError on Ctrl-D, KeyboardInterrupt on Ctrl-C
        line = self.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    def read(self) -> str:
        """One message (possibly several lines). EOFError at the end of input."""
        first = self._line(PROMPT)
        if not self.interactive:
            return first
        if first.strip() == BLOCK:
            lines = []
            while (line := self._line(MORE)).strip() != BLOCK:
                lines.append(line)
            return "\n".join(lines)
        lines = [first]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            lines.append(self._line(MORE))
        return "\n".join(lines)


class Chat:
    def __init__(
        self,
        client_factory: Callable[[], Awaitable],
        prompts: PromptBuilder,
        sampling: SamplingOverrides,
        *,
        system: str | None,
        out: TextIO,
        err: TextIO,
        interactive: bool,
        tools=None,
    ):
        self.factory, self.prompts = client_factory, prompts
        self.conv = Conversation(sampling, system)
        self.out, self.err, self.interactive = out, err, interactive
        self.client = None
        self.tools = tools  # a frontends.tool_use.ToolUse, or None
        self.turn: list[dict] = []  # this turn's tool calls and results (before the final answer)

    def say(self, text: str, *, err: bool = False) -> None:
        stream = self.err if err else self.out
        stream.write(text + "\n")
        stream.flush()

    async def connect(self) -> None:
        if self.client is None:
            self.client = await self.factory()

    async def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    async def status(self) -> dict | None:
        try:
            await self.connect()
            return await asyncio.wait_for(self.client.status(), 5.0)
        except Exception:  # noqa: BLE001 - /stats shows what it can
            return None

    async def answer(self, user: str, got: list[int]) -> dict:
        """Stream one answer; the tokens land in `got` as they arrive (kept when cancelled). With tools, a
        generation that calls them is followed by their results and another generation (at most
        `max_rounds` times); `got` then holds the last generation's tokens, `self.turn` the calls."""
        await self.connect()
        self.turn = []
        use = self.tools
        for rnd in range((use.max_rounds if use else 0) + 1):
            p = self.prompts.chat(self.conv.prompt(user) + self.turn, self.conv.sampling, use and use.schemas)
            self.conv.last_params = p.params
            got.clear()
            reader = use.reader() if use else None
            stats, shown = await self._stream(p, got, reader)
            if reader is None or not reader.calls or rnd == use.max_rounds:
                return stats
            msgs = use.run(reader.calls, shown.strip())
            self.turn += msgs
            if shown.strip():
                self.out.write("\n")
            for call, res in zip(reader.calls, msgs[1:]):
                self.say(use.describe(call, res["content"]), err=not self.interactive)
        raise AssertionError("unreachable")

    async def _stream(self, p, got: list[int], reader) -> tuple[dict, str]:
        """One generation, shown as it streams: (its stats, the text shown). `reader`: a ToolReader that
        hides tool-call markup, or None (special tokens and stop ids are not shown)."""
        dec = self.prompts.tok.stream_decoder()
        stops = set(p.params.stop_ids)
        shown: list[str] = []

        def on_token(t: int) -> None:
            got.append(t)
            text = reader.feed(t) if reader else (dec.push(t) if t not in stops else "")
            shown.append(text)
            self.out.write(text)
            self.out.flush()

        try:
            reply = await self.client.generate(p.ids, p.params, on_token=on_token)
        finally:
            rest = reader.finish() if reader else dec.flush()
            shown.append(rest)
            self.out.write(rest)
            self.out.flush()
        return reply.stats, "".join(shown)

    def finish(self, user: str, got: list[int], stats: dict | None) -> None:
        p = self.conv.last_params
        text = self.prompts.answer_text(got, p.stop_ids if p is not None else None)
        self.conv.messages += [{"role": "user", "content": user}, *self.turn, {"role": "assistant", "content": text.strip()}]
        self.turn = []
        self.conv.answers += 1
        self.conv.generated += len(got)
        self.out.write("\n")
        if stats is None:
            self.conv.stopped += 1
            self.conv.last = {"stopped": True, "generated_tokens": len(got)}
            self.say(f"[stopped after {len(got)} tokens]", err=not self.interactive)
        else:
            self.conv.last = dict(stats, generated_tokens=len(got))
            self.say(footer(stats, len(got)), err=not self.interactive)


def run_chat(
    client_factory: Callable[[], Awaitable],
    prompts: PromptBuilder,
    sampling: SamplingOverrides | None = None,
    *,
    system: str | None = None,
    stdin: TextIO | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
    interactive: bool | None = None,
    history_file: str | Path | None = "~/.p2pk3_chat_history",
    banner: str | None = None,
    tools=None,
) -> int:
    """Run the REPL until /quit or the end of input; returns 0. ConnectionError when the cluster cannot be
    reached at the start (later losses are reported and the next message reconnects). Must run in the main
    thread (Ctrl-C stops an answer through SIGINT)."""
    stdin, out, err = stdin or sys.stdin, out or sys.stdout, err or sys.stderr
    if interactive is None:
        interactive = stdin.isatty()
    if interactive and threading.current_thread() is threading.main_thread():
        # Ctrl-C must stop an answer even when we were started with SIGINT ignored (a background job of a
        # non-interactive shell inherits SIG_IGN; asyncio.Runner then installs no handler)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    chat = Chat(
        client_factory,
        prompts,
        sampling or SamplingOverrides(),
        system=system,
        out=out,
        err=err,
        interactive=interactive,
        tools=tools,
    )
    reader = LineReader(stdin, out, interactive, history_file if interactive else None)
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover
        runner = asyncio.Runner()
    with runner:
        try:
            runner.run(chat.connect())
        except RequestError as e:
            raise ConnectionError(f"could not reach the cluster: {e.message}") from None
        except (OSError, TimeoutError) as e:
            raise ConnectionError(f"could not reach the cluster: {why(e)}") from None
        if banner and interactive:
            chat.say(banner)
        try:
            return _loop(chat, reader, runner)
        finally:
            reader.save_history()
            runner.run(chat.close())


def _loop(chat: Chat, reader: LineReader, runner: asyncio.Runner) -> int:
    while True:
        try:
            text = reader.read()
        except EOFError:
            if chat.interactive:
                chat.say("")
            return 0
        except KeyboardInterrupt:  # at the prompt: drop the line
            chat.say("")
            continue
        if not text.strip():
            continue
        if text.lstrip().startswith("/"):
            try:
                shown = command(chat.conv, text)
            except CommandError as e:
                chat.say(f"error: {e}", err=not chat.interactive)
                continue
            if shown is None:
                return 0
            if text.split()[0] == "/stats":
                shown = stats_text(chat.conv, runner.run(chat.status()))
            chat.say(shown, err=not chat.interactive)
            continue
        got: list[int] = []
        t0 = time.monotonic()
        try:
            stats = runner.run(chat.answer(text, got))
        except KeyboardInterrupt:
            chat.out.write(" ^C")
            chat.finish(text, got, None)
            continue
        except PromptError as e:  # the conversation no longer fits the context, ...
            chat.say(f"error: {e} (/reset starts a new conversation)", err=True)
            continue
        except RequestError as e:
            chat.say(f"\nerror: {e}", err=True)
            if e.code == "connection_lost":
                runner.run(chat.close())  # reconnect on the next message
            continue
        except (OSError, TimeoutError) as e:
            chat.say(f"\nerror: the cluster did not answer ({e}) after {time.monotonic() - t0:.1f} s", err=True)
            runner.run(chat.close())
            continue
        chat.finish(text, got, stats)

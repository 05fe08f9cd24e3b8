"""`p2pk3 chat`: the REPL through a pseudo-terminal and through a pipe, against a live 2-node ring."""

import asyncio
import os
import re
import subprocess
import sys
import time

import pytest
from click.testing import CliRunner

from p2pk3.cli import main
from p2pk3.engine.reference import default_model_dir
from p2pk3.frontends.repl import CommandError, Conversation, LineReader, command
from conftest import local_ring
from p2pk3.frontends.prompt import SamplingOverrides
from p2pk3.params import SamplingParams
from p2pk3.tokenizer import ChatTokenizer

pexpect = pytest.importorskip("pexpect")

CHAT = [sys.executable, "-P", "-m", "p2pk3.cli", "chat", "--no-history"]


@pytest.fixture(scope="module")
def ring():
    with local_ring(nodes=2) as r:
        yield r


@pytest.fixture(scope="module")
def tok():
    return ChatTokenizer.from_pretrained(default_model_dir())


def greedy_answer(ring, tok, messages, max_tokens):
    """The answer the chat should print: greedy with the checkpoint's own repetition, frequency and presence
    penalties (its generation_config defaults, which the chat applies too)."""
    d = tok.generation_defaults
    pen = dict(
        repetition_penalty=d.repetition_penalty,
        frequency_penalty=d.frequency_penalty,
        presence_penalty=d.presence_penalty,
    )

    async def go():
        c = await ring.client()
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True)
            params = SamplingParams(max_tokens=max_tokens, stop_ids=tok.stop_ids, **pen)
            return await c.generate(ids, params)
        finally:
            c.close()

    r = asyncio.run(go())
    return tok.decode([t for t in r.tokens if t not in tok.stop_ids], skip_special=True)


def wait_idle(ring, deadline_s=15.0):
    """Every stage has freed every session (the cancel reached the whole ring)."""
    deadline = time.monotonic() + deadline_s
    while True:
        sts = asyncio.run(ring.statuses())
        if all(st and st["sessions"] == 0 for st in sts.values()) and sts["s0"].get("live_sessions") == 0:
            return sts
        assert time.monotonic() < deadline, f"sessions still held after a cancel: {sts}"
        time.sleep(0.2)


# ---------------------------------------------------------------- without a ring
def test_slash_commands_change_the_conversation():
    conv = Conversation(SamplingOverrides(max_tokens=10))
    conv.messages += [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert "2 messages" in command(conv, "/reset") and conv.messages == []
    command(conv, "/system be brief")
    assert conv.prompt("hi") == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    command(conv, "/system")
    assert conv.system is None
    command(conv, "/temp 0.7")
    command(conv, "/max 5")
    assert (conv.sampling.temperature, conv.sampling.max_tokens) == (0.7, 5)
    assert command(conv, "/quit") is None
    for bad in ("/temp -1", "/temp nan", "/temp x", "/temp 2.5", "/max 0", "/max 1.5", "/frobnicate"):
        with pytest.raises(CommandError):
            command(conv, bad)
    assert (conv.sampling.temperature, conv.sampling.max_tokens) == (0.7, 5)
    command(conv, "/temp 2")  # the top of the range the CLI and the API accept
    assert conv.sampling.temperature == 2.0


def test_line_reader_continuation_and_blocks(monkeypatch):
    lines = iter(["first \\", "second", '"""', "x", "", "y", '"""'])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    r = LineReader(sys.stdin, sys.stdout, interactive=True, history_file=None)
    assert r.read() == "first \nsecond"
    assert r.read() == "x\n\ny"


def test_usage_errors_are_one_line(tmp_path):
    runner = CliRunner()
    for args, code, says in (
        (["chat"], 2, "give one of"),
        (["chat", "--connect", "nohost", "--secret-file", "x"], 2, "not HOST:PORT"),
        (["chat", "--connect", "127.0.0.1:1"], 2, "needs the secret"),
    ):
        r = runner.invoke(main, args)
        assert r.exit_code == code and says in r.output and "Traceback" not in r.output, r.output
    secret = tmp_path / "k"
    secret.write_text("0" * 64)
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    r = runner.invoke(
        main, ["chat", "--connect", f"127.0.0.1:{port}", "--secret-file", str(secret), "--no-history"], input="hi\n"
    )
    assert r.exit_code == 1 and "could not reach the cluster" in r.output and "Traceback" not in r.output, r.output


# ---------------------------------------------------------------- against a live ring
@pytest.mark.slow
def test_repl_on_a_terminal(ring, tmp_path):
    env = dict(os.environ, TERM="dumb", HOME=str(tmp_path))
    args = CHAT[1:] + ["--topology", str(ring.topology), "--temperature", "1", "--seed", "1", "--max-tokens", "2000"]
    c = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=60, cwd=str(tmp_path))
    try:
        c.expect_exact(">>> ")
        # a long answer, stopped by Ctrl-C once it streams: the REPL stays, the ring frees the session
        c.sendline("Write a long list of Python built-in functions.")
        c.expect_exact("functions.\r\n")
        c.expect(r"\S{4}")  # streamed text, long before 2000 tokens are done
        c.sendintr()
        c.expect(r"\[stopped after (\d+) tokens\]")
        assert 0 < int(c.match.group(1)) < 2000
        c.expect_exact(">>> ")
        wait_idle(ring)
        # another question, as a """ block: the answer streams, then the footer
        c.sendline("/max 12")
        c.expect_exact("[at most 12 tokens per answer]")
        for line in ('"""', "What is", "a list?", '"""'):
            c.sendline(line)
        c.expect(r"\r\n(.*)\r\n\[(\d+) tokens · time to first token (\d+) ms · [\d.]+ tok/s\]")
        assert c.match.group(1).strip() and 0 < int(c.match.group(2)) <= 12
        c.expect_exact(">>> ")
        c.sendline("/stats")
        c.expect(r"answers: 2 \(1 stopped\).*messages in the conversation: 4")
        c.expect(r"entry s0 \(s0@")
        c.expect_exact(">>> ")
        c.sendline("/system be \\")
        c.expect_exact("... ")
        c.sendline("brief")
        c.expect_exact("[system prompt: 'be \\nbrief']")
        c.sendline("/reset")
        c.expect_exact("[conversation reset: 4 messages forgotten]")
        c.sendline("/quit")
        c.expect(pexpect.EOF)
    finally:
        c.close(force=True)
    assert c.exitstatus == 0


@pytest.mark.slow
def test_piped_stdin_one_message_per_line(ring, tok):
    script = "What is a list?\n/temp x\nWhat is a tuple?\n/stats\n/quit\nnever sent\n"
    r = subprocess.run(
        CHAT + ["--topology", str(ring.topology), "--max-tokens", "16"],
        input=script,
        text=True,
        capture_output=True,
        timeout=120,
        cwd=ring.workdir,
    )
    assert r.returncode == 0, r.stderr
    first = greedy_answer(ring, tok, [{"role": "user", "content": "What is a list?"}], 16)
    history = [
        {"role": "user", "content": "What is a list?"},
        {"role": "assistant", "content": first.strip()},
        {"role": "user", "content": "What is a tuple?"},
    ]
    second = greedy_answer(ring, tok, history, 16)
    assert r.stdout == first + "\n" + second + "\n"  # each answer on its line, nothing else on stdout
    turn2 = tok.apply_chat_template(history, add_generation_prompt=True)
    assert f"prompt {len(turn2)} tokens" in r.stderr  # the whole conversation was rendered for the second turn
    # /stats: the second turn started from the stages' prefix cache: at least all of the first prompt but its
    # last token (after the first reply too where its rendering repeats the generated tokens exactly)
    cached = int(re.search(rf"prompt {len(turn2)} tokens \((\d+) cached\)", r.stderr).group(1))
    assert len(tok.apply_chat_template(history[:1], add_generation_prompt=True)) - 1 <= cached < len(turn2)
    footers = [ln for ln in r.stderr.splitlines() if ln.startswith("[") and "time to first token" in ln]
    assert len(footers) == 2 and "error: /temp takes a number" in r.stderr
    wait_idle(ring)


@pytest.mark.slow
def test_connect_with_secret_file(ring):
    h, p = ring.entry_addr
    r = CliRunner().invoke(
        main,
        [
            "chat",
            "--connect",
            f"{h}:{p}",
            "--secret-file",
            str(ring.workdir / "secret"),
            "--max-tokens",
            "4",
            "--no-history",
        ],
        input="What is a list?\n",
    )
    assert r.exit_code == 0 and r.stdout.strip() and "[4 tokens" in r.stderr, (r.output, r.exception)

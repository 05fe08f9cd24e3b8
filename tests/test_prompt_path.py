"""One prompt path (p2pk3/frontends/prompt.py): the same question asked through `p2pk3 generate` (in-process
and with --nodes), `p2pk3 local --prompt`, the chat REPL (`p2pk3 chat --local`) and the OpenAI API reaches
the model as the same prompt ids with the same stop ids and the same sampling parameters: the
checkpoint's generation_config for what the user left unset, the user's values for what they set.

The oracle is independent of p2pk3's tokenizer code: the checkpoint's chat template rendered with jinja2
as transformers renders it (sandbox, trim_blocks, lstrip_blocks), tokenized by the `tokenizers` library
(special-token strings the template wrote become their ids), and transformers' own apply_chat_template
where it is installed. The front ends run for real up to the model: the pipeline / ring / cluster they
would talk to is replaced by a recorder of what they send (no daemons, no forward pass)."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from conftest import run
from p2pk3.cli import main
from p2pk3.engine.reference import default_model_dir
from p2pk3.frontends.prompt import PromptBuilder, PromptError, SamplingOverrides
from p2pk3.params import DEFAULT_MAX_TOKENS, MAX_TEMPERATURE

SHIPPED = default_model_dir()
QUESTION = "What does the with statement do?"
# Not the K3 format: a default system prompt, block tags on their own lines (trim_blocks matters), BOS first.
TEMPLATE = """{{ bos_token }}
{% for m in messages %}
    {% if loop.first and m['role'] != 'system' %}
<|im_system|>system<|im_middle|>You answer questions about Python.<|im_end|>
    {% endif %}
    {% if m['role'] == 'user' %}
<|im_user|>{{ m['content'] }}<|im_end|>
    {% elif m['role'] == 'system' %}
<|im_system|>{{ m['content'] }}<|im_end|>
    {% else %}
<|im_assistant|>{{ m['content'] }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_assistant|>
{% endif %}"""
GENERATION = {"do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """The shipped model's config and tokenizer with its own chat template (chat_template.jinja) and a
    generation_config that samples."""
    d = tmp_path_factory.mktemp("model")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (d / name).symlink_to(SHIPPED / name)
    (d / "chat_template.jinja").write_text(TEMPLATE)
    cfg = json.loads((SHIPPED / "tokenizer_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**GENERATION, "eos_token_id": [cfg["eos_token_id"]]}))
    return d


def oracle(model: Path, messages: list[dict]) -> tuple[list[int], set[int]]:
    """(prompt ids, stop ids) computed without p2pk3: jinja2 + tokenizers, and transformers if present."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from tokenizers import Tokenizer

    cfg = json.loads((model / "tokenizer_config.json").read_text())
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string((model / "chat_template.jinja").read_text()).render(
        messages=messages, add_generation_prompt=True, bos_token=cfg["bos_token"], eos_token=cfg["eos_token"]
    )
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = tok.encode(text, add_special_tokens=False).ids
    assert text.count("<|im_end|>") == ids.count(tok.token_to_id("<|im_end|>")) > 0  # the template's specials
    try:
        import transformers
    except ImportError:
        pass
    else:
        hf = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(model / "tokenizer.json"),
            bos_token=cfg["bos_token"],
            eos_token=cfg["eos_token"],
            chat_template=TEMPLATE,
        )
        assert hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False) == ids
    gen = json.loads((model / "generation_config.json").read_text())
    # generation_config's eos ids, the eos token, the end-of-turn token the template writes after an answer,
    # the stop_token_ids p2pk3's own tokenizer_config lists
    stops = {
        *gen["eos_token_id"],
        tok.token_to_id(cfg["eos_token"]),
        tok.token_to_id("<|im_end|>"),
        *cfg.get("stop_token_ids", []),
    }
    return ids, stops


# ------------------------------------------------------------------ recorders in place of the model
class Recorder:
    """What the front ends send to the model: one (prompt ids, SamplingParams) per request."""

    def __init__(self):
        self.sent: list[tuple[list[int], object]] = []

    def reply(self, ids, params):
        self.sent.append((list(ids), params))
        return list(params.stop_ids[:1])  # the answer: a stop token at once


class FakeClient:
    def __init__(self, rec: Recorder):
        self.rec = rec

    async def generate(self, ids, params, on_token=None, **kw):
        toks = self.rec.reply(ids, params)
        for t in toks:
            if on_token:
                on_token(t)
        return SimpleNamespace(tokens=toks, stats={"prompt_tokens": len(ids), "ttft_s": 0.0}, stage_stats={})

    async def status(self):
        return {}

    def close(self):
        pass


def fake_ring_class(rec: Recorder):
    class FakeRing:
        entry_addr, topology, log_dir, secret, procs, failed = ("127.0.0.1", 1), "ring.toml", "/tmp", b"", [], False
        topo = SimpleNamespace(slots=[], active=[])

        def __init__(self, mdir, nodes, **kw):
            pass

        def start(self):
            return self

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

        def exited(self):
            return []

        async def client(self):
            return FakeClient(rec)

    return FakeRing


class FakeCluster:
    def __init__(self, rec: Recorder):
        self.rec = rec

    async def generate(self, ids, params, on_token=None):
        for t in self.rec.reply(ids, params):
            on_token(t)


@pytest.fixture
def rec(monkeypatch):
    rec = Recorder()
    import p2pk3.engine.reference as reference
    import p2pk3.node.local as local

    class FakePipeline:
        last_stats = [{}]

        @classmethod
        def load(cls, *a, **kw):
            return cls()

        def generate(self, prompts, params, **kw):
            return [rec.reply(p, params) for p in prompts]

    async def no_probe(*a, **kw):
        return None

    monkeypatch.setattr(reference, "Pipeline", FakePipeline)
    monkeypatch.setattr(local, "LocalRing", fake_ring_class(rec))
    monkeypatch.setattr(local, "probe", no_probe)
    return rec


# ------------------------------------------------------------------ the four front ends
def _cli(*args, input=None):
    r = CliRunner().invoke(main, [str(a) for a in args], input=input, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return r


def via_generate(model, *flags):
    _cli("generate", "--model", model, "--prompt", QUESTION, *flags)


def via_generate_ring(model, *flags):
    _cli("generate", "--model", model, "--prompt", QUESTION, "--nodes", 2, *flags)


def via_local_prompt(model, *flags):
    _cli("local", "--model", model, "--nodes", 2, "--prompt", QUESTION, *flags)


def via_chat_repl(model, *flags):
    _cli("chat", "--local", 2, "--model", model, "--no-history", *flags, input=QUESTION + "\n")


def via_api(model, *flags):
    from aiohttp import ClientSession, web

    from p2pk3.api.app import ApiConfig, create_app
    from p2pk3.node.local import free_ports

    body = {"model": "m", "messages": [{"role": "user", "content": QUESTION}]}
    names = {
        "--temperature": ("temperature", float),
        "--max-tokens": ("max_tokens", int),
        "--top-p": ("top_p", float),
        "--top-k": ("top_k", int),
        "--seed": ("seed", int),
    }
    for flag, value in zip(flags[::2], flags[1::2]):
        key, kind = names[flag]
        body[key] = kind(value)
    rec = via_api.rec

    async def go():
        runner = web.AppRunner(create_app(FakeCluster(rec), PromptBuilder.from_pretrained(model), ApiConfig("m")))
        await runner.setup()
        port = free_ports(1)[0]
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            async with ClientSession() as s, s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                return r.status, await r.json()
        finally:
            await runner.cleanup()

    status, doc = run(go())
    assert status == 200, doc


FRONT_ENDS = {
    "generate": via_generate,
    "generate --nodes": via_generate_ring,
    "local --prompt": via_local_prompt,
    "chat": via_chat_repl,
    "api": via_api,
}


def ask_everywhere(rec, model, *flags):
    via_api.rec = rec
    got = {}
    for name, ask in FRONT_ENDS.items():
        n = len(rec.sent)
        ask(model, *flags)
        assert len(rec.sent) == n + 1, f"{name} sent {len(rec.sent) - n} requests"
        got[name] = rec.sent[-1]
    return got


def test_same_question_same_prompt_stops_and_defaults(rec, model):
    want_ids, want_stops = oracle(model, [{"role": "user", "content": QUESTION}])
    got = ask_everywhere(rec, model)
    for name, (ids, params) in got.items():
        assert ids == want_ids, name
        assert set(params.stop_ids) == want_stops, name
        # the checkpoint's generation_config, since the user set nothing
        assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.7, 0.9, 20, 7), name
        assert params.seed is None and params.speculate == "off", name
    assert len({p.stop_ids for _, p in got.values()}) == 1  # the same tuple, order included


def test_what_the_user_sets_wins_everywhere_the_rest_stays_the_checkpoints(rec, model):
    got = ask_everywhere(rec, model, "--temperature", "0.3", "--max-tokens", "5", "--seed", "11")
    for name, (_, params) in got.items():
        assert (params.temperature, params.top_p, params.top_k, params.max_tokens, params.seed) == (
            0.3,
            0.9,
            20,
            5,
            11,
        ), name


def test_temperature_range_is_the_same_in_cli_and_api(rec, model):
    r = CliRunner().invoke(main, ["generate", "--model", str(model), "--prompt", "hi", "--temperature", "2.5"])
    assert r.exit_code == 2 and "--temperature" in r.output and f"0<=x<={MAX_TEMPERATURE}" in r.output, r.output
    via_api.rec = rec
    with pytest.raises(AssertionError, match="temperature"):
        via_api(model, "--temperature", "2.5")
    for ask in FRONT_ENDS.values():  # the top of the range is accepted by all
        ask(model, "--temperature", str(MAX_TEMPERATURE))
    assert {p.temperature for _, p in rec.sent} == {MAX_TEMPERATURE}


def test_raw_generate_is_plain_completion(rec, model):
    _cli("generate", "--model", model, "--prompt", "The with statement", "--raw")
    ids, params = rec.sent[-1]
    prompts = PromptBuilder.from_pretrained(model)
    assert ids == [prompts.tok.bos_id] + prompts.tok.encode("The with statement")
    assert params.max_tokens == 7 and params.temperature == 0.7


# ------------------------------------------------------------------ the builder itself
def _builder(tmp_path, generation: dict | None, context_len=1 << 20) -> PromptBuilder:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if not (d / name).exists():
            (d / name).symlink_to(SHIPPED / name)
    gc = d / "generation_config.json"
    if generation is None:
        gc.unlink(missing_ok=True)
    else:
        gc.write_text(json.dumps(generation))
    b = PromptBuilder.from_pretrained(d)
    b.context_len = context_len
    return b


def test_defaults_without_generation_config_and_with_max_length(tmp_path):
    b = _builder(tmp_path, None)
    p = b.question(QUESTION, SamplingOverrides())
    assert (p.params.temperature, p.params.top_p, p.params.top_k, p.params.max_tokens) == (
        0.0,
        1.0,
        0,
        DEFAULT_MAX_TOKENS,
    )
    b = _builder(tmp_path, {"max_length": 40})  # counts the prompt too
    p = b.question(QUESTION, SamplingOverrides())
    assert p.params.max_tokens == 40 - len(p.ids)
    b = _builder(tmp_path, {"max_new_tokens": 500}, context_len=len(p.ids) + 9)  # capped to the context left
    assert b.question(QUESTION, SamplingOverrides()).params.max_tokens == 9
    with pytest.raises(PromptError, match="do not fit") as e:
        b.question(QUESTION, SamplingOverrides(max_tokens=10))
    assert e.value.field == "max_tokens"
    assert b.question(QUESTION, SamplingOverrides(ignore_eos=True)).params.stop_ids == ()


def test_overrides_and_prompts_refused_with_the_field(tmp_path):
    for kw, field in (
        ({"temperature": 2.01}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"speculate": "x"}, "speculate"),
        ({"draft_tokens": 0}, "draft_tokens"),
    ):
        with pytest.raises(PromptError) as e:
            SamplingOverrides(**kw)
        assert e.value.field == field
    b = _builder(tmp_path, None)
    for bad in (
        lambda: b.question("  ", SamplingOverrides()),
        lambda: b.text("", SamplingOverrides()),
        lambda: b.tokens([b.tok.vocab_size], SamplingOverrides()),
    ):
        with pytest.raises(PromptError) as e:
            bad()
        assert e.value.field == "prompt"


def test_tokenizer_chat_template_is_the_checkpoints(model):
    """`load_tokenizer(dir).apply_chat_template` (what tools use) renders the checkpoint's template too."""
    from p2pk3.tokenizer import load_tokenizer

    msgs = [{"role": "user", "content": QUESTION}]
    assert load_tokenizer(model).apply_chat_template(msgs) == oracle(model, msgs)[0]


def test_repl_keeps_the_users_settings_per_turn(rec, model):
    """/temp and /max change what the next turn is sampled with; the rest stays the checkpoint's."""
    from p2pk3.frontends.repl import run_chat

    out, err = io.StringIO(), io.StringIO()
    rc = run_chat(
        lambda: asyncio.sleep(0, FakeClient(rec)),
        PromptBuilder.from_pretrained(model),
        stdin=io.StringIO(f"{QUESTION}\n/temp 1.5\n/max 3\nAgain?\n/stats\n"),
        out=out,
        err=err,
        interactive=False,
    )
    assert rc == 0, err.getvalue()
    (_, first), (ids, second) = rec.sent
    assert (first.temperature, first.max_tokens) == (0.7, 7)
    assert (second.temperature, second.max_tokens, second.top_p, second.top_k) == (1.5, 3, 0.9, 20)
    assert "temperature 1.5, top_k 20, top_p 0.9, max 3 tokens" in err.getvalue()
    history = [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Again?"},
    ]
    assert ids == oracle(model, history)[0]

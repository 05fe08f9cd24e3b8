"""`p2pk3 chat`: a conversation with a running cluster (p2pk3/frontends/repl.py does the work)."""

from __future__ import annotations

import logging

import click

from .group import main
from .common import MODEL_HELP, UserError, model_dir, plural, topology_model_dir
from .options import sampling_options, speculation_options, state_option, topology_of_state, topology_option


def parse_address(s: str, param: str = "--connect") -> tuple[str, int]:
    host, sep, port = s.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{s!r} is not HOST:PORT (e.g. 127.0.0.1:47920)", param_hint=param)
    return host, int(port)


def read_secret_file(path: str, param: str = "--secret-file") -> bytes:
    try:
        data = open(path, "rb").read().strip()
    except OSError as e:
        raise click.BadParameter(f"cannot read {path}: {e.strerror or e}", param_hint=param) from None
    if len(data) < 16:
        raise click.BadParameter(f"{path} holds {len(data)} bytes; a cluster secret has at least 16", param_hint=param)
    return data


@main.command()
@topology_option(required=False)
@state_option()
@click.option("--connect", "address", help="HOST:PORT of the entry node (secret from --topology or --secret-file)")
@click.option("--secret-file", type=click.Path(dir_okay=False), help="the cluster secret (with --connect)")
@click.option(
    "--local",
    "local_nodes",
    type=click.IntRange(min=1),
    default=None,
    help="start a fresh local ring of N daemons for this chat (stopped at the end)",
)
@click.option("--model", help=MODEL_HELP + " (with --local or --connect; else the topology's)")
@click.option("--system", default=None, help="system prompt")
@sampling_options
@speculation_options
@click.option(
    "--history",
    "history_file",
    type=click.Path(dir_okay=False),
    default="~/.p2pk3_chat_history",
    show_default=True,
    help="readline history file",
)
@click.option("--no-history", is_flag=True, help="keep no history file")
@click.option(
    "--tools",
    "tool_set",
    type=click.Choice(["docs"]),
    default=None,
    help="let the model call tools the REPL runs: docs = python_doc(name) and man_page(name), answered from "
    "the documentation index shipped with the model (doc_index.json)",
)
def chat(
    topology_path,
    state_file,
    address,
    secret_file,
    local_nodes,
    model,
    system,
    history_file,
    no_history,
    tool_set,
    sampling,
):
    """Chat with the cluster: answers stream as they are generated; /help lists the commands. With
    --topology the entry is found in the topology, and its secret and model are used.

    \b
      p2pk3 chat --topology ring.toml
      p2pk3 chat --state /tmp/ring.json                      # a ring of `p2pk3 local --state ...`
      p2pk3 chat --connect 10.0.0.1:47920 --secret-file cluster.key
      p2pk3 chat --local 2
      printf 'What is a tuple?\\n' | p2pk3 chat --local 2      # scripted: one message per line
      p2pk3 chat --local 2 --tools docs                      # the model may look things up
    """
    from dataclasses import replace

    from p2pk3.frontends.prompt import PromptBuilder
    from p2pk3.frontends.repl import banner, run_chat
    from p2pk3.node.client import Client

    logging.getLogger("p2pk3").addHandler(logging.NullHandler())  # errors are said in the chat, not logged
    if state_file:
        if topology_path:
            raise click.UsageError("give --state or --topology, not both")
        topology_path = topology_of_state(state_file)
    modes = [
        m
        for m, on in (("--topology", topology_path and not address), ("--connect", address), ("--local", local_nodes))
        if on
    ]
    if len(modes) != 1:
        raise click.UsageError(
            "give one of --topology T (or --state FILE), --connect HOST:PORT (with --topology or --secret-file), "
            "or --local N" + (f" (got {' and '.join(modes)})" if modes else "")
        )
    if local_nodes and (topology_path or secret_file):
        raise click.UsageError("--local starts its own ring: it takes no --topology or --secret-file")
    if address and bool(topology_path) == bool(secret_file):
        raise click.UsageError("--connect needs the secret from exactly one of --topology and --secret-file")
    topo = None
    if topology_path:
        from p2pk3.topology import Topology

        topo = Topology.load(topology_path)
    mdir = model_dir(model) if (model or not topo) else topology_model_dir(topo)
    prompts = PromptBuilder.from_pretrained(mdir)
    tools = None
    if tool_set == "docs":
        from p2pk3.agent.doctools import DocTools
        from p2pk3.frontends.tool_use import ToolUse

        try:
            tools = ToolUse(prompts, DocTools.load(mdir))
        except (OSError, ValueError) as e:
            raise click.BadParameter(str(e), param_hint="--tools") from None
    if sampling.max_tokens == 0:
        sampling = replace(sampling, max_tokens=1)  # an answer has a token at least
    history = None if no_history else history_file
    ring = None
    if local_nodes:
        from p2pk3.model.config import K3Config
        from p2pk3.node.local import LocalRing

        if local_nodes > K3Config.from_pretrained(mdir).num_hidden_layers:
            raise click.BadParameter("more nodes than the model has layers", param_hint="--local")
        click.echo(f"starting a local ring of {plural(local_nodes, 'daemon')} ...", err=True)
        ring = LocalRing(mdir, local_nodes).start()
        factory = ring.client
    elif address:
        host, port = parse_address(address)
        secret = read_secret_file(secret_file) if secret_file else topo.secret()
        others = list(topo.static_addresses().values()) if topo else []
        factory = lambda: Client.connect(host, port, secret, fallbacks=others)  # noqa: E731
    else:
        secret = topo.secret()
        factory = lambda: Client.for_topology(topo, secret)  # noqa: E731
    try:
        run_chat(
            factory, prompts, sampling, system=system, history_file=history, banner=banner(mdir.name), tools=tools
        )
    except ConnectionError as e:  # nobody answers: said in one line, not a bug
        raise UserError(str(e)) from None
    finally:
        if ring is not None:
            ring.__exit__(None, None, None)

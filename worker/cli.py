"""`llm-worker`: one console command, one subcommand per concern.

Subcommands live in their own modules and are imported only when run, so `llm-worker --help` and the
Kafka-only commands never import torch. Each module provides `configure_parser(parser)` and
`run(args) -> int`. The worker's own commands are listed here; the clients' (the example producers, the
gateway) register themselves as entry points of the group `llm_worker.commands` (pyproject.toml), so the
worker package never names, let alone imports, its clients.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "broker": ("worker.broker.cli", "start, stop or inspect a local Apache Kafka broker (KRaft, loopback)"),
    "topics": ("worker.broker.topics", "create the request, result, dead-letter, status, control and usage topics"),
    "schema": ("schemas.export", "write the JSON Schemas of the wire records"),
    "model": ("worker.model.pull", "provision the default model (SmolLM2-135M-Instruct) or list models"),
    "config": ("worker.config_cli", "print the effective configuration or the settings table"),
    "serve": ("worker.serve", "consume requests from Kafka, generate, stream results (the worker)"),
    "usage": ("worker.usage_report", "sum the usage topic per tenant and priority (table or JSON)"),
}
PROCESS_SETUP: dict[str, str] = {"serve": "worker.process:prepare_serve"}
"""name -> "module:function" run first, before the command's module is imported: what its process must set up
before any thread starts (the worker's allocator), kept out of the command's own path."""
COMMANDS_GROUP = "llm_worker.commands"
"""Entry-point group of commands that other packages add (`name = "module"`; the module has a HELP line)."""


def registered_commands() -> dict[str, str]:
    """name -> module of the commands other installed packages register (the clients' commands)."""
    from importlib.metadata import entry_points

    return {ep.name: ep.value.split(":")[0] for ep in entry_points(group=COMMANDS_GROUP) if ep.name not in SUBCOMMANDS}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-worker",
        description="Kafka-native LLM inference worker: continuous batching, paged KV cache, Triton kernels.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    for name, module in sorted(registered_commands().items()):
        sub.add_parser(name, help=f"(from {module})", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # Parse only up to the subcommand name; the subcommand's module parses the rest.
    top, rest = parser.parse_known_args(argv)
    if top.command is None:
        parser.print_help()
        return 2
    # Here, not at the top: `--help` skips pydantic.
    from worker.log_limits import install_repeat_limits, install_transient_downgrade

    root_handlers = list(logging.getLogger().handlers)
    logging.basicConfig(
        level=logging.DEBUG if top.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # Only the handler basicConfig made: one a host process installed (pytest's, say) is not ours to filter.
    ours = [h for h in logging.getLogger().handlers if h not in root_handlers]
    install_transient_downgrade(ours)
    limiters = install_repeat_limits(ours)
    if top.command in PROCESS_SETUP and not {"-h", "--help"} & set(rest):
        setup_module, setup = PROCESS_SETUP[top.command].split(":")
        getattr(importlib.import_module(setup_module), setup)()
    if top.command in SUBCOMMANDS:
        module_name, help_text = SUBCOMMANDS[top.command]
    else:
        module_name = registered_commands()[top.command]
        help_text = None
    module = importlib.import_module(module_name)
    help_text = help_text or getattr(module, "HELP", None) or (module.__doc__ or "").strip().split("\n")[0]
    sub_parser = argparse.ArgumentParser(prog=f"llm-worker {top.command}", description=help_text)
    module.configure_parser(sub_parser)
    args = sub_parser.parse_args(rest)
    try:
        return int(module.run(args) or 0)
    finally:
        for limiter in limiters:  # counts of the last interval, which has not ended yet
            limiter.flush_all()


if __name__ == "__main__":
    sys.exit(main())

"""`llm-worker`: one console command, one subcommand per concern.

Subcommands live in their own modules and are imported only when run, so `llm-worker --help` and the
Kafka-only commands never import torch. Each module provides `configure_parser(parser)` and
`run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "broker": ("worker.broker.cli", "start, stop or inspect a local Apache Kafka broker (KRaft, loopback)"),
    "topics": ("worker.broker.topics", "create the request, result, dead-letter, status and control topics"),
    "schema": ("schemas.export", "write the JSON Schemas of the wire records"),
    "model": ("worker.model.pull", "provision the default model (SmolLM2-135M-Instruct) or list models"),
    "config": ("worker.config_cli", "print the effective configuration or the settings table"),
    "serve": ("worker.serve", "consume requests from Kafka, generate, stream results (the worker)"),
    "generate": ("producer_examples.generate", "send one prompt and stream the answer (example client)"),
    "loadgen": ("producer_examples.loadgen", "Poisson load by priority; throughput and latency percentiles"),
    "demo": ("producer_examples.demo", "start a broker and a worker, stream a few answers, then overload it"),
    "gateway": ("gateway.cli", "the OpenAI-compatible HTTP gateway (chat, completions, files, batches)"),
    "batch": ("gateway.batch_cli", "run an OpenAI batch file (JSONL) through the workers, resumably"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-worker",
        description="Kafka-native LLM inference worker: continuous batching, paged KV cache, Triton kernels.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
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
    module_name, help_text = SUBCOMMANDS[top.command]
    module = importlib.import_module(module_name)
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

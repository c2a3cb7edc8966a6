"""`llm-worker gateway`: the OpenAI-compatible HTTP gateway (docs/gateway.md), served by uvicorn."""

from __future__ import annotations

import argparse
import logging

from worker.config import GatewaySettings, KafkaSettings, PathSettings

HELP = "the OpenAI-compatible HTTP gateway (chat, completions, files, batches)"
"""The one-line help of `llm-worker --help` (worker/cli.py finds this command by its entry point)."""

log = logging.getLogger(__name__)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="listen address (GATEWAY_HOST, default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="HTTP port (GATEWAY_PORT, default 8000)")
    parser.add_argument("--instance-id", default=None,
                        help="names this instance's reply topic (GATEWAY_INSTANCE_ID; default: random per start)")
    parser.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (KAFKA_BOOTSTRAP_SERVERS)")
    parser.add_argument("--loop", choices=("auto", "asyncio", "uvloop"), default="auto",
                        help="event loop (auto: uvloop when installed, as the gateway extra does)")
    parser.add_argument("--http", choices=("auto", "h11", "httptools"), default="auto",
                        help="HTTP/1.1 parser (auto: httptools when installed, as the gateway extra does)")


def build_app(kafka: KafkaSettings, settings: GatewaySettings):
    """The Starlette app and its gateway (tests and the benchmark run it in their own server)."""
    from gateway.app import Gateway
    from gateway.door import Door
    from gateway.openai_api import load_token_text

    tokens = load_token_text(settings.tokenizer, PathSettings().models_dir, settings.models[0])
    gateway = Gateway(Door(kafka, settings), tokens)
    return gateway.app(), gateway


def run(args: argparse.Namespace) -> int:
    import uvicorn

    kafka = KafkaSettings() if args.bootstrap is None else KafkaSettings(bootstrap_servers=args.bootstrap)
    updates = {k: v for k, v in (("host", args.host), ("port", args.port), ("instance_id", args.instance_id))
               if v is not None}
    settings = GatewaySettings().model_copy(update=updates)
    app, _ = build_app(kafka, settings)
    # One process, one event loop: the Kafka client and the HTTP server share it; no access log per request.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info", access_log=False,
                timeout_graceful_shutdown=10, loop=args.loop, http=args.http)
    return 0

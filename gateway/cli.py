"""`llm-worker gateway`: the OpenAI-compatible HTTP gateway (docs/gateway.md), served by uvicorn."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import sys
import time

from gateway.keys import TENANT, KeyEntry, KeyFileError, digest, new_key, read_keys, write_keys
from gateway.settings import GatewaySettings
from worker.paths import PathSettings
from worker.kafka_settings import KafkaSettings

HELP = "the OpenAI-compatible HTTP gateway (chat, completions, files, batches)"
"""The one-line help of `llm-worker --help` (worker/cli.py finds this command by its entry point)."""

log = logging.getLogger(__name__)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="{keys}")
    keys = sub.add_parser("keys", help="add, list or revoke API keys (GATEWAY_KEYS_FILE)")
    keys_sub = keys.add_subparsers(dest="keys_action", required=True)
    add = keys_sub.add_parser("add", help="make a key and print it (once: only its hash is kept)")
    add.add_argument("--tenant", required=True, help="the tenant its requests are for")
    add.add_argument("--most-urgent", type=int, default=None,
                     help="the most urgent priority it may use (default GATEWAY_DEFAULT_PRIORITY; 0 = all)")
    add.add_argument("--trusted", action="store_true",
                     help="may name another tenant with X-Tenant (an upstream that authenticates its users)")
    add.add_argument("--requests-per-minute", type=int, default=0, help="rate limit (0: none)")
    add.add_argument("--no-background", action="store_true",
                     help="may not create background responses (POST /v1/responses with background: true)")
    add.add_argument("--name", default="", help="a note for `list`")
    keys_sub.add_parser("list", help="ids, tenants and limits (never the keys)")
    revoke = keys_sub.add_parser("revoke", help="remove a key by its id")
    revoke.add_argument("key_id")
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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_bind_refusal(settings: GatewaySettings) -> str | None:
    """Why the gateway must not start: no keys, an address others reach, and no proxy said to authenticate."""
    if settings.keys_path.exists() or settings.behind_auth_proxy or is_loopback(settings.host):
        return None
    return (f"refusing to listen on {settings.host} without API keys: anyone could call as any tenant. Add one "
            f"(`llm-worker gateway keys add --tenant T`, GATEWAY_KEYS_FILE={settings.keys_path}) or set "
            "GATEWAY_BEHIND_AUTH_PROXY=true when a proxy in front authenticates callers")


def run_keys(args: argparse.Namespace, settings: GatewaySettings) -> int:
    path = settings.keys_path
    try:
        entries = read_keys(path) if path.exists() else []
    except KeyFileError as exc:
        print(exc, file=sys.stderr)
        return 2
    if args.keys_action == "add":
        most_urgent = settings.default_priority if args.most_urgent is None else args.most_urgent
        if most_urgent < 0 or args.requests_per_minute < 0 or not TENANT.match(args.tenant):
            print("--most-urgent and --requests-per-minute must be >= 0, --tenant visible ASCII (1-64 chars)",
                  file=sys.stderr)
            return 2
        ident, key = new_key()
        entries.append(KeyEntry(id=ident, sha256=digest(key), tenant=args.tenant, most_urgent=most_urgent,
                                trusted=args.trusted, requests_per_minute=args.requests_per_minute,
                                background=not args.no_background,
                                name=args.name, created_at=int(time.time())))
        write_keys(path, entries)
        print(key)
        print(f"key {ident} for tenant {args.tenant} added to {path}; the key is not stored, keep it now",
              file=sys.stderr)
    elif args.keys_action == "list":
        print(f"{'id':12}  {'tenant':20} {'most urgent':>11} {'trusted':>7} {'per min':>7}  name")
        for e in entries:
            print(f"{e.id:12}  {e.tenant:20} {e.most_urgent:>11} {('yes' if e.trusted else 'no'):>7} "
                  f"{(e.requests_per_minute or '-'):>7}  {e.name}")
    else:
        kept = [e for e in entries if e.id != args.key_id]
        if len(kept) == len(entries):
            print(f"no key {args.key_id} in {path}", file=sys.stderr)
            return 1
        write_keys(path, kept)
        print(f"key {args.key_id} revoked (running gateways drop it within seconds)", file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    settings = GatewaySettings()
    if args.action == "keys":
        return run_keys(args, settings)
    import uvicorn

    kafka = KafkaSettings() if args.bootstrap is None else KafkaSettings(bootstrap_servers=args.bootstrap)
    updates = {k: v for k, v in (("host", args.host), ("port", args.port), ("instance_id", args.instance_id))
               if v is not None}
    settings = settings.model_copy(update=updates)
    from gateway.webhooks import configuration_error

    refusal = open_bind_refusal(settings) or configuration_error(settings)
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    try:
        app, _ = build_app(kafka, settings)
    except KeyFileError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not settings.keys_path.exists():
        log.warning("no API keys (%s): every caller is trusted and may name its tenant and priority; %s",
                    settings.keys_path, "a proxy in front authenticates them" if settings.behind_auth_proxy
                    else f"listening on loopback ({settings.host}) only")
    # One process, one event loop: the Kafka client and the HTTP server share it; no access log per request.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="info", access_log=False,
                timeout_graceful_shutdown=10, loop=args.loop, http=args.http)
    return 0

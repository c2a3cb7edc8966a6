"""`llm-worker broker start|stop|status|fetch`: a local Apache Kafka broker for development.

The broker keeps running after `start` returns (it is detached); `stop` finds it again through the pid
recorded in the data folder, so start and stop may run from different shells.

`start --security sasl_ssl|ssl|sasl_plaintext` sets up a secured broker (secure.py): TLS, SASL users, the
authorizer and the ACLs of acls.py for the topics and group KAFKA_* names, and the client settings files that
`status` lists.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
from pathlib import Path

from worker.broker.jars import BrokerError, ensure_kafka_jars
from worker.broker.local import LocalBroker
from worker.broker.secure import MODES, client_files, settings_for
from worker.paths import PathSettings
from worker.kafka_settings import KafkaSettings


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "action", choices=["start", "stop", "status", "fetch"],
        help="fetch only downloads the Kafka jars (done by start when missing)",
    )  # fmt: skip
    parser.add_argument(
        "--data-dir", type=Path, default=None,
        help="broker data folder, kept between runs (default: <LLM_WORKER_HOME>/kafka/data)",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=9092, help="client port on 127.0.0.1")
    parser.add_argument("--security", choices=MODES, default=None,
                        help="start: how clients connect (default: what the data folder was set up with; "
                             "plaintext for a new one); see docs/security.md")
    parser.add_argument("--controller-port", type=int, default=None, help="KRaft controller port (default: port+1)")
    parser.add_argument("--fresh", action="store_true", help="start: stop the broker and delete its data first")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for readiness on start")


def run(args: argparse.Namespace) -> int:
    kafka_dir = PathSettings().kafka_dir
    broker = LocalBroker(args.data_dir, args.port, args.controller_port, start_timeout_s=args.timeout,
                         security=args.security)
    try:
        if args.action == "fetch":
            print(f"Kafka jars ready in {ensure_kafka_jars(kafka_dir)}")
            return 0
        if args.action == "start":
            if args.fresh:
                broker.stop()
                shutil.rmtree(broker.data_dir, ignore_errors=True)
            status = broker.start()
            security = broker.load_security()
            if security.secured:
                asyncio.run(grant_acls(broker))
            print(f"running pid={status.pid} bootstrap={status.bootstrap_servers} data={status.data_dir}")
            print(f"log: {broker.log_path}")
            _print_security(broker)
            return 0
        if args.action == "stop":
            print("stopped" if broker.stop() else "not running")
            return 0
        status = broker.status()
        if status.running:
            print(f"running pid={status.pid} bootstrap={status.bootstrap_servers} data={status.data_dir}")
            _print_security(broker)
            return 0
        print(f"not running (data={status.data_dir})")
        return 3  # like `systemctl status`: scripts can test for a running broker
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


async def grant_acls(broker: LocalBroker, kafka: KafkaSettings | None = None) -> None:
    """The worker's and the client's ACLs on the topics and group `kafka` (default: KAFKA_*) names."""
    from worker.broker.acls import client_acls, create_acls, worker_acls

    kafka = kafka or KafkaSettings()
    admin = settings_for(broker.load_security(), "admin", broker.bootstrap_servers, kafka)
    await create_acls(admin, worker_acls(kafka) + client_acls(kafka))


def _print_security(broker: LocalBroker) -> None:
    security = broker.load_security()
    if not security.secured:
        return
    print(f"security: {security.mode} (CA {security.ca_path})")
    print("client settings (source an env file before serve, topics, generate, loadgen, demo):")
    for path in client_files(broker.data_dir):
        print(f"  {path}")

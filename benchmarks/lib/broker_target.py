"""A local broker a benchmark runs against, in one of the listener modes `llm-worker broker start --security`
makes (plaintext, sasl_ssl, ssl, sasl_plaintext), and how each principal connects to it.

On a secured broker the worker connects as `worker` and the benchmark's own producers and readers as `client`,
each limited by its ACLs, as in production; `admin` (the super user) creates each run's topics and their ACLs.
On plaintext every principal is the same anonymous client. Benchmarks that compare modes start one broker per
mode and alternate their cases between them (bench_plumbing.py, bench_kafka_path.py: `--security`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from worker.broker.topics import ensure_topics
from worker.kafka_settings import KafkaSettings

MODES = ("plaintext", "sasl_ssl", "ssl", "sasl_plaintext")


@dataclass
class Target:
    mode: str
    bootstrap: str
    broker: object | None = None
    """The LocalBroker when this process started it (and stops it)."""
    security: object | None = field(default=None, repr=False)
    """worker.broker.secure.Security of a secured broker; None on plaintext."""

    def as_(self, principal: str, kafka: KafkaSettings) -> KafkaSettings:
        """`kafka` (topics, group) with the principal's connection settings."""
        from worker.broker.secure import settings_for

        return kafka if self.security is None else settings_for(self.security, principal, self.bootstrap, kafka)

    def env(self, principal: str) -> dict[str, str]:
        """The principal's KAFKA_* connection variables, for a worker subprocess."""
        return {} if self.security is None else self.security.client_env(principal, self.bootstrap)

    async def prepare(self, kafka: KafkaSettings) -> dict:
        """The run's topics (ensure_topics' answer), and on a secured broker the worker's and the client's ACLs
        on them."""
        states = await ensure_topics(self.as_("admin", kafka))
        if self.security is not None:
            from worker.broker.acls import client_acls, create_acls, worker_acls

            await create_acls(self.as_("admin", kafka), worker_acls(kafka) + client_acls(kafka))
        return states

    def stop(self) -> None:
        if self.broker is not None:
            self.broker.stop()


def start_broker(folder: Path, mode: str = "plaintext") -> Target:
    """A LocalBroker of `mode` on free ports, its data in folder/broker-<mode>."""
    from worker.broker.local import LocalBroker, free_ports

    if mode not in MODES:
        raise ValueError(f"unknown security mode {mode!r}: one of {', '.join(MODES)}")
    port, controller_port = free_ports(2)
    broker = LocalBroker(folder / f"broker-{mode}", port, controller_port, detach=False,
                         security=None if mode == "plaintext" else mode)
    broker.start()
    security = broker.load_security()
    return Target(mode, broker.bootstrap_servers, broker, security if security.secured else None)

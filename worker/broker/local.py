"""A real single-node Apache Kafka broker (KRaft, loopback only) run from Maven Central's jars.

For development and tests on machines without Docker: `LocalBroker(data_dir, port).start()` formats the
storage once (so a second start keeps its topics), starts `kafka.Kafka` as a separate process that logs to
`<data_dir>/server.log`, and returns when the broker both logged "Kafka Server started" and answered a Kafka
ApiVersions request on its listener. `stop()` works from any process: the pid lives in `<data_dir>/broker.json`.
"""

from __future__ import annotations

import base64
import ctypes
import json
import logging
import os
import signal
import ssl
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from worker.broker.jars import BrokerError, ensure_kafka_jars, find_java
from worker.broker.net import free_port, free_ports, port_is_free, probe_api_versions
from worker.broker.secure import Security
from worker.paths import PathSettings

log = logging.getLogger(__name__)

LOG4J_CONFIG = Path(__file__).with_name("log4j2.properties")
READY_LINE = "Kafka Server started"
STATE_FILE = "broker.json"
SERVER_LOG = "server.log"
DEFAULT_HEAP = "-Xms128m -Xmx512m"

# The port helpers live in net.py; they are re-exported because tests pick broker ports from here.
__all__ = [
    "BrokerError", "BrokerStatus", "LocalBroker", "free_port", "free_ports", "new_cluster_id", "pid_alive",
    "port_is_free", "probe_api_versions", "render_server_properties",
]  # fmt: skip


def new_cluster_id() -> str:
    """A Kafka cluster id (Uuid: 16 random bytes, URL-safe base64, no padding) without a JVM start."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):  # Kafka's own generator avoids these too: they read as CLI flags
            return cluster_id


def render_server_properties(*, log_dir: Path, port: int, controller_port: int, host: str = "127.0.0.1") -> str:
    """server.properties of a one-node cluster that is both broker and controller (KRaft, static quorum)."""
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "listeners": f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://{host}:{port}",
        "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "controller.listener.names": "CONTROLLER",
        # A static voter set: storage is formatted without --standalone, and the port may change between runs.
        "controller.quorum.voters": f"1@{host}:{controller_port}",
        "log.dirs": str(log_dir),
        "num.partitions": "1",
        # Topics come from `llm-worker topics` only: an auto-created one-partition request topic would
        # silently break the priority layout, and a test that forgot to create its topics should fail.
        "auto.create.topics.enable": "false",
        # One node: every internal topic must live with a single replica.
        "offsets.topic.replication.factor": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        # The first group join creates the offsets topic; 50 partitions (the default) is slow to set up on a
        # small machine, and a single local broker needs no more than a few.
        "offsets.topic.num.partitions": "8",
        # Group joins complete at once instead of waiting 3 s for more members.
        "group.initial.rebalance.delay.ms": "0",
    }
    return "".join(f"{key}={value}\n" for key, value in settings.items())


def pid_alive(pid: int) -> bool:
    """True for a live (not zombie) process that runs kafka.Kafka: guards against a recycled pid."""
    proc_dir = Path(f"/proc/{pid}")
    if not proc_dir.exists():
        if sys.platform.startswith("linux"):
            return False
        try:  # no /proc (macOS): existence is all we can check
            os.kill(pid, 0)
        except OSError:
            return False
        return True
    try:
        state = (proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = (proc_dir / "cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    return state != "Z" and b"kafka.Kafka" in cmdline


@dataclass(slots=True)
class BrokerStatus:
    running: bool
    pid: int | None
    bootstrap_servers: str
    data_dir: Path


class LocalBroker:
    """One Kafka node on 127.0.0.1 whose data lives in `data_dir` (kept between runs)."""

    def __init__(
        self,
        data_dir: Path | None = None,
        port: int = 9092,
        controller_port: int | None = None,
        *,
        kafka_dir: Path | None = None,
        heap_opts: str = DEFAULT_HEAP,
        start_timeout_s: float = 120.0,
        detach: bool = True,
        extra_properties: dict[str, str] | None = None,
        security: str | None = None,
    ) -> None:
        kafka_dir = kafka_dir or PathSettings().kafka_dir
        self.kafka_dir = kafka_dir
        self.data_dir = Path(data_dir) if data_dir else kafka_dir / "data"
        self.host = "127.0.0.1"
        self.port = port
        self.controller_port = controller_port or port + 1
        self.heap_opts = heap_opts
        self.extra_properties = dict(extra_properties or {})
        """server.properties entries added to (or overriding) the rendered ones, e.g. an authorizer."""
        self.security_mode = security
        """plaintext, sasl_plaintext, sasl_ssl or ssl (secure.py); None: what the data folder was set up with."""
        self.security: Security | None = None
        """The data folder's security setup, known once start() (or load_security()) ran."""
        self.start_timeout_s = start_timeout_s
        # detach=False ties the broker to this process (killed with it): what a test session wants.
        self.detach = detach
        self._process: subprocess.Popen | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / SERVER_LOG

    def status(self) -> BrokerStatus:
        state = self._read_state()
        pid = state.get("pid") if state else None
        running = pid is not None and pid_alive(pid)
        port = state.get("port", self.port) if state else self.port
        return BrokerStatus(running, pid if running else None, f"{self.host}:{port}", self.data_dir)

    def start(self) -> BrokerStatus:
        current = self.status()
        if current.running:
            # Idempotent: `broker start` twice, or a test reusing a broker someone else started.
            self.port = int(current.bootstrap_servers.rsplit(":", 1)[1])
            log.info("broker already running (pid %s) at %s", current.pid, current.bootstrap_servers)
            return current
        java = find_java()
        for port in (self.port, self.controller_port):
            if not port_is_free(port, self.host):
                raise BrokerError(f"port {self.host}:{port} is in use; pick another with --port")
        libs_dir = ensure_kafka_jars(self.kafka_dir)
        kraft_dir = self.data_dir / "kraft"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        security = self.load_security()
        properties_path = self.data_dir / "server.properties"
        properties = render_server_properties(log_dir=kraft_dir, port=self.port, controller_port=self.controller_port,
                                              host=self.host)
        extra = {**security.server_properties(self.host, self.port, self.controller_port), **self.extra_properties}
        properties_path.write_text(properties + "".join(f"{k}={v}\n" for k, v in extra.items()))
        properties_path.chmod(0o600)  # a secured broker's holds the admin password
        jvm_base = [java, f"-Dlog4j2.configurationFile={LOG4J_CONFIG}", "-cp", f"{libs_dir}/*"]
        if not (kraft_dir / "meta.properties").exists():
            self._format_storage(jvm_base, properties_path, security.format_args())
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        command = [
            *jvm_base[:1], *self.heap_opts.split(), "-XX:+UseSerialGC", "-Djava.awt.headless=true",
            f"-Dkafka.logs.dir={self.data_dir}", *jvm_base[1:], "kafka.Kafka", str(properties_path),
        ]  # fmt: skip
        with self.log_path.open("ab") as log_file:
            self._process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                cwd=self.data_dir, start_new_session=self.detach,
                preexec_fn=None if self.detach else _die_with_parent,
            )  # fmt: skip
        pid = self._process.pid
        state = {"pid": pid, "port": self.port, "controller_port": self.controller_port}
        (self.data_dir / STATE_FILE).write_text(json.dumps(state) + "\n")
        self._wait_ready(log_offset, security.probe_context())
        security.write_client_files(self.data_dir, self.bootstrap_servers)
        log.info("Kafka broker ready at %s (pid %d, data %s)", self.bootstrap_servers, pid, self.data_dir)
        return BrokerStatus(True, pid, self.bootstrap_servers, self.data_dir)

    def load_security(self) -> Security:
        if self.security is None:
            self.security = Security.load_or_create(self.data_dir, self.security_mode)
        return self.security

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop the broker (SIGTERM, then SIGKILL after `timeout_s`); False when none was running."""
        state = self._read_state()
        pid = state.get("pid") if state else None
        stopped = False
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGTERM)  # Kafka's shutdown hook flushes logs and leaves the quorum cleanly
            if not self._wait_exit(pid, timeout_s):
                log.warning("broker pid %d ignored SIGTERM for %.0f s; killing it", pid, timeout_s)
                os.kill(pid, signal.SIGKILL)
                self._wait_exit(pid, 10.0)
            stopped = True
        (self.data_dir / STATE_FILE).unlink(missing_ok=True)
        self._process = None
        return stopped

    def log_tail(self, num_lines: int = 40) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def __enter__(self) -> "LocalBroker":
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _read_state(self) -> dict | None:
        try:
            return json.loads((self.data_dir / STATE_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _format_storage(self, jvm_base: list[str], properties_path: Path, extra_args: list[str]) -> None:
        command = [*jvm_base, "kafka.tools.StorageTool", "format", "-t", new_cluster_id(), "-c", str(properties_path),
                   *extra_args]
        proc = subprocess.run(command, capture_output=True, text=True, cwd=self.data_dir)
        if proc.returncode != 0:
            raise BrokerError(f"formatting Kafka storage failed (exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")

    def _wait_ready(self, log_offset: int, probe_context: ssl.SSLContext | None) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        seen_ready_line = False
        while time.monotonic() < deadline:
            exit_code = self._process.poll() if self._process else None
            if exit_code is not None:
                (self.data_dir / STATE_FILE).unlink(missing_ok=True)
                raise BrokerError(f"Kafka exited with code {exit_code} while starting; log tail:\n{self.log_tail()}")
            if not seen_ready_line:
                with self.log_path.open("rb") as log_file:
                    log_file.seek(log_offset)
                    seen_ready_line = READY_LINE.encode() in log_file.read()
            if seen_ready_line and probe_api_versions(self.host, self.port, ssl_context=probe_context):
                return
            time.sleep(0.1)
        self.stop(timeout_s=5.0)
        raise BrokerError(f"Kafka not ready after {self.start_timeout_s:.0f} s; log tail:\n{self.log_tail()}")

    def _wait_exit(self, pid: int, timeout_s: float) -> bool:
        if self._process is not None and self._process.pid == pid:
            try:  # our own child: wait() also reaps it, so it does not linger as a zombie
                self._process.wait(timeout_s)
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return True
            time.sleep(0.1)
        return False


def _die_with_parent() -> None:
    """Runs in the child before exec: ask Linux to SIGTERM the broker when its parent dies (even by SIGKILL)."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)

"""`llm-worker demo`: the whole system on one machine in a few minutes, from nothing.

Steps: start a local Kafka broker (its own data folder under the project home, port 9092 or a free one),
create the topics, provision SmolLM2-135M-Instruct, start `llm-worker serve` on the CPU as a subprocess,
wait for its first status record, stream a few chat answers of different priorities side by side, then
send a burst above capacity (deadlines, tight per-priority queue-time limits, so the worker pauses and
sheds for real) and print what the status topic and the final records showed. Everything it started is
stopped at the end, on Ctrl-C and on SIGTERM too (the broker only if the demo started it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from llm_client import BackoffPolicy, LLMClient, RequestTimeout
from llm_client.commands.demo_view import LoadWatch, PrefixedLines, outcome_table, say, shedding_check
from llm_client.commands.generate import summary_line
from schemas.request import ChatMessage, GenerationRequest
from worker.paths import PathSettings
from worker.kafka_settings import KafkaSettings

HELP = "start a broker and a worker, stream a few answers, then overload it"
"""The one-line help of `llm-worker --help` (worker/cli.py finds this command by its entry point)."""

PROMPTS = [  # (priority, question): one per priority, answered side by side
    (0, "In two sentences, what is Apache Kafka used for?"),
    (1, "Give me three tips for writing clear code."),
    (2, "Write a very short poem about the sea."),
]
BURST_DEADLINE_S = {0: 60.0, 1: 20.0, 2: 10.0}
"""Carried by every other burst request: the worker rejects those it cannot start in time (`deadline`);
the rest of priorities 1 and 2 wait until the worker sheds them (`shed`). Priority 0 is never shed."""
BURST_SHARES = (1, 2, 3)
"""Priorities 0, 1, 2 in the burst as 1:2:3 (10, 20 and 30 of 60): most of the overload is least urgent."""
# The worker's settings for the demo: a small running batch and a short tolerated queue time for the less
# urgent priorities, so that a burst of 60 requests overloads a small CPU machine visibly within seconds.
WORKER_ENV = {
    "ENGINE_DEVICE": "cpu", "ENGINE_MAX_NUM_SEQS": "8", "WORKER_MAX_ENGINE_INFLIGHT": "8",
    "WORKER_MAX_QUEUE_TIME_S": "[60, 6, 3]", "WORKER_MAX_WAITING": "16", "WORKER_RESUME_WAITING": "4",
    "WORKER_PRIORITY_BACKLOG_THRESHOLD": "6", "WORKER_STATUS_INTERVAL_S": "0.5", "WORKER_METRICS_PORT": "0",
    # On Ctrl-C the demo should end in seconds; unfinished requests stay uncommitted (redelivered next time).
    "WORKER_DRAIN_TIMEOUT_S": "5",
}


def start_broker(data_dir: Path, port: int):
    """A fresh LocalBroker in data_dir (a leftover one from an interrupted demo is stopped and wiped)."""
    from worker.broker.local import LocalBroker, free_ports, port_is_free

    leftover = LocalBroker(data_dir)
    if leftover.status().running:
        say("stopping a broker left over by an earlier demo")
        leftover.stop()
    shutil.rmtree(data_dir, ignore_errors=True)
    controller_port = port + 1
    if not (port_is_free(port) and port_is_free(controller_port)):
        busy = port
        port, controller_port = free_ports(2)
        say(f"port {busy} (or {busy + 1}) is busy; using {port} for Kafka instead")
    say(f"starting Apache Kafka on 127.0.0.1:{port} (data in {data_dir}; first run fetches its jars) ...")
    broker = LocalBroker(data_dir, port, controller_port, detach=True)
    started = time.monotonic()
    broker.start()
    say(f"Kafka ready at {broker.bootstrap_servers} after {time.monotonic() - started:.0f} s")
    return broker


def _die_with_parent() -> None:
    # Runs in the worker child before exec: Linux sends it SIGTERM if the demo dies, even by SIGKILL.
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def start_worker(settings: KafkaSettings, worker_id: str, log_path: Path) -> subprocess.Popen:
    env = {**os.environ, **WORKER_ENV, "KAFKA_BOOTSTRAP_SERVERS": settings.bootstrap_servers}
    command = [str(Path(sys.executable).with_name("llm-worker")), "serve", "--worker-id", worker_id]
    if not Path(command[0]).exists():
        command = [sys.executable, "-m", "worker.cli", "serve", "--worker-id", worker_id]
    say(f"starting the worker ({worker_id}, SmolLM2 on the CPU); its log: {log_path}")
    with log_path.open("ab") as log_file:
        # Its own session: a Ctrl-C in this terminal reaches only the demo, which then stops the worker
        # in order (drain, commit), before the broker.
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True, preexec_fn=_die_with_parent)


def stop_worker(process: subprocess.Popen | None) -> None:
    if process is None or process.poll() is not None:
        return
    say("stopping the worker (SIGTERM: it drains for up to 5 s, commits and leaves the group) ...")
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(40)
    except subprocess.TimeoutExpired:
        say("the worker did not stop within 40 s; killing it")
        process.kill()
        process.wait(10)


def log_tail(path: Path, num_lines: int = 25) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(lines[-num_lines:])


async def wait_ready(client: LLMClient, worker: subprocess.Popen, worker_id: str, log_path: Path,
                     num_partitions: int, timeout_s: float) -> None:
    """Until the worker's status record shows every request partition assigned (model loaded, group joined)."""
    started = time.monotonic()
    next_note = started + 10
    while True:
        status = client.board.latest.get(worker_id)
        if status is not None and len(status.assigned_partitions) == num_partitions:
            say(f"worker ready after {time.monotonic() - started:.0f} s (owns partitions "
                f"{status.assigned_partitions})")
            return
        if worker.poll() is not None:
            raise RuntimeError(f"the worker exited with code {worker.returncode}; log tail:\n{log_tail(log_path)}")
        if time.monotonic() > started + timeout_s:
            raise RuntimeError(f"the worker sent no status within {timeout_s:.0f} s; log tail:\n{log_tail(log_path)}")
        if time.monotonic() >= next_note:
            next_note += 10
            say(f"... still waiting for the worker ({time.monotonic() - started:.0f} s; loading the model)")
        await asyncio.sleep(0.2)


async def stream_side_by_side(client: LLMClient, max_new_tokens: int) -> None:
    say(f"sending {len(PROMPTS)} chat requests at priorities {[p for p, _ in PROMPTS]}; answers stream as "
        "they arrive, each line prefixed with [priority request]:")
    handles = []
    for priority, question in PROMPTS:
        request = GenerationRequest(id=f"demo-q{priority}-{os.getpid()}", max_new_tokens=max_new_tokens,
                                    messages=[ChatMessage(role="user", content=question)])
        handles.append((question, await client.submit(request, priority)))

    async def show(question: str, handle) -> str:
        view = PrefixedLines(f"[p{handle.priority} {handle.request_id}]")
        view.feed(f"Q: {question}\n")
        async for delta in handle.stream():
            if delta.restarted:
                view.restart(delta.attempt)
            view.feed(delta.text)
        view.close()
        return summary_line(await handle.result(), handle)

    summaries = await asyncio.gather(*(show(q, h) for q, h in handles), return_exceptions=True)
    for summary in summaries:
        say(f"done: {summary}" if isinstance(summary, str) else f"failed: {summary!r}")


async def burst(client: LLMClient, watch: LoadWatch, num_requests: int, max_new_tokens: int) -> None:
    num_priorities = client.settings.num_priorities
    pattern = [p for p, share in enumerate(BURST_SHARES[:num_priorities]) for _ in range(share)]
    say(f"burst: {num_requests} short requests at once, priorities 0:1:2 as {':'.join(map(str, BURST_SHARES))}, "
        f"every other one with a deadline {', '.join(f'p{p} {s:.0f} s' for p, s in BURST_DEADLINE_S.items())}; "
        f"the worker runs 8 at a time and tolerates an estimated queue time of "
        f"{WORKER_ENV['WORKER_MAX_QUEUE_TIME_S']} s per priority")
    client.add_status_listener(watch.observe)
    outcomes: list[tuple[int, str, str, float | None]] = []

    async def one(index: int) -> None:
        priority = pattern[index % len(pattern)]
        deadline_s = BURST_DEADLINE_S.get(priority) if (index // len(pattern)) % 2 == 0 else None
        request = GenerationRequest(
            id=f"demo-burst-{os.getpid()}-{index}", max_new_tokens=max_new_tokens,
            timeout_ms=None if deadline_s is None else int(deadline_s * 1000),
            messages=[ChatMessage(role="user", content=f"Name a color and a fruit. ({index})")])
        handle = await client.submit(request, priority)
        try:
            final = await handle.result()
            outcomes.append((priority, final.status, final.reason, handle.e2e_s))
        except RequestTimeout:
            outcomes.append((priority, "timeout", "-", None))

    started = time.monotonic()
    tasks = [asyncio.create_task(one(i)) for i in range(num_requests)]
    while not all(t.done() for t in tasks):
        await asyncio.wait(tasks, timeout=3)
        status = client.board.latest.get(watch.worker_id)
        load = "" if status is None else (
            f"; worker: {status.num_waiting} waiting, {status.num_running} running, paused "
            f"{status.paused_partitions or '-'}, shedding {[e.priority for e in status.priorities if e.shed] or '-'}")
        say(f"... {len(outcomes)}/{num_requests} answered after {time.monotonic() - started:.0f} s{load}")
    for task in tasks:
        task.result()  # a failed submit surfaces here
    say(f"burst answered in {time.monotonic() - started:.1f} s. What the status topic showed:")
    print(watch.table(), flush=True)
    say("final records by priority (every request got exactly one):")
    print(outcome_table(outcomes, num_priorities), flush=True)
    for line in shedding_check(outcomes, json.loads(WORKER_ENV["WORKER_MAX_QUEUE_TIME_S"])[:num_priorities]):
        say(line)


async def session(settings: KafkaSettings, worker: subprocess.Popen, worker_id: str, log_path: Path,
                  args: argparse.Namespace) -> None:
    # Backoff off: the burst is meant to reach the worker and be shed there, not be held back here.
    async with LLMClient(settings, backoff=BackoffPolicy(enabled=False), default_timeout_s=180) as client:
        say("waiting for the worker's first status record (it loads the model first) ...")
        await wait_ready(client, worker, worker_id, log_path, settings.num_request_partitions, args.ready_timeout_s)
        await stream_side_by_side(client, args.max_new_tokens)
        watch = LoadWatch(worker_id, settings.num_priorities)
        await burst(client, watch, args.burst, args.burst_max_new_tokens)


async def create_topics(settings: KafkaSettings) -> None:
    from worker.broker.topics import ensure_topics

    states = await ensure_topics(settings)
    say("topics: " + ", ".join(f"{s.name} ({s.num_partitions} partitions)" for s in states.values()))


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", default=None, help="use this running broker instead of starting one")
    parser.add_argument("--port", type=int, default=9092, help="port of the demo's broker (a free one if busy)")
    parser.add_argument("--burst", type=int, default=60, help="requests in the overload burst")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="per answer in the streaming part")
    parser.add_argument("--burst-max-new-tokens", type=int, default=16, help="per answer in the burst")
    parser.add_argument("--ready-timeout-s", type=float, default=300.0, help="longest wait for the worker")


def run(args: argparse.Namespace) -> int:
    logging.getLogger("aiokafka").setLevel(logging.ERROR)  # its retries during topic creation are noise here
    demo_dir = PathSettings().home / "demo"
    demo_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    broker = worker = None

    def on_sigterm(signum, frame) -> None:
        raise KeyboardInterrupt  # one cleanup path for Ctrl-C and SIGTERM: the finally below

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        if args.bootstrap:
            settings = KafkaSettings(bootstrap_servers=args.bootstrap)
            say(f"using the broker at {args.bootstrap}")
        else:
            broker = start_broker(demo_dir / "kafka", args.port)
            settings = KafkaSettings(bootstrap_servers=broker.bootstrap_servers)
        asyncio.run(create_topics(settings))
        say("provisioning SmolLM2-135M-Instruct (downloads and converts it once, about a minute) ...")
        from worker.model.pull import ensure_default_model

        say(f"model ready: {ensure_default_model()}")
        worker_id = f"demo-{os.getpid()}"
        log_path = demo_dir / "worker.log"
        log_path.write_text("")
        worker = start_worker(settings, worker_id, log_path)
        asyncio.run(session(settings, worker, worker_id, log_path, args))
        say(f"all done in {time.monotonic() - started:.0f} s")
        return 0
    except KeyboardInterrupt:
        say("interrupted; cleaning up")
        return 130
    except Exception as exc:  # noqa: BLE001 - the demo explains any failure in one message, then cleans up
        say(f"failed: {exc}")
        return 1
    finally:
        # Cleanup must finish even if the signal comes again (a second Ctrl-C would orphan the broker).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_worker(worker)
        if broker is not None:
            say("stopping the Kafka broker the demo started ...")
            broker.stop()
        say(f"stopped everything the demo started ({time.monotonic() - started:.0f} s in all)")

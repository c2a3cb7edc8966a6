"""`make compose-check`: bring compose.yaml up for real with podman, use it, scale it, tear it down.

    .venv/bin/python deploy/containers/compose_check.py [--registry] [--keep]

Steps, each printed with its duration:
  1. podman: installed with apt-get when missing (root), /etc/containers/containers.conf written when absent
     (sandboxes that refuse rlimits and cgroup controllers need it), and podman-compose from PyPI in a venv
     of its own (Debian 12's podman-compose 1.0.3 ignores profiles and --scale).
  2. images: deploy/containers/build_images.sh (Debian base, wheelhouse, Kafka jars, images), unless --registry
     (then compose.yaml's own images, built from apache/kafka and python:3.11-slim: for hosts that reach a
     registry; not the path the check was run on without one). The GPU image must have a C compiler.
  3. a previous run's containers and volumes are removed: the check may run twice.
  4. the broker, until compose's health check passes; a gateway API key on the gateway's volume.
  5. the topics job (exit 0), two workers (`--scale worker=2`, each until /ready), the gateway, then the
     example producer, whose demo request the real model must answer. Each group is started with `up -d
     --no-deps` in depends_on order (podman 4.3 can do neither health conditions nor nested --requires).
  6. the gateway answers a chat completion through the official `openai` client with that key.
  7. 2 -> 1 workers with requests in flight: every request gets exactly one final (read_committed read of the
     result topic from its start), none is lost.
  8. down, volumes removed (unless --keep).
Exit status 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kafka-llm-worker"
PODMAN_COMPOSE_VERSION = "1.6.0"
PODMAN_COMPOSE = CACHE / "containers" / f"podman-compose-{PODMAN_COMPOSE_VERSION}" / "bin" / "podman-compose"
CONTAINERS_CONF = Path("/etc/containers/containers.conf")
# The settings a sandbox without rlimits, systemd or cgroup v2 controllers needs; on a normal host they only
# choose what podman would pick anyway.
SANDBOX_CONTAINERS_CONF = """\
[containers]
default_ulimits = []
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""
PROJECT = "kafka-llm-worker"
HOST_BOOTSTRAP = "localhost:29092"
GATEWAY_URL = "http://127.0.0.1:8000/v1"
MODEL = "smollm2-135m-instruct"

_started = time.monotonic()
_timings: list[tuple[str, float]] = []


def say(message: str) -> None:
    print(f"[{time.monotonic() - _started:7.1f}s] {message}", flush=True)


class Step:
    def __init__(self, title: str) -> None:
        self.title = title

    def __enter__(self) -> "Step":
        print(f"\n==> {self.title}", flush=True)
        self.t0 = time.monotonic()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        took = time.monotonic() - self.t0
        _timings.append((self.title, took))
        say(f"{'done' if exc_type is None else 'FAILED'}: {self.title} ({took:.0f} s)")


class CheckFailed(RuntimeError):
    pass


def run(cmd: list[str], *, check: bool = True, capture: bool = False, timeout: float | None = None,
        quiet: bool = False) -> subprocess.CompletedProcess:
    if not quiet:
        say("$ " + " ".join(cmd))
    proc = subprocess.run(cmd, cwd=ROOT, text=True, timeout=timeout,
                          stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None)
    if check and proc.returncode != 0:
        detail = (proc.stdout or "") + (proc.stderr or "") if capture else ""
        raise CheckFailed(f"{' '.join(cmd)} exited {proc.returncode}\n{detail[-3000:]}")
    return proc


def compose(*args: str, files: list[str], **kwargs) -> subprocess.CompletedProcess:
    cmd = [str(PODMAN_COMPOSE), "-p", PROJECT]
    for f in files:
        cmd += ["-f", f]
    return run(cmd + list(args), **kwargs)


def wait_for(what: str, predicate, timeout_s: float, interval_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


def containers(service: str | None = None) -> list[dict]:
    """The project's containers, of one service or all."""
    filters = ["--filter", f"label=io.podman.compose.project={PROJECT}"]
    if service is not None:
        filters += ["--filter", f"label=com.docker.compose.service={service}"]
    out = run(["podman", "ps", "-a", "--format", "json", *filters], capture=True, quiet=True).stdout
    return json.loads(out or "[]")


def name_of(container: dict) -> str:
    return container["Names"][0]


def running(service: str) -> list[str]:
    return [name_of(c) for c in containers(service) if c["State"] == "running"]


def exited_with(service: str) -> int | None:
    found = containers(service)
    if found and found[0]["State"] == "exited":
        return int(found[0]["ExitCode"])
    return None


def logs(name: str, tail: int = 20) -> str:
    proc = run(["podman", "logs", "--tail", str(tail), name], capture=True, check=False, quiet=True)
    return (proc.stdout or "") + (proc.stderr or "")


# ---- steps -----------------------------------------------------------------------------------------------


def ensure_podman() -> None:
    missing = [tool for tool in ("podman", "runc", "debootstrap", "mvn", "java") if shutil.which(tool) is None]
    if missing:
        packages = {"podman": "podman", "runc": "runc", "debootstrap": "debootstrap", "mvn": "maven",
                    "java": "openjdk-17-jre-headless"}
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise CheckFailed(f"missing {missing}; install them (Debian: apt-get install "
                              f"{' '.join(packages[m] for m in missing)})")
        run(["apt-get", "update", "-qq"])
        run(["apt-get", "install", "-y", "-qq", *sorted({packages[m] for m in missing})],
            timeout=1800)
    else:
        say("podman, runc, debootstrap, mvn and java are installed")
    if not CONTAINERS_CONF.exists():
        if os.geteuid() != 0:
            raise CheckFailed(f"{CONTAINERS_CONF} is missing and only root may write it")
        CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
        CONTAINERS_CONF.write_text(SANDBOX_CONTAINERS_CONF)
        say(f"wrote {CONTAINERS_CONF}:\n{SANDBOX_CONTAINERS_CONF}")
    else:
        say(f"{CONTAINERS_CONF} exists; kept as it is")
    if not PODMAN_COMPOSE.exists():
        venv = PODMAN_COMPOSE.parent.parent
        python = shutil.which("python3", path="/usr/bin:/usr/local/bin") or sys.executable
        run([python, "-m", "venv", str(venv)])
        run([str(venv / "bin" / "pip"), "install", "-q", f"podman-compose=={PODMAN_COMPOSE_VERSION}"])
    run(["podman", "--version"], quiet=True)
    run([str(PODMAN_COMPOSE), "--version"], quiet=True)


def start_broker(files: list[str]) -> None:
    compose("up", "-d", "kafka", files=files, timeout=300)
    (kafka,) = wait_for("the kafka container", lambda: running("kafka"), 60)
    # podman runs health checks from systemd timers; without systemd nothing runs them, so run compose's own
    # health check command here until it passes.
    wait_for("kafka's health check", lambda: run(["podman", "healthcheck", "run", kafka], check=False,
                                                 capture=True, quiet=True).returncode == 0, 180, 3)
    say(f"{kafka} is healthy")


def tear_down(files: list[str], grace_s: int) -> None:
    """`down -v`, then whatever it missed: podman-compose stops only the replicas its current scale names."""
    compose("down", "-v", "-t", str(grace_s), files=files, check=False)
    left = [name_of(c) for c in containers()]
    if left:
        say(f"`down` left {left}; removing them (SIGTERM, {grace_s} s grace)")
        run(["podman", "rm", "-f", "-t", str(grace_s), *left], check=False)
        compose("down", "-v", "-t", str(grace_s), files=files, check=False)


def add_gateway_key(files: list[str]) -> str:
    proc = compose("run", "--rm", "--no-deps", "gateway", "llm-worker", "gateway", "keys", "add", "--tenant",
                   "compose-check", "--name", "compose-check", files=files, capture=True)
    keys = [line.strip() for line in proc.stdout.splitlines() if line.strip().startswith("sk-")]
    if not keys:
        raise CheckFailed(f"no key in the output of `gateway keys add`:\n{proc.stdout}{proc.stderr}")
    say("a gateway key was added to the gateway-data volume (not printed)")
    return keys[-1]


def worker_ready(name: str) -> bool:
    probe = "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9400/ready', timeout=3)"
    return run(["podman", "exec", name, "python", "-c", probe], check=False, capture=True,
               quiet=True).returncode == 0


def start_stack(files: list[str], workers: int) -> None:
    # One service group at a time, each waited for here: podman 4.3 cannot wait for a health check (podman-compose
    # skips that condition), and it fails to start a container whose dependency has dependencies of its own
    # ("generating dependency graph ... not found in input list"), so the dependencies are not handed to it
    # (--no-deps). Docker Compose does this ordering itself from depends_on.
    compose("up", "-d", "--no-deps", "topics", files=files, timeout=300)
    wait_for("the topics job to finish", lambda: exited_with("topics") is not None or None, 180)
    code = exited_with("topics")
    if code != 0:
        raise CheckFailed(f"the topics job exited {code}:\n{logs(name_of(containers('topics')[0]), 50)}")
    say("the topics job exited 0")
    compose("up", "-d", "--no-deps", "--scale", f"worker={workers}", "worker", "gateway", files=files, timeout=300)
    names = wait_for(f"{workers} running workers", lambda: (r := running("worker")) and len(r) == workers and r,
                     120)
    for name in names:
        wait_for(f"{name} ready (/ready: model loaded, group joined)", lambda n=name: worker_ready(n), 600, 3)
        say(f"{name} is ready")
    if containers("worker-gpu"):
        raise CheckFailed("worker-gpu started without its profile")


def check_producer(files: list[str]) -> None:
    compose("up", "-d", "--no-deps", "producer", files=files, timeout=300)
    wait_for("the producer's demo request", lambda: exited_with("producer") is not None or None, 300, 3)
    code = exited_with("producer")
    # All of it: podman 4.3's `logs --tail` misorders the partial lines a streamed answer is written in.
    out = logs(name_of(containers("producer")[0]), -1)
    print("    producer output:\n" + "\n".join("      " + line for line in out.strip().splitlines()))
    if code != 0:
        raise CheckFailed(f"the producer exited {code}")


def check_gateway(key: str) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=GATEWAY_URL, api_key=key, max_retries=0, timeout=120)

    def answer():
        try:
            return client.chat.completions.create(
                model=MODEL, max_completion_tokens=32, temperature=0,
                messages=[{"role": "user", "content": "Name one use of a message queue."}])
        except Exception as exc:  # noqa: BLE001 - the gateway may still be starting: connection refused, 503
            say(f"gateway not answering yet: {type(exc).__name__}: {str(exc)[:120]}")
            return None

    reply = wait_for("an answer from the gateway", answer, 180, 5)
    text = reply.choices[0].message.content or ""
    say(f"gateway answered ({reply.usage.completion_tokens} tokens, finish {reply.choices[0].finish_reason}): "
        f"{text.strip()[:200]!r}")
    if not text.strip():
        raise CheckFailed("the gateway's answer is empty")


async def scale_to_one(files: list[str]) -> list[str]:
    """`up --scale worker=1`, in a process of its own so that the client keeps reading answers meanwhile."""
    cmd = [str(PODMAN_COMPOSE), "-p", PROJECT, *sum((["-f", f] for f in files), []), "up", "-d", "--no-deps",
           "--scale", "worker=1", "worker"]
    say("$ " + " ".join(cmd))
    proc = await asyncio.create_subprocess_exec(*cmd, cwd=ROOT)
    if await asyncio.wait_for(proc.wait(), 300) != 0:
        raise CheckFailed(f"`up --scale worker=1` exited {proc.returncode}")
    left = running("worker")
    if len(left) > 1:
        # podman-compose creates the replicas a scale asks for but leaves extra ones running; stop the last one as
        # Docker Compose's scale-down does: SIGTERM, then SIGKILL after the service's stop_grace_period.
        extra = sorted(left)[-1]
        grace = compose_services(files)["worker"]["stop_grace_period"].removesuffix("s")
        say(f"podman-compose left {left} running; stopping {extra} as compose's scale-down does (SIGTERM, "
            f"{grace} s grace)")
        stop = await asyncio.create_subprocess_exec("podman", "stop", "-t", grace, extra)
        await stop.wait()
        await (await asyncio.create_subprocess_exec("podman", "rm", extra)).wait()
    return running("worker")


def compose_services(files: list[str]) -> dict[str, dict]:
    import yaml

    services: dict[str, dict] = {}
    for f in files:
        for name, spec in yaml.safe_load((ROOT / f).read_text())["services"].items():
            services.setdefault(name, {}).update(spec)
    return services


async def scale_down_under_load(files: list[str], num_requests: int, max_new_tokens: int) -> dict:
    from aiokafka import AIOKafkaConsumer

    from producer_examples.client import LLMClient
    from schemas.decode import decode_result
    from schemas.request import GenerationRequest
    from schemas.result import FinalRecord
    from worker.kafka_settings import KafkaSettings

    kafka = KafkaSettings(bootstrap_servers=HOST_BOOTSTRAP)
    run_id = uuid.uuid4().hex[:8]
    ids = [f"scale-{run_id}-{i}" for i in range(num_requests)]
    async with LLMClient(kafka, default_timeout_s=600) as client:
        handles = []
        for i, rid in enumerate(ids):
            request = GenerationRequest(id=rid, prompt=f"Count from {i} to {i + 20}, one number per line.",
                                        max_new_tokens=max_new_tokens)
            handles.append(await client.submit(request, priority=1 + i % 2))
        say(f"submitted {num_requests} requests; letting both workers start on them")
        await asyncio.sleep(5)
        before = running("worker")
        say(f"scaling 2 -> 1 while requests are in flight ({client.num_in_flight} not answered yet)")
        finals, after = await asyncio.gather(
            asyncio.gather(*(h.result() for h in handles), return_exceptions=True), scale_to_one(files))
        say(f"workers before {before}, after {after}")
        failures = [f for f in finals if isinstance(f, BaseException)]
        if failures:
            raise CheckFailed(f"{len(failures)} requests raised in the client, e.g. {failures[0]!r}")
        statuses: dict[str, int] = {}
        by_worker: dict[str, int] = {}
        for final in finals:
            statuses[final.status] = statuses.get(final.status, 0) + 1
            by_worker[final.worker_id] = by_worker.get(final.worker_id, 0) + 1
        # A final's attempt is the group generation in which its worker fetched the request: those of the
        # generation after the scale-down were moved from the stopped worker.
        attempts: dict[int, int] = {}
        for final in finals:
            attempts[final.attempt] = attempts.get(final.attempt, 0) + 1
        say(f"client saw {len(finals)} finals: {statuses}; by worker {by_worker}; by attempt {attempts}")

    # Every final ever committed to the result topic for these ids, read from its start.
    consumer = AIOKafkaConsumer(kafka.result_topic, **kafka.client_kwargs(), group_id=None,
                                enable_auto_commit=False, auto_offset_reset="earliest",
                                isolation_level="read_committed")
    await consumer.start()
    counts: dict[str, int] = dict.fromkeys(ids, 0)
    try:
        # Without a group the consumer assigns itself every partition once it has the topic's metadata.
        deadline = time.monotonic() + 30
        while not consumer.assignment():
            if time.monotonic() > deadline:
                raise CheckFailed(f"no partitions of {kafka.result_topic} assigned")
            await asyncio.sleep(0.2)
        partitions = sorted(consumer.assignment())
        await consumer.seek_to_beginning(*partitions)
        end = await consumer.end_offsets(partitions)
        while True:
            positions = [await consumer.position(tp) for tp in partitions]
            if all(pos >= end[tp] for pos, tp in zip(positions, partitions)):
                break
            for messages in (await consumer.getmany(timeout_ms=500)).values():
                for m in messages:
                    record = decode_result(m.value)
                    if isinstance(record, FinalRecord) and record.id in counts:
                        counts[record.id] += 1
    finally:
        await consumer.stop()
    missing = [i for i, n in counts.items() if n == 0]
    duplicated = {i: n for i, n in counts.items() if n > 1}
    say(f"result topic: {sum(counts.values())} finals for {num_requests} requests; missing {len(missing)}, "
        f"duplicated {len(duplicated)}")
    if missing or duplicated:
        raise CheckFailed(f"lost or duplicated finals: missing {missing}, duplicated {duplicated}")
    if len(after) != 1:
        raise CheckFailed(f"expected 1 worker after scaling down, found {after}")
    not_completed = {s: n for s, n in statuses.items() if s != "completed"}
    if not_completed:
        raise CheckFailed(f"requests not completed: {not_completed}")
    return {"requests": num_requests, "statuses": statuses, "workers_before": before, "workers_after": after}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--registry", action="store_true",
                        help="use compose.yaml's registry images (apache/kafka, python:3.11-slim) as they are")
    parser.add_argument("--keep", action="store_true", help="leave the stack running at the end")
    parser.add_argument("--requests", type=int, default=20, help="requests in flight while scaling down")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()
    files = ["compose.yaml"] if args.registry else ["compose.yaml", "compose.local.yaml"]
    ok = False
    try:
        with Step("1. podman and podman-compose"):
            ensure_podman()
        with Step("2. images"):
            if args.registry:
                compose("--profile", "gpu", "build", files=files)
            else:
                # The wheelhouse is filled by this interpreter's pip unless PYTHON names another 3.11.
                os.environ.setdefault("PYTHON", sys.executable)
                run(["bash", "deploy/containers/build_images.sh"])
            cc = run(["podman", "run", "--rm", "kafka-llm-worker:cuda", "cc", "--version"], capture=True)
            say(f"the GPU image has a C compiler for Triton: {cc.stdout.splitlines()[0]}")
        with Step("3. remove what a previous run left"):
            tear_down(files, grace_s=5)
        with Step("4. broker up and healthy; a gateway key"):
            start_broker(files)
            key = add_gateway_key(files)
        with Step("5. topics job, 2 workers, gateway, producer: the demo request"):
            start_stack(files, workers=2)
            check_producer(files)
        with Step("6. the gateway through the openai client"):
            check_gateway(key)
        with Step("7. scale 2 -> 1 workers with requests in flight"):
            result = asyncio.run(scale_down_under_load(files, args.requests, args.max_new_tokens))
            say(f"no request lost: {result}")
        ok = True
    except (CheckFailed, subprocess.TimeoutExpired) as exc:
        print(f"\nFAILED: {exc}", flush=True)
        for service in ("kafka", "topics", "worker", "gateway", "producer"):
            for c in containers(service):
                print(f"--- {name_of(c)} ({c['State']}) last lines:\n{logs(name_of(c), 15)}", flush=True)
    finally:
        if not args.keep:
            with Step("8. down, volumes removed"):
                tear_down(files, grace_s=70)
    print("\ntimings:")
    for title, took in _timings:
        print(f"  {took:7.1f} s  {title}")
    print(f"  {time.monotonic() - _started:7.1f} s  total")
    print("compose check " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())

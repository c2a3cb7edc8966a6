"""`llm-worker loadgen`: an open-loop load generator (Poisson arrivals) with a priority mix, mixed prompt and
output lengths and per-priority deadlines; prints a live progress line and a table of throughput and
client-side TTFT / end-to-end percentiles per priority, and saves everything as JSON.

Bounded: arrivals stop after --duration seconds or --max-requests requests, whichever comes first; then it
waits at most --drain-s for the outstanding answers and counts the rest as timeouts. Open loop means the
arrival clock never waits for answers (a slow worker shows as latency and rejections, not as a lower rate);
only --max-in-flight holds arrivals back, and such a run says how long it was held.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import json
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from llm_client import BackoffPolicy, LLMClient, RequestTimeout
from llm_client.commands.loadstats import (
    LengthDist, format_table, parse_deadlines, parse_priority_mix, poisson_gaps, summarize,
)
from schemas.request import GenerationRequest
from worker.kafka_settings import KafkaSettings

HELP = "Poisson load by priority; throughput and latency percentiles"
"""The one-line help of `llm-worker --help` (worker/cli.py finds this command by its entry point)."""

WORDS = ("river", "mountain", "engine", "garden", "signal", "harbor", "lantern", "market", "orbit", "thread",
         "valley", "compass", "meadow", "circuit", "glacier", "library")


@dataclass(frozen=True, slots=True)
class LoadConfig:
    rate: float = 5.0
    duration_s: float = 10.0
    max_requests: int = 10_000
    priority_mix: str = "0:0.2,1:0.3,2:0.5"
    prompt_len_dist: str = "0.8:8-48,0.2:200-600"
    output_len_dist: str = "0.8:8-32,0.2:64-128"
    deadline_s: str = "none"
    drain_s: float = 60.0
    max_in_flight: int = 1000
    seed: int = 0
    backoff: bool = True


def make_prompt(num_words: int, rng: random.Random) -> str:
    """About num_words tokens of text (the words are common single tokens in most vocabularies)."""
    body = " ".join(rng.choice(WORDS) for _ in range(max(0, num_words - 6)))
    return f"Write one short sentence about these words: {body}".strip()


class Progress:
    """Counters behind the live line: sent, completed, rejected by reason, errors, timeouts, in flight."""

    def __init__(self) -> None:
        self.num_sent = self.num_completed = self.num_errors = self.num_timeouts = self.num_in_flight = 0
        self.rejected: dict[str, int] = {}
        self.held_s = 0.0

    def line(self, elapsed_s: float) -> str:
        rejected = ",".join(f"{r}={n}" for r, n in sorted(self.rejected.items())) or "0"
        return (f"[{elapsed_s:6.1f}s] sent {self.num_sent} | completed {self.num_completed} | rejected {rejected} | "
                f"errors {self.num_errors} | timeouts {self.num_timeouts} | in flight {self.num_in_flight}")


async def one_request(client: LLMClient, request: GenerationRequest, priority: int, t0: float,
                      progress: Progress, record: dict) -> None:
    progress.num_in_flight += 1
    try:
        handle = await client.submit(request, priority)
        progress.num_sent += 1
        record.update(sent_at_s=round((handle.sent_at or time.monotonic()) - t0, 4), backoff_s=handle.backoff_s)
        final = await handle.result()
        record.update(status=final.status, reason=final.reason, attempt=final.attempt,
                      completion_tokens=final.usage.completion_tokens, ttft_s=handle.ttft_s, e2e_s=handle.e2e_s,
                      worker_ttft_ms=final.timings.ttft_ms, worker_e2e_ms=final.timings.e2e_ms)
        if final.status == "completed":
            progress.num_completed += 1
        elif final.status == "rejected":
            progress.rejected[final.reason] = progress.rejected.get(final.reason, 0) + 1
        else:
            progress.num_errors += 1
    except RequestTimeout:
        record.update(status="timeout", reason="timeout")
        progress.num_timeouts += 1
        handle.close()
    except Exception as exc:  # noqa: BLE001 - a failed send is a result of the run, not the end of it
        record.update(status="error", reason=f"client:{type(exc).__name__}", message=str(exc)[:200])
        progress.num_errors += 1
    finally:
        progress.num_in_flight -= 1


async def run_load(settings: KafkaSettings, config: LoadConfig, *, out=None) -> dict:
    """Run the load; returns the result document (config, totals, per-priority table, per-request records)."""
    out = out or sys.stderr
    rng = random.Random(config.seed)
    mix = parse_priority_mix(config.priority_mix, settings.num_priorities)
    prompt_dist, output_dist = LengthDist.parse(config.prompt_len_dist), LengthDist.parse(config.output_len_dist)
    deadlines = parse_deadlines(config.deadline_s, settings.num_priorities)
    run_id = uuid.uuid4().hex[:8]
    records: list[dict] = []
    tasks: set[asyncio.Task] = set()
    progress = Progress()
    tty = out.isatty()
    backoff = BackoffPolicy(enabled=config.backoff)
    async with LLMClient(settings, backoff=backoff, default_timeout_s=config.duration_s + config.drain_s) as client:
        t0 = time.monotonic()

        async def report() -> None:
            while True:
                await asyncio.sleep(0.5 if tty else 2.0)
                print(("\r" if tty else "") + progress.line(time.monotonic() - t0), end="" if tty else "\n",
                      file=out, flush=True)

        reporter = asyncio.create_task(report())
        next_at = t0
        gaps = poisson_gaps(config.rate, rng)
        for index in range(config.max_requests):
            next_at += next(gaps)
            if next_at - t0 >= config.duration_s:
                break
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            while progress.num_in_flight >= config.max_in_flight:
                held_from = time.monotonic()
                await asyncio.sleep(0.01)
                progress.held_s += time.monotonic() - held_from
            priority = rng.choices(list(mix), weights=list(mix.values()))[0]
            num_words, max_new_tokens = prompt_dist.sample(rng), output_dist.sample(rng)
            deadline = deadlines[priority]
            request = GenerationRequest(
                id=f"load-{run_id}-{index}", prompt=make_prompt(num_words, rng), max_new_tokens=max_new_tokens,
                timeout_ms=None if deadline is None else max(1, int(deadline * 1000)),
            )
            record = {"id": request.id, "priority": priority, "prompt_words": num_words,
                      "max_new_tokens": max_new_tokens, "deadline_s": deadline, "status": "timeout",
                      "reason": "timeout", "completion_tokens": 0, "ttft_s": None, "e2e_s": None}
            records.append(record)
            task = asyncio.create_task(one_request(client, request, priority, t0, progress, record))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        send_window_s = time.monotonic() - t0
        if tasks:
            _, stragglers = await asyncio.wait(set(tasks), timeout=config.drain_s)
            for task in stragglers:  # their records keep status "timeout"
                task.cancel()
            progress.num_timeouts += len(stragglers)
            await asyncio.gather(*stragglers, return_exceptions=True)
        wall_s = time.monotonic() - t0
        reporter.cancel()
        print(("\r" if tty else "") + progress.line(wall_s), file=out, flush=True)
    return {
        "config": asdict(config),
        "kafka": {"bootstrap_servers": settings.bootstrap_servers, "request_topic": settings.request_topic},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": round(wall_s, 3),
        "send_window_s": round(send_window_s, 3),
        "held_s": round(progress.held_s, 3),
        "totals": summarize(records, wall_s)["all"] if records else {},
        "per_priority": {k: v for k, v in summarize(records, wall_s).items() if k != "all"},
        "requests": records,
    }


def configure_parser(parser: argparse.ArgumentParser) -> None:
    d = LoadConfig()
    parser.add_argument("--rate", type=float, default=d.rate, help="mean arrivals per second (Poisson)")
    parser.add_argument("--duration", type=float, default=d.duration_s, help="seconds of arrivals")
    parser.add_argument("--max-requests", type=int, default=d.max_requests, help="stop after this many requests")
    parser.add_argument("--priority-mix", default=d.priority_mix, help="PRIORITY:WEIGHT,...")
    parser.add_argument("--prompt-len-dist", default=d.prompt_len_dist,
                        help="prompt words: WEIGHT:LO-HI,... (mixture of uniform ranges)")
    parser.add_argument("--output-len-dist", default=d.output_len_dist, help="max_new_tokens: WEIGHT:LO-HI,...")
    parser.add_argument("--deadline-s", default=d.deadline_s,
                        help='deadline per request: "none", "30", or per priority "0:5,1:15,2:30"')
    parser.add_argument("--drain-s", type=float, default=d.drain_s, help="wait for answers after the last arrival")
    parser.add_argument("--max-in-flight", type=int, default=d.max_in_flight, help="hold arrivals above this")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the workload (arrivals, mix, lengths)")
    parser.add_argument("--no-backoff", action="store_true", help="ignore the workers' status reports")
    parser.add_argument("--out", type=Path, default=Path("loadgen-results.json"), help="JSON results file")
    parser.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (KAFKA_BOOTSTRAP_SERVERS)")


def config_from_args(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(
        rate=args.rate, duration_s=args.duration, max_requests=args.max_requests, priority_mix=args.priority_mix,
        prompt_len_dist=args.prompt_len_dist, output_len_dist=args.output_len_dist, deadline_s=args.deadline_s,
        drain_s=args.drain_s, max_in_flight=args.max_in_flight, seed=args.seed, backoff=not args.no_backoff,
    )


async def main_async(args: argparse.Namespace) -> dict:
    settings = KafkaSettings(**({"bootstrap_servers": args.bootstrap} if args.bootstrap else {}))
    config = config_from_args(args)
    # Parse every spec before connecting: a typo should cost nothing.
    parse_priority_mix(config.priority_mix, settings.num_priorities)
    LengthDist.parse(config.prompt_len_dist), LengthDist.parse(config.output_len_dist)
    parse_deadlines(config.deadline_s, settings.num_priorities)
    print(f"loadgen: {config.rate}/s for {config.duration_s}s (at most {config.max_requests}) to "
          f"{settings.bootstrap_servers}, mix {config.priority_mix}", file=sys.stderr)
    result = await run_load(settings, config)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(summarize(result["requests"], result["wall_s"])) if result["requests"] else "no requests")
    print(f"results: {args.out}", file=sys.stderr)
    return result


def run(args: argparse.Namespace) -> int:
    logging.getLogger("aiokafka").setLevel(logging.WARNING)  # its INFO lines would interleave the output
    try:
        asyncio.run(main_async(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    return 0

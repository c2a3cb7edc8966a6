"""`llm-worker usage report`: what each tenant used, per priority, from the usage topic (schemas/usage.py).

Reads the usage topic with isolation.level=read_committed from `--since` to its end as of the start of the
read, and sums the records per tenant and priority: requests, by status, and prompt, cached and output tokens.
With exactly-once finals every request has one committed usage record; without, a request served twice has one
per attempt, and the highest attempt of each id is the one counted. A table by default; `--json` prints the
rows (and the totals) for a billing job to read.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition

from schemas.decode import decode_usage
from schemas.usage import UsageRecord
from worker.kafka_settings import KafkaSettings

HELP = "sum the usage topic per tenant and priority (table or JSON)"
_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(text: str, now_s: float | None = None) -> int:
    """Unix epoch milliseconds of `--since`: a duration back from now (90s, 15m, 24h, 7d) or an ISO 8601 date or
    date-time (UTC unless it names an offset)."""
    now_s = time.time() if now_s is None else now_s
    match = _RELATIVE.match(text.strip())
    if match:
        return int((now_s - float(match.group(1)) * _UNIT_S[match.group(2)]) * 1000)
    try:
        moment = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ValueError(f"--since {text!r}: give a duration such as 24h or 7d, or an ISO date such as "
                         "2026-12-01 or 2026-12-01T08:00:00Z") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return int(moment.timestamp() * 1000)


@dataclass(slots=True)
class Row:
    tenant: str
    priority: int
    requests: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


def summarize(records: list[UsageRecord]) -> list[Row]:
    """One row per (tenant, priority), counting each request id once (its highest attempt)."""
    latest: dict[str, UsageRecord] = {}
    for record in records:
        seen = latest.get(record.id)
        if seen is None or record.attempt >= seen.attempt:
            latest[record.id] = record
    rows: dict[tuple[str, int], Row] = {}
    for record in latest.values():
        row = rows.setdefault((record.tenant, record.priority), Row(record.tenant, record.priority))
        row.requests += 1
        row.by_status[record.status] = row.by_status.get(record.status, 0) + 1
        row.prompt_tokens += record.prompt_tokens
        row.cached_tokens += record.cached_tokens
        row.completion_tokens += record.completion_tokens
    return [rows[key] for key in sorted(rows)]


def render_table(rows: list[Row]) -> str:
    header = ("tenant", "priority", "requests", "completed", "other", "prompt", "cached", "output")
    body = [(row.tenant or "(none)", str(row.priority), str(row.requests), str(row.by_status.get("completed", 0)),
             str(row.requests - row.by_status.get("completed", 0)), str(row.prompt_tokens), str(row.cached_tokens),
             str(row.completion_tokens)) for row in rows]
    total = ("total", "", *(str(sum(int(line[i]) for line in body)) for i in range(2, len(header))))
    lines = [header, *body, total]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    fmt = lambda line: "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)  # noqa: E731 - one use
                                 for i, (cell, w) in enumerate(zip(line, widths)))
    return "\n".join([fmt(header), *(fmt(line) for line in body), fmt(total)])


async def read_usage(kafka: KafkaSettings, since_ms: int, timeout_s: float = 60.0) -> list[UsageRecord]:
    """Every committed usage record written at or after since_ms, up to the topic's end when the read began."""
    # Named at construction so that start() fetches its metadata; then assigned by hand (no group, no commits).
    consumer = AIOKafkaConsumer(kafka.usage_topic, **kafka.client_kwargs(), enable_auto_commit=False,
                                isolation_level="read_committed", auto_offset_reset="earliest")
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(kafka.usage_topic)
        consumer.unsubscribe()
        if not partitions:
            raise LookupError(f"usage topic {kafka.usage_topic!r} does not exist (llm-worker topics creates it)")
        tps = [TopicPartition(kafka.usage_topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        starts = await consumer.offsets_for_times({tp: since_ms for tp in tps})
        remaining = set()
        for tp in tps:
            start = starts.get(tp)
            if start is None:  # nothing written since: skip the partition
                continue
            consumer.seek(tp, start.offset)
            if start.offset < ends[tp]:
                remaining.add(tp)
        records: list[UsageRecord] = []
        deadline = time.monotonic() + timeout_s
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the usage topic was not read to its end within {timeout_s:g} s")
            batches = await consumer.getmany(*remaining, timeout_ms=500)
            for tp, messages in batches.items():
                for message in messages:
                    if message.timestamp >= since_ms and message.value is not None:
                        try:
                            records.append(decode_usage(message.value))
                        except msgspec.DecodeError:
                            continue  # not a usage record: nothing to bill
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
        return records
    finally:
        await consumer.stop()


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    report = sub.add_parser("report", help="per tenant and priority since a moment")
    report.add_argument("--since", default="24h", help="a duration back from now (15m, 24h, 7d) or an ISO date "
                        "or date-time, UTC unless it names an offset (default 24h)")
    report.add_argument("--json", action="store_true", help="JSON rows and totals instead of a table")
    report.add_argument("--timeout-s", type=float, default=60.0, help="give up reading after this long")


def run(args: argparse.Namespace) -> int:
    try:
        since_ms = parse_since(args.since)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    kafka = KafkaSettings()
    if not kafka.usage_topic:
        print("KAFKA_USAGE_TOPIC is empty: no usage records are written", file=sys.stderr)
        return 2
    try:
        records = asyncio.run(read_usage(kafka, since_ms, args.timeout_s))
    except (LookupError, TimeoutError) as exc:
        print(exc, file=sys.stderr)
        return 1
    rows = summarize(records)
    if args.json:
        totals = {key: sum(getattr(row, key) for row in rows)
                  for key in ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")}
        print(json.dumps({"since_ms": since_ms, "topic": kafka.usage_topic, "rows": [asdict(row) for row in rows],
                          "totals": totals}, indent=2))
    else:
        print(render_table(rows))
    return 0

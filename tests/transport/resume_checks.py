"""Checks shared by the resumption tests: what a read_committed reader makes of each request's records across
attempts (stitched by our client's rules), and whether the output equals an uninterrupted run."""

from __future__ import annotations

from dataclasses import dataclass, field

from llm_client import RequestHandle, StreamGap
from schemas.result import FinalRecord, StreamChunk
from tests.transport.kafka_helpers import Collector


@dataclass
class Stitched:
    resumed: int = 0
    """Requests whose final attempt continued an earlier attempt's stream."""
    restarted: int = 0
    """Requests served again from their first token (no record of their progress was committed in time)."""
    repeated_seqs: int = 0
    """(id, index, seq) written by more than one attempt of a resumed stream: a reader would see them twice."""
    tokens_kept: int = 0
    """Output tokens a resumed attempt did not generate again."""
    problems: list[str] = field(default_factory=list)


def records_in_order(collector: Collector, request_id: str) -> list[StreamChunk | FinalRecord]:
    """The request's records, attempt by attempt in the order each attempt's arrived."""
    attempts = sorted({a for (i, a) in collector.results.chunks if i == request_id}
                      | {f.attempt for f in collector.results.finals.get(request_id, ())})
    out: list[StreamChunk | FinalRecord] = []
    for attempt in attempts:
        out += collector.results.chunks.get((request_id, attempt), [])
        out += [f for f in collector.results.finals.get(request_id, ()) if f.attempt == attempt]
    return out


async def stitch(collector: Collector, request_ids: list[str]) -> Stitched:
    """Feed each request's records to a client handle, as a reader of the result topic would, and check that the
    stream it yields is whole: no gap, nothing taken back, its text and tokens those of the final."""
    out = Stitched()
    for request_id in request_ids:
        handle = RequestHandle(request_id, 0, 0, timeout_s=1, on_close=lambda _: None)
        records = records_in_order(collector, request_id)
        for record in records:
            handle.feed(record)
        try:
            deltas = [d async for d in handle.stream()]
        except StreamGap as gap:
            out.problems.append(f"{request_id}: {gap}")
            continue
        final = await handle.result()
        if final.status != "completed":
            out.problems.append(f"{request_id}: {final.status} {final.reason} {final.message}")
            continue
        resumed = any(r.resumed_at is not None for r in records if r.attempt == final.attempt)
        if resumed:
            out.resumed += 1
        elif handle.num_restarts:
            out.restarted += 1
        if any(d.rewound_to is not None for d in deltas):
            out.problems.append(f"{request_id}: the reader had to take text back")
        for index in {d.index for d in deltas}:
            mine = [d for d in deltas if d.index == index]
            texts = "".join(d.text for d in mine)
            completion = final if final.index is None and not handle._completions else \
                (await handle.completions())[index]
            if texts != completion.text or [t for d in mine for t in d.token_ids] != completion.token_ids:
                out.problems.append(f"{request_id}[{index}]: the stitched stream is not the final's output")
        seqs: dict[tuple[int, int], int] = {}
        for record in records:
            if isinstance(record, StreamChunk):
                seqs[(record.index, record.seq)] = seqs.get((record.index, record.seq), 0) + 1
        if resumed:
            out.repeated_seqs += sum(n - 1 for n in seqs.values() if n > 1)
            out.tokens_kept += sum(len(d.token_ids) for d in deltas if d.attempt < final.attempt)
    return out

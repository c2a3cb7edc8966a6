"""Client pieces that need no broker: the congestion rule, request handles fed by hand, the generate
command's argument checks, and the demo's text views."""

from __future__ import annotations

import argparse
import asyncio
import io
import random

import pytest

from llm_client.commands import generate
from llm_client.backoff import BackoffPolicy, StatusBoard, wait_while_congested
from llm_client.commands.demo_view import LoadWatch, PrefixedLines, outcome_table, shedding_check
from llm_client import RequestHandle, RequestTimeout
from schemas.result import FinalRecord, StreamChunk
from schemas.status import PriorityStatus, WorkerStatus

NOW_MS = 1_000_000_000


def status(worker_id="w", ts_ms=NOW_MS, shed=(), paused_by_priority=None, paused=()):
    paused_by_priority = paused_by_priority or {}
    priorities = [PriorityStatus(priority=p, shed=p in shed, paused_partitions=paused_by_priority.get(p, []))
                  for p in range(3)]
    return WorkerStatus(worker_id=worker_id, ts_ms=ts_ms, priorities=priorities, paused_partitions=list(paused))


def test_congestion_rule_reads_shedding_and_paused_partitions_of_fresh_reports():
    board = StatusBoard(num_request_partitions=6, num_priorities=3)
    assert board.congestion(1, 5.0, NOW_MS) is None
    board.update(status("a", shed={2}))
    board.update(status("b", paused_by_priority={1: [3]}))
    assert board.congestion(2, 5.0, NOW_MS) == "worker a sheds priority 2"
    assert board.congestion(1, 5.0, NOW_MS) == "worker b paused partitions [3]"
    assert board.congestion(0, 5.0, NOW_MS) is None
    # Only the worker-wide list names partition 1 (priority 0); 99 is outside this layout and ignored.
    board.update(status("c", paused=[1, 99]))
    assert board.congestion(0, 5.0, NOW_MS) == "worker c paused partitions [1]"
    assert board.congestion(0, 5.0, NOW_MS + 5_001) is None  # stale reports do not count
    board.update(status("c", ts_ms=NOW_MS - 1, paused=[]))  # an older report never replaces a newer one
    assert board.latest["c"].paused_partitions == [1, 99]


def test_the_board_names_workers_that_would_not_answer_on_a_reply_topic():
    board = StatusBoard(6, 3)
    board.update(status("old"))  # reports nothing about reply topics: never counted as refusing
    assert board.refusing_reply_topic("llm.replies.gw-1", 5.0, NOW_MS) == []
    board.update(WorkerStatus(worker_id="a", ts_ms=NOW_MS, allowed_reply_topic_prefixes=["llm.replies."]))
    board.update(WorkerStatus(worker_id="b", ts_ms=NOW_MS, allowed_reply_topics=["mine"],
                              allowed_reply_topic_prefixes=[]))
    assert [w.worker_id for w in board.refusing_reply_topic("llm.replies.gw-1", 5.0, NOW_MS)] == ["b"]
    assert [w.worker_id for w in board.refusing_reply_topic("mine", 5.0, NOW_MS)] == ["a"]
    assert board.refusing_reply_topic("mine", 5.0, NOW_MS + 5_001) == []  # stale reports say nothing


def test_delay_bound_doubles_up_to_its_cap():
    policy = BackoffPolicy(base_delay_s=0.1, max_delay_s=0.5)
    assert [policy.delay_bound(k) for k in range(5)] == [0.1, 0.2, 0.4, 0.5, 0.5]


async def test_wait_while_congested_is_bounded_and_free_when_clear():
    board = StatusBoard(6, 3)
    policy = BackoffPolicy(base_delay_s=0.01, max_delay_s=0.05, max_total_s=0.2, status_max_age_s=1e12)
    board.update(status(shed={1}))
    assert await wait_while_congested(board, policy, 0) == 0.0
    waited = await wait_while_congested(board, policy, 1, rng=random.Random(0))
    assert 0.2 <= waited < 0.4
    assert await wait_while_congested(board, BackoffPolicy(enabled=False), 1) == 0.0


async def test_handle_result_times_out_and_a_late_final_still_counts():
    handle = RequestHandle("r", 0, 0, timeout_s=0.05, on_close=lambda _: None)
    with pytest.raises(RequestTimeout):
        await handle.result()
    waiter = asyncio.create_task(handle.result(timeout=5))
    await asyncio.sleep(0)
    handle.feed(StreamChunk(id="r", attempt=2, seq=0, text="a"))
    handle.feed(FinalRecord(id="r", attempt=2, status="rejected", reason="shed", num_chunks=1))
    assert (await waiter).reason == "shed"
    handle.feed(FinalRecord(id="r", attempt=3, status="rejected", reason="shed"))  # after the answer: ignored
    assert handle.attempt == 2 and handle.num_dropped == 1
    assert [d.text async for d in handle.stream()] == ["a"]


async def test_handle_follows_each_completion_and_ends_at_the_request_level_final():
    handle = RequestHandle("r", 0, 0, timeout_s=5, on_close=lambda _: None)
    done = dict(status="completed", reason="stop", finish_reason="stop")
    handle.feed(StreamChunk(id="r", seq=0, index=1, text="b"))
    handle.feed(StreamChunk(id="r", seq=0, index=0, text="a"))
    handle.feed(StreamChunk(id="r", seq=1, index=1, text="B"))
    handle.feed(FinalRecord(id="r", index=1, text="bB", num_chunks=2, **done))
    assert not handle.done  # a completion's final does not end the request
    handle.feed(FinalRecord(id="r", index=0, text="a", num_chunks=1, **done))
    handle.feed(FinalRecord(id="r", num_chunks=3, **done))
    assert [(d.index, d.text) async for d in handle.stream()] == [(1, "b"), (0, "a"), (1, "B")]
    assert [f.text for f in await handle.completions()] == ["a", "bB"]
    assert (await handle.result()).index is None and handle.num_dropped == 0
    single = RequestHandle("s", 0, 0, timeout_s=5, on_close=lambda _: None)
    single.feed(FinalRecord(id="s", text="x", **done))
    assert [f.text for f in await single.completions()] == ["x"]


async def test_a_missing_chunk_of_one_completion_is_a_gap():
    from llm_client import StreamGap
    handle = RequestHandle("r", 0, 0, timeout_s=5, on_close=lambda _: None)
    handle.feed(StreamChunk(id="r", seq=0, index=0, text="a"))
    handle.feed(StreamChunk(id="r", seq=1, index=1, text="?"))  # index 1's seq 0 is missing
    with pytest.raises(StreamGap):
        [d async for d in handle.stream()]


def parse_generate(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    generate.configure_parser(parser)
    return parser.parse_args(list(argv))


def test_generate_builds_chat_or_raw_requests():
    request = generate.build_request(parse_generate("hi", "--system", "S", "--stop", "a", "b", "--seed", "7",
                                                    "--deadline-ms", "123", "--id", "x1"))
    assert [(m.role, m.content) for m in request.messages] == [("system", "S"), ("user", "hi")]
    assert request.sampling.stop == ["a", "b"] and request.sampling.seed == 7
    assert (request.id, request.deadline_ms, request.timeout_ms) == ("x1", 123, None)
    raw = generate.build_request(parse_generate("hi", "--raw", "--timeout-s", "2.5"))
    assert raw.prompt == "hi" and raw.messages is None and raw.timeout_ms == 2500


def test_generate_asks_for_n_completions_and_structured_output(tmp_path):
    schema = tmp_path / "s.json"
    schema.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    request = generate.build_request(parse_generate("hi", "--n", "3", "--json-schema", str(schema)))
    assert (request.n, request.stream) == (3, False)
    assert request.response_format.json_schema.schema["properties"] == {"a": {"type": "integer"}}
    assert generate.build_request(parse_generate("hi")).stream
    with pytest.raises(ValueError, match="--json-schema"):
        generate.build_request(parse_generate("hi", "--json-schema", str(tmp_path / "missing.json")))


async def test_generate_prints_each_completion_of_n():
    handle = RequestHandle("r", 0, 0, timeout_s=5, on_close=lambda _: None)
    done = dict(status="completed", reason="stop", finish_reason="stop")
    for index, text in ((1, "second"), (0, "first")):
        handle.feed(FinalRecord(id="r", index=index, text=text, **done))
    handle.feed(FinalRecord(id="r", **done))
    out = io.StringIO()
    final = await generate.stream_to(handle, out, io.StringIO())
    assert final.index is None
    assert out.getvalue() == "[completion 0: completed (stop)]\nfirst\n[completion 1: completed (stop)]\nsecond\n\n"


def test_generate_refuses_bad_arguments_before_connecting(capsys):
    assert generate.run(parse_generate("hi", "--temperature", "5")) == 2
    assert "temperature" in capsys.readouterr().err
    assert generate.run(parse_generate("hi", "--raw", "--system", "S")) == 2
    assert generate.run(parse_generate("hi", "--priority", "7")) == 2
    with pytest.raises(SystemExit):
        parse_generate("hi", "--deadline-ms", "1", "--timeout-s", "1")


def test_prefixed_lines_wrap_at_spaces_and_newlines():
    out = io.StringIO()
    view = PrefixedLines("[p1]", width=12, out=out)
    for piece in ["The quick br", "own fox jumps", " over\nthe lazy dog"]:
        view.feed(piece)
    view.restart(4)
    view.feed("again")
    view.close()
    assert out.getvalue().splitlines() == [
        "[p1] The quick", "[p1] brown fox", "[p1] jumps over",
        "[p1] (attempt 4 supersedes the lines above; starting over)", "[p1] again"]


def test_load_watch_and_outcome_table():
    watch = LoadWatch("w", 3)
    watch.observe(status(shed={2}, paused_by_priority={1: [2]}))
    watch.observe(status(shed={2}, paused_by_priority={1: [3]}))
    watch.observe(status("other", shed={0}))  # another worker's report: not counted
    assert watch.num_reports == 2 and watch.shed_reports == [0, 0, 2]
    assert watch.paused_partitions == [set(), {2, 3}, set()]
    assert "yes (2)" in watch.table() and "2,3" in watch.table()
    table = outcome_table([(0, "completed", "stop", 1.0), (0, "completed", "length", 3.0),
                           (2, "rejected", "shed", None)], 3)
    rows = table.splitlines()
    assert "completed/length: 1, completed/stop: 1" in rows[1] and rows[1].endswith("3.0 s")
    assert rows[2].split()[:3] == ["1", "0", "-"]
    assert "rejected/shed: 1" in rows[3]


def test_the_demo_checks_its_shedding_against_what_the_worker_did():
    outcomes = [(0, "completed", "length", 1.0), (1, "completed", "length", 4.2), (2, "rejected", "shed", None)]
    (line,) = shedding_check(outcomes, [60.0, 6.0, 3.0])
    assert line.startswith("priority 2: 1 shed") and "4.2 s" in line and "told the truth" in line
    (line,) = shedding_check(outcomes, [60.0, 6.0, 5.0])
    assert "misestimate" in line
    assert shedding_check([(1, "completed", "stop", 1.0)], [60.0, 6.0, 3.0]) == []


def test_the_client_imports_neither_torch_nor_the_engine():
    import subprocess
    import sys

    code = ("import sys, llm_client.client, llm_client.commands.generate, llm_client.commands.loadgen; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith('worker.engine')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


async def test_cancelling_a_stream_reader_is_never_lost():
    # The reader is cancelled in the same loop turn as a chunk arrives (Ctrl-C during streaming): the
    # cancellation must end the reader, not be swallowed by the wake-up.
    handle = RequestHandle("r", 0, 0, timeout_s=10, on_close=lambda _: None)
    num_seen = 0

    async def read() -> None:
        nonlocal num_seen
        async for _ in handle.stream():
            num_seen += 1

    reader = asyncio.create_task(read())
    await asyncio.sleep(0.01)
    handle.feed(StreamChunk(id="r", attempt=0, seq=0, text="a"))
    reader.cancel()
    await asyncio.wait({reader}, timeout=2)
    assert reader.cancelled() and num_seen == 0


async def test_a_resumed_attempt_continues_the_stream_and_a_restart_starts_it_over():
    done = dict(status="completed", reason="stop", finish_reason="stop")
    resumed = RequestHandle("r", 0, 0, timeout_s=5, on_close=lambda _: None)
    resumed.feed(StreamChunk(id="r", attempt=1, seq=0, text="The "))
    resumed.feed(StreamChunk(id="r", attempt=1, seq=1, text="cat "))
    reader = resumed.stream()
    first = await reader.__anext__()
    assert first.text == "The "
    # Attempt 1 sent seq 2 before its worker died, but the new worker resumes at seq 2 (it was not delivered
    # in time to be recorded): the old seq 2, not given to the reader yet, gives way.
    resumed.feed(StreamChunk(id="r", attempt=1, seq=2, text="sat "))
    resumed.feed(StreamChunk(id="r", attempt=3, seq=2, text="sat ", resumed_at=2))
    resumed.feed(StreamChunk(id="r", attempt=3, seq=3, text="down", resumed_at=2))
    resumed.feed(StreamChunk(id="r", attempt=1, seq=3, text="zzz"))  # the old attempt, late: dropped
    resumed.feed(FinalRecord(id="r", attempt=3, text="The cat sat down", num_chunks=4, resumed_at=2, **done))
    rest = [d async for d in reader]
    assert [(d.text, d.attempt, d.restarted, d.resumed, d.rewound_to) for d in rest] == [
        ("cat ", 1, False, False, None), ("sat ", 3, False, True, None), ("down", 3, False, False, None)]
    assert resumed.num_resumptions == 1 and resumed.num_restarts == 0
    assert (await resumed.result()).text == "The cat sat down"

    # The reader already had seq 2 of the old attempt: the resumed seq 2 tells it to take that back.
    rewound = RequestHandle("w", 0, 0, timeout_s=5, on_close=lambda _: None)
    for seq, text in enumerate(["a", "b", "c"]):
        rewound.feed(StreamChunk(id="w", attempt=0, seq=seq, text=text))
    reader = rewound.stream()
    assert [(await reader.__anext__()).text for _ in range(3)] == ["a", "b", "c"]
    rewound.feed(StreamChunk(id="w", attempt=2, seq=2, text="C", resumed_at=2))
    rewound.feed(FinalRecord(id="w", attempt=2, text="abC", num_chunks=3, resumed_at=2, **done))
    (delta,) = [d async for d in reader]
    assert (delta.text, delta.resumed, delta.rewound_to) == ("C", True, 2)

    # Without resumed_at a higher attempt starts over from seq 0, as before.
    restarted = RequestHandle("s", 0, 0, timeout_s=5, on_close=lambda _: None)
    restarted.feed(StreamChunk(id="s", attempt=0, seq=0, text="x"))
    reader = restarted.stream()
    assert (await reader.__anext__()).text == "x"
    restarted.feed(StreamChunk(id="s", attempt=1, seq=0, text="y"))
    restarted.feed(FinalRecord(id="s", attempt=1, text="y", num_chunks=1, **done))
    (delta,) = [d async for d in reader]
    assert (delta.text, delta.restarted, delta.resumed) == ("y", True, False)
    assert restarted.num_restarts == 1


async def test_a_resumption_that_skips_chunks_the_reader_never_got_is_a_gap():
    from llm_client import StreamGap
    handle = RequestHandle("r", 0, 0, timeout_s=5, on_close=lambda _: None)
    handle.feed(StreamChunk(id="r", attempt=0, seq=0, text="a"))
    handle.feed(StreamChunk(id="r", attempt=1, seq=3, text="d", resumed_at=3))  # seqs 1 and 2 never came
    with pytest.raises(StreamGap):
        [d async for d in handle.stream()]

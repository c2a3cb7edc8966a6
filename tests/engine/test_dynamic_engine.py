"""The fake engine with the real one's dynamics (worker/engine/dynamic.py): what the fault tests lean on."""

from __future__ import annotations

import time

from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.dynamic import DynamicEngine, eos_point, expected_output


def request(rid: str, prompt: str, max_new_tokens: int, priority: int = 1, **sampling) -> EngineRequest:
    return EngineRequest(request_id=rid, prompt=prompt, priority=priority,
                         sampling=SamplingParams(max_new_tokens=max_new_tokens, **sampling))


def run(engine: DynamicEngine, limit: int = 1000) -> list[tuple[str, str, str]]:
    """(id, text, finish reason) in the order requests finished."""
    texts: dict[str, str] = {}
    done = []
    for _ in range(limit):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text_delta
            if out.finished:
                done.append((out.request_id, texts[out.request_id], out.finish_reason))
    return done


def test_requests_read_in_order_finish_out_of_order_with_the_same_text_anywhere():
    engine = DynamicEngine(step_time_s=0.0, per_seq_s=0.0, prefill_s_per_token=0.0, eos_probability=0.5)
    requests = [request(f"r{i}", f"prompt {i}", 16) for i in range(40)]
    for r in requests:
        engine.add_request(r)
    done = run(engine)
    order = [rid for rid, _, _ in done]
    assert sorted(order, key=lambda rid: int(rid[1:])) != order, "finished in the order they came"
    reasons = {reason for _, _, reason in done}
    assert reasons == {"stop", "length"}
    by_id = {r.request_id: r for r in requests}
    for rid, text, reason in done:
        assert (text, reason) == expected_output(by_id[rid], 0.5)
    assert eos_point(request("x", "p", 16, ignore_eos=True), 1.0) is None


def test_a_step_costs_more_with_a_fuller_batch_and_longer_prompts():
    engine = DynamicEngine(step_time_s=0.002, per_seq_s=0.002, prefill_s_per_token=0.0001, eos_probability=0.0)
    engine.add_request(request("one", "p", 50))
    engine.step()
    start = time.monotonic()
    engine.step()
    alone = time.monotonic() - start
    for i in range(9):
        engine.add_request(request(f"more{i}", "p", 50))
    engine.step()  # seats them
    start = time.monotonic()
    engine.step()
    full = time.monotonic() - start
    assert full > alone + 0.012  # nine more seats at 2 ms each
    engine.add_request(request("long", "x" * 400, 5))
    start = time.monotonic()
    engine.step()
    assert time.monotonic() - start > full + 0.03  # 400 prompt tokens at 0.1 ms


def test_a_preempted_request_pays_for_its_recompute_and_keeps_its_tokens():
    engine = DynamicEngine(max_num_seqs=1, step_time_s=0.0, per_seq_s=0.0, prefill_s_per_token=0.001,
                           eos_probability=0.0)
    engine.add_request(request("slow", "p", 60, priority=2))
    for _ in range(30):
        engine.step()
    engine.add_request(request("urgent", "q", 2, priority=0))
    engine.step()
    engine.step()  # urgent done
    start = time.monotonic()
    outs = engine.step()  # slow seated again: its 1-token prompt and 30 tokens recomputed
    assert time.monotonic() - start > 0.025
    assert [o.num_output_tokens for o in outs if o.request_id == "slow"] == [31]

"""The grammar compiler (worker/model/structured/grammar.py): compiled once per distinct spec, off the caller's
thread, errors kept as values with llguidance's message; matchers advance independently; bitmasks match the grammar."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from worker import memory
from worker.model.structured.grammar import GrammarCompiler, GrammarError, GrammarLimits

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, (EOS,))


def compiled(compiler: GrammarCompiler, kind: str, spec: str):
    return compiler.submit(kind, spec).result(timeout=30)


def allowed_ids(bitmask_row: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:VOCAB]).tolist())


def test_compiles_off_the_calling_thread_once_per_spec(compiler):
    threads = []
    spec = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})

    def compile_and_note(kind, text):
        threads.append(threading.current_thread().name)
        return original(kind, text)

    original = compiler._compile
    compiler._compile = compile_and_note
    try:
        first = compiler.submit("json_schema", spec)
        assert first.result(timeout=30).error is None
        before = compiler.num_compiled
        again = [compiler.submit("json_schema", spec) for _ in range(5)]
    finally:
        del compiler._compile
    assert all(future is first for future in again)  # cached: the same future, nothing compiled again
    assert compiler.num_compiled == before
    assert threads == [threads[0]] and threads[0].startswith("grammar")


def _schema(i: int) -> str:
    return json.dumps({"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]})


def _grammar_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "grammar"}


@pytest.mark.parametrize("end", ["close", "drop"])
def test_compile_threads_start_with_the_compiler_and_a_finished_compiler_leaves_none(tokenizer, end):
    # A thread per compile took the next glibc arena in turn, the engine's among them, and left each grammar
    # among the forward pass's temporaries there; a thread started by a later burst takes a fresh arena and
    # fills it with grammars while the others' arenas are left half empty: the worker's resident size grew
    # after every burst. So the threads are a fixed set from the start: a thread per slot and priority class.
    import gc
    import time

    before = _grammar_threads()
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,), max_workers=2)
    deadline = time.monotonic() + 10
    while len(_grammar_threads() - before) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = _grammar_threads() - before
    assert len(started) == 4
    for i in range(12):  # one after another
        assert compiled(compiler, "json_schema", _schema(i)).error is None
    # Forty at once, each slot's next compile started as the last one ends: no thread more.
    assert all(f.result(timeout=60).error is None
               for f in [compiler.submit("json_schema", _schema(100 + i)) for i in range(40)])
    assert _grammar_threads() - before == started
    if end == "close":
        compiler.close()
    else:
        del compiler
        gc.collect()
    deadline = time.monotonic() + 10
    while _grammar_threads() & started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _grammar_threads() & started


@pytest.mark.slow
@pytest.mark.skipif(memory.native_heap() is None, reason="needs glibc >= 2.33 (mallinfo2)")
def test_a_flood_of_distinct_schemas_leaves_the_native_heap_where_it_was(tokenizer):
    # Each schema names a property of its own, as a client that puts a request's id in its format would. The
    # cache holds 8, so what could stay is what llguidance keeps across grammars: its tokenizer's words.
    flood = GrammarCompiler(tokenizer, VOCAB, (EOS,), cache_size=8)

    def compile_all(specs: range) -> None:
        for start in range(specs.start, specs.stop, 100):
            for future in [flood.submit("json_schema", _schema(i)) for i in range(start, start + 100)]:
                assert future.result(timeout=30).error is None

    try:
        compile_all(range(-1000, 0))  # the compile threads' own first allocations: 1.45 MB, once
        before = memory.native_heap().in_use_bytes
        compile_all(range(0, 2000))
        grown = memory.native_heap().in_use_bytes - before
    finally:
        flood.close()
    # 2,000 new words in llguidance's tokenizer cache were 0.34 MB; a full cache keeps none of them.
    assert grown < 0.1 * 2**20, grown / 2**20


def test_the_cache_keeps_the_most_recent_specs(tokenizer):
    small = GrammarCompiler(tokenizer, VOCAB, (EOS,), cache_size=2)
    try:
        a, b, c = (small.submit("regex", r) for r in ("a+", "b+", "c+"))
        assert small.submit("regex", "c+") is c and small.submit("regex", "b+") is b
        assert small.submit("regex", "a+") is not a  # evicted, compiled again
        a.result(timeout=30)
    finally:
        small.close()


@pytest.mark.parametrize("kind, spec, message", [
    ("json_schema", '{"type": "strin"}', "Invalid type: strin"),
    ("json_schema", '{"type": "string", "pattern": "(("}', "unclosed group"),
    ("json_schema", '{"not": {"type": "string"}}', "Unimplemented keys"),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 2}', "minimum (5) is greater than maximum (2)"),
    ("json_schema", "[1, 2]", ""),
    ("regex", "((", "unclosed group"),
    ("grammar", "start: foo", 'unknown name: "foo"'),
])
def test_a_grammar_the_library_refuses_is_an_error_value_with_its_message(compiler, kind, spec, message):
    result = compiled(compiler, kind, spec)
    assert result.matcher is None and result.error and message in result.error
    assert compiler.submit(kind, spec).result() is result  # refusals are cached too


def test_matchers_advance_independently_and_end_when_the_grammar_is_complete(compiler, tokenizer):
    grammar = compiled(compiler, "json_schema", json.dumps({"enum": ["yes", "no"]}))
    first, second = compiler.matcher(grammar), compiler.matcher(grammar)
    ids = tokenizer.encode('"yes"', add_special_tokens=False)
    for token_id in ids[:-1]:
        assert first.advance(token_id) is False
    assert first.advance(ids[-1]) is True  # nothing can follow: the request ends without an EOS
    bitmask, dead = compiler.fill_bitmask([second, first])
    assert dead == []
    assert allowed_ids(bitmask[1]) == {EOS}  # a finished grammar allows only EOS
    quote = tokenizer.encode('"', add_special_tokens=False)[0]
    assert quote in allowed_ids(bitmask[0]) and EOS not in allowed_ids(bitmask[0])
    with pytest.raises(GrammarError, match="doesn't satisfy the grammar"):
        second.advance(tokenizer.encode("maybe", add_special_tokens=False)[0])


def test_the_bitmask_buffer_is_made_at_the_largest_step_and_never_grown(tokenizer):
    # Grown by a burst, it would be carved from the engine thread's arena above what that step left alive.
    sized = GrammarCompiler(tokenizer, VOCAB, (EOS,), max_rows=6)
    try:
        grammar = compiled(sized, "regex", "[0-9]+")
        buffer = sized._bitmask
        assert buffer.shape[0] == 6
        for rows in (1, 6, 3):
            bitmask, dead = sized.fill_bitmask([sized.matcher(grammar) for _ in range(rows)])
            assert bitmask.shape[0] == rows and dead == []
            assert sized._bitmask is buffer
    finally:
        sized.close()


def test_a_complete_grammar_that_could_go_on_ends_at_eos(compiler, tokenizer):
    matcher = compiler.matcher(compiled(compiler, "regex", "[0-9]+"))
    assert matcher.advance(tokenizer.encode("42", add_special_tokens=False)[0]) is False
    bitmask, _ = compiler.fill_bitmask([matcher])
    assert EOS in allowed_ids(bitmask[0])
    assert matcher.advance(EOS) is True


def test_json_is_written_on_one_line_with_spaces_after_separators(compiler, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"]}
    grammar = compiled(compiler, "json_schema", json.dumps(schema))
    for text, ok in (('{"a": 1, "b": true}', True), ('{"a":1,"b":true}', False), ('{\n"a": 1, "b": true}', False)):
        matcher = compiler.matcher(grammar)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if ok:
            assert [matcher.advance(t) for t in ids][-1] is True
        else:
            with pytest.raises(RuntimeError):
                for t in ids:
                    matcher.advance(t)


RECURSIVE_REQUIRED = {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                      "required": ["next"]}}, "$ref": "#/$defs/n"}
# The same two pathologies in shapes grammar_screen does not read, so that the library's limits refuse them.
NESTED_MILLION = "(a{1000}){1000}"
RECURSIVE_THROUGH_ONE_OF = {"$defs": {"n": {"type": "object", "required": ["next"],
                                            "properties": {"next": {"oneOf": [{"$ref": "#/$defs/n"}]}}}},
                            "$ref": "#/$defs/n"}


@pytest.fixture(scope="module")
def patient(tokenizer) -> GrammarCompiler:
    """Limits low enough to be reached fast, a time budget long enough never to be the one reached."""
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,), limits=GrammarLimits(lexer_fuel=200_000,
                                                                               compile_timeout_s=120))
    yield compiler
    compiler.close()


@pytest.mark.parametrize("kind, spec, message", [
    ("regex", r"[^\s\S]", "language is empty"),
    ("grammar", "start: start start", "language is empty"),
    ("regex", "a{1000000}", "MAX_REGEX_REPEAT=100000"),
    ("json_schema", json.dumps(RECURSIVE_REQUIRED), "nest without end, through the required property 'next'"),
    ("regex", NESTED_MILLION, "ENGINE_GRAMMAR_LEXER_FUEL=200000"),
    ("json_schema", json.dumps(RECURSIVE_THROUGH_ONE_OF), "ENGINE_GRAMMAR_STEP_MAX_ITEMS=50000"),
    ("json_schema", '{"type": "integer", "minimum": 5, "maximum": 3}', "minimum (5) is greater than maximum (3)"),
])
@pytest.mark.slow
def test_what_the_library_can_tell_in_advance_is_refused_at_compile_time(patient, kind, spec, message):
    result = compiled(patient, kind, spec)
    assert result.matcher is None and message in result.error, result.error
    assert "<non-verbose/>" not in result.error and "<state>" not in result.error


@pytest.mark.slow
def test_formats_that_can_run_pass_the_probe(patient, tokenizer):
    # A JSON Schema pattern is unanchored (ECMA-262): any string containing the 5,000 letters matches, so a
    # length-cut output may be any string prefix. Anchored, only x and y may follow the quote.
    for pattern in ["(x|y)" * 5000, "^" + "(x|y)" * 5000 + "$"]:
        assert compiled(patient, "json_schema", json.dumps({"type": "string", "pattern": pattern})).error is None
    anchored = patient.matcher(compiled(patient, "json_schema", json.dumps(
        {"type": "string", "pattern": "^" + "(x|y)" * 5000 + "$"})))
    bitmask, failed = patient.fill_bitmask([anchored])
    assert failed == [] and allowed_ids(bitmask[0]) == set(tokenizer.encode('"', add_special_tokens=False))
    assert compiled(patient, "regex", "(a+)+$").error is None
    assert compiled(patient, "json_schema", json.dumps({"enum": [f"v{i}" for i in range(5000)]})).error is None


def test_a_limit_reached_only_on_the_models_path_is_an_error_at_that_step(patient, tokenizer):
    # The integer branch keeps the compile-time probe clean; the object branch is forced into the endless
    # required chain as soon as the output opens it.
    spec = json.dumps({"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/n"}], "$defs": RECURSIVE_REQUIRED["$defs"]})
    matcher = patient.matcher(compiled(patient, "json_schema", spec))
    with pytest.raises(GrammarError, match="ENGINE_GRAMMAR_STEP_MAX_ITEMS"):
        for token_id in tokenizer.encode('{"next": {"next', add_special_tokens=False):
            _, failed = patient.fill_bitmask([matcher])  # as the engine does: a mask before each token
            assert failed == []
            matcher.advance(token_id)


def test_an_error_state_is_a_failed_row_never_an_eos_only_mask(patient, tokenizer):
    matcher = patient.matcher(compiled(patient, "regex", "[0-9]{3}"))
    with pytest.raises(GrammarError):
        matcher.advance(tokenizer.encode("x", add_special_tokens=False)[0])
    bitmask, failed = patient.fill_bitmask([matcher])
    assert [row for row, _ in failed] == [0] and failed[0][1]
    assert bitmask[0].all()  # all bits set: the row's draw is dropped with its request


def test_a_compile_past_its_time_budget_is_refused_naming_the_setting(tokenizer):
    hasty = GrammarCompiler(tokenizer, VOCAB, (EOS,), limits=GrammarLimits(compile_timeout_s=1e-6))
    try:
        result = compiled(hasty, "json_schema", json.dumps({"enum": [f"v{i}" for i in range(2000)]}))
        assert result.matcher is None and "ENGINE_GRAMMAR_COMPILE_TIMEOUT_S" in result.error
    finally:
        hasty.close()


@pytest.mark.parametrize("message, setting", [
    ("grammar size (number of symbols) too big (limit for this grammar: 10)", "ENGINE_GRAMMAR_MAX_SIZE"),
    ("initial lexer configuration (grammar) too big (limit for this grammar: 10)", "ENGINE_GRAMMAR_LEXER_FUEL"),
    ("lexer error: too many states: 10", "ENGINE_GRAMMAR_MAX_LEXER_STATES"),
    ("parser error: Too many items (limit 10; ff_tokens)", "ENGINE_GRAMMAR_STEP_MAX_ITEMS"),
    ("fuel exhausted when checking relevance of lexemes (10)", "ENGINE_GRAMMAR_STEP_LEXER_FUEL"),
])
def test_a_limit_message_names_the_worker_setting(message, setting):
    # The library's own wording (from its binary), which this mapping depends on; a library upgrade that
    # rewords them fails the tests above that reach the limits for real.
    assert setting in GrammarLimits().explain(message + "\n<non-verbose/>")


def test_the_grammar_size_limit_is_applied(tokenizer):
    small = GrammarCompiler(tokenizer, VOCAB, (EOS,), limits=GrammarLimits(max_size=50, compile_timeout_s=120))
    try:
        lark = "start: " + " | ".join(f"r{i}" for i in range(100)) + "\n" + "\n".join(
            f'r{i}: "w{i}" r{(i + 1) % 100}?' for i in range(100))
        result = compiled(small, "grammar", lark)
        assert result.matcher is None and "ENGINE_GRAMMAR_MAX_SIZE=50" in result.error, result.error
    finally:
        small.close()


# ---- two passes: a first pass at cut limits here, the judge process for what it cannot settle ------------


def test_a_refusal_on_a_cut_limit_is_judged_in_a_process_at_the_full_limits(patient):
    before = patient.num_judged
    result = compiled(patient, "regex", "(a{1000}){1001}")
    assert result.matcher is None and "ENGINE_GRAMMAR_LEXER_FUEL=200000" in result.error, result.error
    assert patient.num_judged == before + 1
    # A refusal the first pass settles (no cut limit behind it) never goes to the judge.
    assert "language is empty" in compiled(patient, "regex", r"[^\s\S]{2}").error
    assert patient.num_judged == before + 1


@pytest.mark.slow
def test_a_grammar_the_judge_passes_is_built_here_at_the_full_limits(tokenizer, monkeypatch):

    # So that an ordinary enum is past the first pass.
    monkeypatch.setattr("worker.model.structured.compile.QUICK_LEXER_FUEL", 500)
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,), limits=GrammarLimits(compile_timeout_s=60))
    try:
        result = compiled(compiler, "json_schema", json.dumps({"enum": [f"v{i}" for i in range(300)]}))
        assert result.error is None and compiler.num_judged == 1
        matcher = compiler.matcher(result)
        assert [matcher.advance(t) for t in tokenizer.encode('"v123"', add_special_tokens=False)][-1] is True
    finally:
        compiler.close()


@pytest.mark.slow
def test_a_judge_past_the_cpu_budget_is_killed_and_the_next_grammar_gets_a_fresh_one(tokenizer, monkeypatch):
    import worker.model.structured.judge as grammar_judge

    monkeypatch.setattr("worker.model.structured.compile.QUICK_LEXER_FUEL", 500)
    monkeypatch.setattr(grammar_judge, "JUDGE_WALL_FACTOR", 1000)  # the CPU budget, not the wall time, decides
    # About a second of CPU at the default lexer fuel; the first pass (500) refuses it in microseconds.
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,), limits=GrammarLimits(compile_timeout_s=0.1),
                               judge_processes=1)
    try:
        result = compiled(compiler, "regex", NESTED_MILLION)
        assert result.matcher is None and "ENGINE_GRAMMAR_COMPILE_TIMEOUT_S" in result.error, result.error
        assert "of CPU" in result.error and compiler._judges.num_killed == 1
        enum = json.dumps({"enum": [f"v{i}" for i in range(300)]})
        assert compiled(compiler, "json_schema", enum).error is None  # judged again, by a fresh process
        assert compiler.num_judged == 2
    finally:
        compiler.close()


def test_with_no_judge_every_grammar_is_settled_in_one_pass_at_the_full_limits(tokenizer):
    single = GrammarCompiler(tokenizer, VOCAB, (EOS,), limits=GrammarLimits(lexer_fuel=200_000,
                                                                             compile_timeout_s=120),
                             judge_processes=0)
    try:
        result = compiled(single, "regex", NESTED_MILLION)
        assert "ENGINE_GRAMMAR_LEXER_FUEL=200000" in result.error and single.num_judged == 0
    finally:
        single.close()


def test_the_cache_keeps_a_digest_of_each_spec_not_the_spec(compiler):
    spec = json.dumps({"type": "string", "description": "x" * 10_000})
    compiled(compiler, "json_schema", spec)
    assert all(len(key[1]) == 16 for key in compiler._cache)


def test_a_grammar_that_waited_past_its_wall_time_for_a_judge_is_refused(tokenizer, monkeypatch):
    import worker.model.structured.judge as grammar_judge

    monkeypatch.setattr("worker.model.structured.compile.QUICK_LEXER_FUEL", 500)
    monkeypatch.setattr(grammar_judge, "JUDGE_WALL_FACTOR", 0)  # every grammar is past its time when taken
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,), limits=GrammarLimits(compile_timeout_s=60))
    try:
        result = compiled(compiler, "json_schema", json.dumps({"enum": [f"v{i}" for i in range(300)]}))
        assert "ENGINE_GRAMMAR_COMPILE_TIMEOUT_S" in result.error and compiler._judges.num_expired == 1
        assert "waited" in result.error and result.retry_at is not None
    finally:
        compiler.close()


def judges_gone(pids: list[int], timeout: float = 10.0) -> bool:
    """Whether these processes have ended and been reaped (no /proc entry left)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{pid}").exists() for pid in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_closing_the_compiler_stops_its_judges_at_once(tokenizer, monkeypatch):
    # A judge holds about 100 MB; it must not outlive the compiler (an engine's close closes it).

    monkeypatch.setattr("worker.model.structured.compile.QUICK_LEXER_FUEL", 500)
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,), limits=GrammarLimits(compile_timeout_s=60))
    assert compiled(compiler, "json_schema", json.dumps({"enum": [f"v{i}" for i in range(300)]})).error is None
    pids = compiler._judges.pids
    assert pids and compiler.num_judged == 1
    # One judged right now (held up in the judge): close refuses it instead of waiting for it.
    busy = compiler.submit("regex", NESTED_MILLION)
    compiler.close()
    assert judges_gone(pids)
    assert busy.result(timeout=10).error is not None


@pytest.mark.slow
def test_a_dropped_compiler_stops_its_judges(tokenizer, monkeypatch):
    import gc


    monkeypatch.setattr("worker.model.structured.compile.QUICK_LEXER_FUEL", 500)
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,), limits=GrammarLimits(compile_timeout_s=60))
    assert compiled(compiler, "json_schema", json.dumps({"enum": [f"v{i}" for i in range(301)]})).error is None
    pids = compiler._judges.pids
    assert pids
    del compiler
    gc.collect()
    assert judges_gone(pids)


# ---- the judges yield to the forward pass ------------------------------------------------------------


def judge_cpu_seconds(pid: int) -> float:
    from worker.model.structured.judge import _cpu_seconds

    return _cpu_seconds(pid)


@pytest.mark.slow
def test_while_the_engine_is_busy_a_judge_takes_only_its_share_and_finishes_once_it_is_idle(tokenizer,
                                                                                              monkeypatch):
    import time

    from worker.model.structured.judge import JUDGE_BUSY_SHARE

    monkeypatch.setattr("worker.model.structured.compile.QUICK_LEXER_FUEL", 500)
    busy = threading.Event()
    compiler = GrammarCompiler(tokenizer, VOCAB, (EOS,), limits=GrammarLimits(compile_timeout_s=60),
                               judge_processes=1, busy=busy.is_set)
    try:
        # A judge started and ready (its start is not paced), then about 1.3 s of CPU to judge.
        assert compiled(compiler, "json_schema", json.dumps({"enum": [f"v{i}" for i in range(300)]})).error is None
        busy.set()
        future = compiler.submit("regex", NESTED_MILLION)
        time.sleep(0.3)
        pid = compiler._judges.pids[0]
        cpu_before, wall_before = judge_cpu_seconds(pid), time.monotonic()
        time.sleep(1.0)
        cpu = judge_cpu_seconds(pid) - cpu_before
        share = cpu / (time.monotonic() - wall_before)
        # Unpaced, the judge takes a whole idle core (about 1.0); a clock tick (10 ms) of slack a slice.
        assert share <= 2 * JUDGE_BUSY_SHARE, share
        assert not future.done(), "the grammar was judged while the engine was busy: nothing was measured"
        busy.clear()
        result = future.result(timeout=30)
        assert "ENGINE_GRAMMAR_LEXER_FUEL" in result.error, result.error
        assert compiler._judges.num_paused > 0
    finally:
        compiler.close()


@pytest.mark.slow  # ~5 s: a process of its own loads a tokenizer and starts a judge
def test_a_judge_stopped_for_the_forward_pass_ends_with_its_worker(tiny_model_path: Path):
    import os
    import signal
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    script = f"""
import sys, time
sys.path.insert(0, {str(root)!r})
from transformers import AutoTokenizer
import worker.model.structured.grammar as grammar
import worker.model.structured.compile as grammar_compile
grammar_compile.QUICK_LEXER_FUEL = 500
compiler = grammar.GrammarCompiler(AutoTokenizer.from_pretrained({str(tiny_model_path)!r}), {VOCAB}, ({EOS},),
                                   limits=grammar.GrammarLimits(compile_timeout_s=60), judge_processes=1,
                                   busy=lambda: True)
compiler.submit("regex", "(a{{1000}}){{1000}}")
while compiler._judges is None or not compiler._judges.pids:
    time.sleep(0.05)
print(compiler._judges.pids[0], flush=True)
time.sleep(120)
"""
    pid = 0

    def state() -> str | None:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return None

    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(worker.stdout.readline())
        deadline = time.monotonic() + 60
        while state() != "T" and time.monotonic() < deadline:  # stopped: it would never read its stdin's end
            time.sleep(0.01)
        assert state() == "T"
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    deadline = time.monotonic() + 10
    while state() not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert state() in (None, "Z"), state()

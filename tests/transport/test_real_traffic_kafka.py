"""Real-world traffic: 10,000 hostile records of more than 60 kinds, from librdkafka producers with every
compression codec, interleaved with 250 valid requests over three priorities, against one worker running the
real engine (tiny random Llama) with the default shedding settings.

The floor checked, statement by statement:
1. every valid request completes: none is shed (or refused in any other way) because of the bad records;
2. every record whose id can be read gets exactly one final record, with the status and reason of its kind;
3. every record that cannot be read gets a dead letter whose (partition, offset) is that record's, and no final;
4. within 30 s of the last record (the last produce call returning) the group's committed offset equals the
   log end on every request partition.

Each kind declares what it expects: a final (status, reason) when its id can be read, and a dead letter (its
error code) when the record cannot be decoded. Requests that decode but are refused later (reply topic not
allowed, token ids outside the vocabulary, prompt too long for the model, deadline passed) get only a final.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from confluent_kafka import Producer

from schemas.decode import RequestError, decode_request
from schemas.request import GenerationRequest
from worker.engine.calibrate import calibrate
from tests.transport.kafka_helpers import Collector, running_worker, worker_settings
from tests.transport.real_producers import CODECS, request_partition, wait_until_committed_to_end
from tests.transport.test_stream_kafka import tiny_engine
from worker.kafka_settings import KafkaSettings
from worker.transport.requests.answers import MAX_DEAD_LETTER_KEY

pytestmark = pytest.mark.kafka

NUM_HOSTILE = 10_000
VALID_EVERY = 40  # one valid request after every 40 hostile records: 250 of them, none first or last
COMMIT_FLOOR_S = 30.0
ANSWER_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Ctx:
    vocab_size: int
    now_ms: int
    """When the records were built: deadlines and old timestamps are measured from it."""


@dataclass(frozen=True)
class Kind:
    name: str
    make: Callable[[str, Ctx], bytes | None]
    final: tuple[str, str] | None
    """(status, reason) of the one final record for the id; None: the id cannot be read, so no final."""
    dead_letter: str | None
    """error_code of the dead letter; None: no dead letter."""
    cap: int | None = None
    """At most this many records of the kind (large or slow ones); None: an equal share of the rest."""
    key: str = "id"
    """"id": key = the record's id (h-<n>, also for records whose value has no readable id); "none": no key;
    "huge": a key of about 1 MB."""
    codecs: tuple[str, ...] = CODECS
    old_timestamp: bool = False
    """The record's Kafka timestamp is two minutes in the past."""


def j(rid: str, **fields) -> bytes:
    return json.dumps({"id": rid, **fields}, separators=(",", ":")).encode()


def jp(rid: str, **fields) -> bytes:
    """A prompt request with extra (bad) fields."""
    return j(rid, prompt="hi", **fields)


def sampling(rid: str, **spec) -> bytes:
    return j(rid, prompt="hi", sampling=spec)


ERR_INVALID = ("error", "invalid_request")
ERR_DECODE = ("error", "decode_error")
ERR_LARGE = ("error", "too_large")
DEEP = 10_000
_RNG = random.Random(7)
NEAR_LIMIT_PROMPT = "".join(_RNG.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+/")
                            for _ in range(1_000_000))  # hardly compressible: near the broker's limit on the wire
GARBAGE = bytes(_RNG.randrange(256) for _ in range(300))


def _kinds() -> list[Kind]:
    k: list[Kind] = []

    def add(name, make, final, dead_letter, **kw):
        k.append(Kind(name, make, final, dead_letter, **kw))

    # -- (b) no readable id: a dead letter, no final ----------------------------------------------------------
    add("not_json", lambda r, c: b"{not json", None, "decode_error")
    add("empty", lambda r, c: b"", None, "decode_error")
    add("tombstone", lambda r, c: None, None, "decode_error")
    add("json_array", lambda r, c: b"[1,2,3]", None, "invalid_request")
    add("json_number", lambda r, c: b"42", None, "invalid_request")
    add("json_string", lambda r, c: b'"hello"', None, "invalid_request")
    add("json_null", lambda r, c: b"null", None, "invalid_request")
    add("json_bool", lambda r, c: b"true", None, "invalid_request")
    add("missing_id", lambda r, c: json.dumps({"prompt": "hi"}).encode(), None, "invalid_request")
    add("id_number", lambda r, c: json.dumps({"id": 5, "prompt": "hi"}).encode(), None, "invalid_request")
    add("id_null", lambda r, c: json.dumps({"id": None, "prompt": "hi"}).encode(), None, "invalid_request")
    add("id_object", lambda r, c: json.dumps({"id": {"v": r}, "prompt": "hi"}).encode(), None, "invalid_request")
    add("id_array", lambda r, c: json.dumps({"id": [r], "prompt": "hi"}).encode(), None, "invalid_request")
    add("id_too_long", lambda r, c: j(r + "x" * 200, prompt="hi"), None, "invalid_request")
    add("id_empty", lambda r, c: j("", prompt="hi"), None, "invalid_request")
    add("id_with_space", lambda r, c: j(r.replace("-", " "), prompt="hi"), None, "invalid_request")
    add("id_non_ascii", lambda r, c: j(r + "\u00e9", prompt="hi"), None, "invalid_request")
    add("id_control_char", lambda r, c: j(r + "\u0001", prompt="hi"), None, "invalid_request")
    add("id_invalid_utf8", lambda r, c: b'{"id":"' + r.encode() + b'\xff","prompt":"hi"}', None, "decode_error")
    add("id_lone_surrogate", lambda r, c: b'{"id":"' + r.encode() + b'\\ud800","prompt":"hi"}', None,
        "decode_error")
    add("truncated_before_id", lambda r, c: b'{"prompt":"hi","i', None, "decode_error")
    add("utf8_bom", lambda r, c: b"\xef\xbb\xbf" + j(r, prompt="hi"), None, "decode_error")
    add("python_repr", lambda r, c: repr({"id": r, "prompt": "hi"}).encode(), None, "decode_error")
    add("binary_garbage", lambda r, c: GARBAGE, None, "decode_error")
    add("no_key_garbage", lambda r, c: b"\x00\x01garbage", None, "decode_error", key="none")
    add("huge_key_undecodable", lambda r, c: b"\x00\x01not a request", None, "decode_error", cap=2, key="huge")

    # -- (a) readable id, undecodable or over a limit: an error final and a dead letter ----------------------
    def bad(name, make, reason="invalid_request", **kw):
        add(name, make, ("error", reason), reason, **kw)

    bad("prompt_int", lambda r, c: j(r, prompt=12345))
    bad("prompt_empty", lambda r, c: j(r, prompt=""))
    bad("prompt_null", lambda r, c: j(r, prompt=None))
    bad("no_prompt", lambda r, c: j(r, max_new_tokens=3))
    bad("two_prompts", lambda r, c: j(r, prompt="hi", prompt_token_ids=[1, 2]))
    bad("three_prompts", lambda r, c: j(r, prompt="hi", prompt_token_ids=[1],
                                        messages=[{"role": "user", "content": "hi"}]))
    bad("max_new_tokens_zero", lambda r, c: jp(r, max_new_tokens=0))
    bad("max_new_tokens_negative", lambda r, c: jp(r, max_new_tokens=-5))
    bad("max_new_tokens_string", lambda r, c: jp(r, max_new_tokens="10"))
    bad("max_new_tokens_float", lambda r, c: jp(r, max_new_tokens=2.5))
    bad("max_new_tokens_bool", lambda r, c: jp(r, max_new_tokens=True))
    bad("max_new_tokens_huge", lambda r, c: jp(r, max_new_tokens=10**15))
    bad("max_new_tokens_over_cap", lambda r, c: jp(r, max_new_tokens=5000))
    bad("temperature_string", lambda r, c: sampling(r, temperature="hot"))
    bad("temperature_negative", lambda r, c: sampling(r, temperature=-1.0))
    bad("temperature_too_high", lambda r, c: sampling(r, temperature=3.5))
    bad("temperature_nan", lambda r, c: sampling(r, temperature=float("nan")), "decode_error")
    bad("top_p_zero", lambda r, c: sampling(r, top_p=0.0))
    bad("top_p_over_one", lambda r, c: sampling(r, top_p=1.5))
    bad("top_p_string", lambda r, c: sampling(r, top_p="all"))
    bad("top_k_negative", lambda r, c: sampling(r, top_k=-1))
    bad("top_k_float", lambda r, c: sampling(r, top_k=1.5))
    bad("seed_negative", lambda r, c: sampling(r, seed=-1))
    bad("seed_over_int64", lambda r, c: sampling(r, seed=2**64))
    bad("seed_string", lambda r, c: sampling(r, seed="42"))
    bad("stop_not_list", lambda r, c: sampling(r, stop="x"))
    bad("stop_empty_string", lambda r, c: sampling(r, stop=[""]))
    bad("stop_too_many", lambda r, c: sampling(r, stop=[f"s{n}" for n in range(9)]))
    bad("stop_too_long", lambda r, c: sampling(r, stop=["s" * 65]))
    bad("stop_ints", lambda r, c: sampling(r, stop=[1, 2]))
    bad("stop_token_ids_negative", lambda r, c: sampling(r, stop_token_ids=[-1]))
    bad("stop_token_ids_too_many", lambda r, c: sampling(r, stop_token_ids=list(range(33))))
    bad("stop_token_ids_strings", lambda r, c: sampling(r, stop_token_ids=["a"]))
    bad("ignore_eos_string", lambda r, c: sampling(r, ignore_eos="yes"))
    bad("sampling_not_object", lambda r, c: jp(r, sampling=5))
    bad("timeout_ms_zero", lambda r, c: jp(r, timeout_ms=0))
    bad("timeout_ms_negative", lambda r, c: jp(r, timeout_ms=-1))
    bad("timeout_ms_string", lambda r, c: jp(r, timeout_ms="1000"))
    bad("deadline_ms_negative", lambda r, c: jp(r, deadline_ms=-1))
    bad("deadline_ms_string", lambda r, c: jp(r, deadline_ms="tomorrow"))
    bad("deadline_ms_past_safe_int", lambda r, c: jp(r, deadline_ms=2**60))
    bad("metadata_list", lambda r, c: jp(r, metadata=["a", "b"]))
    bad("metadata_int_value", lambda r, c: jp(r, metadata={"a": 1}))
    bad("metadata_too_many", lambda r, c: jp(r, metadata={f"k{n}": "v" for n in range(17)}))
    bad("metadata_value_too_long", lambda r, c: jp(r, metadata={"k": "v" * 257}))
    bad("metadata_key_too_long", lambda r, c: jp(r, metadata={"k" * 257: "v"}))
    bad("messages_bad_role", lambda r, c: j(r, messages=[{"role": "wizard", "content": "hi"}]))
    bad("messages_missing_content", lambda r, c: j(r, messages=[{"role": "user"}]))
    bad("messages_content_int", lambda r, c: j(r, messages=[{"role": "user", "content": 7}]))
    bad("messages_empty", lambda r, c: j(r, messages=[]))
    bad("messages_not_list", lambda r, c: j(r, messages="hi"))
    bad("messages_item_string", lambda r, c: j(r, messages=["hi"]))
    bad("messages_too_many", lambda r, c: j(r, messages=[{"role": "user", "content": "m"}] * 257), "too_large",
        cap=40)
    bad("prompt_token_ids_negative", lambda r, c: j(r, prompt_token_ids=[1, -2]))
    bad("prompt_token_ids_empty", lambda r, c: j(r, prompt_token_ids=[]))
    bad("prompt_token_ids_strings", lambda r, c: j(r, prompt_token_ids=["1"]))
    bad("prompt_token_ids_over_int32", lambda r, c: j(r, prompt_token_ids=[2**31]))
    bad("prompt_token_ids_too_many", lambda r, c: j(r, prompt_token_ids=[1] * 32_769), "too_large", cap=20)
    bad("schema_version_too_new", lambda r, c: jp(r, schema_version=2))
    bad("schema_version_zero", lambda r, c: jp(r, schema_version=0))
    bad("schema_version_string", lambda r, c: jp(r, schema_version="1"))
    bad("reply_topic_bad_chars", lambda r, c: jp(r, reply_topic="no such topic!"))
    bad("reply_topic_int", lambda r, c: jp(r, reply_topic=5))
    bad("stream_string", lambda r, c: jp(r, stream="no"))
    bad("priority_out_of_range", lambda r, c: jp(r, priority=300))
    bad("duplicate_id_second_invalid", lambda r, c: b'{"id":"' + r.encode() + b'","prompt":"hi","id":5}')
    bad("invalid_utf8_in_prompt", lambda r, c: b'{"id":"' + r.encode() + b'","prompt":"\xff\xfe\xfd"}',
        "decode_error")
    bad("lone_surrogate_in_prompt", lambda r, c: b'{"id":"' + r.encode() + b'","prompt":"a\\ud800b"}',
        "decode_error")
    bad("lone_low_surrogate_in_metadata",
        lambda r, c: b'{"id":"' + r.encode() + b'","prompt":"hi","metadata":{"k":"\\udc00"}}', "decode_error")
    bad("raw_control_char_in_prompt", lambda r, c: b'{"id":"' + r.encode() + b'","prompt":"a\x01b"}',
        "decode_error")
    bad("deep_nesting_unknown_field",
        lambda r, c: b'{"id":"' + r.encode() + b'","x":' + b"[" * DEEP + b"]" * DEEP + b',"prompt":"hi"}',
        "decode_error")
    bad("deep_nesting_before_id",
        lambda r, c: b'{"x":' + b"[" * DEEP + b"]" * DEEP + b',"id":"' + r.encode() + b'","prompt":"hi"}',
        "decode_error")
    # metadata is a map of strings: the decoder stops at the first nested object, long before any recursion.
    bad("deep_nesting_metadata",
        lambda r, c: b'{"id":"' + r.encode() + b'","prompt":"hi","metadata":' + b'{"a":' * DEEP + b'"x"'
        + b"}" * DEEP + b"}")
    bad("truncated_after_id", lambda r, c: b'{"id":"' + r.encode() + b'","prompt":"hel', "decode_error")
    bad("trailing_garbage", lambda r, c: jp(r) + b"xyz", "decode_error")
    bad("comment_in_json", lambda r, c: b'{"id":"' + r.encode() + b'", // hi\n"prompt":"hi"}', "decode_error")
    bad("prompt_over_char_limit", lambda r, c: j(r, prompt="x" * 200_001), "too_large", cap=20)
    bad("messages_over_char_limit",
        lambda r, c: j(r, messages=[{"role": "user", "content": "x" * 100_001}] * 2), "too_large", cap=10)
    bad("near_broker_limit", lambda r, c: j(r, prompt=NEAR_LIMIT_PROMPT), "too_large", cap=3)
    # Over the worker's 1 MiB record limit: only compressed batches of it fit the broker's limit.
    bad("over_worker_record_limit", lambda r, c: j(r, prompt="z" * 1_100_000), "too_large", cap=2,
        codecs=("gzip", "zstd"))

    # -- (a) readable id, decodes, refused later: a final only -----------------------------------------------
    add("reply_topic_not_allowed", lambda r, c: jp(r, reply_topic="somebody.elses.topic"),
        ("error", "reply_topic_not_allowed"), None)
    add("token_id_out_of_vocab", lambda r, c: j(r, prompt_token_ids=[1, 10**6], max_new_tokens=2), ERR_INVALID, None)
    add("token_id_equal_vocab_size", lambda r, c: j(r, prompt_token_ids=[c.vocab_size], max_new_tokens=2),
        ERR_INVALID, None)
    add("token_id_max_int32", lambda r, c: j(r, prompt_token_ids=[2**31 - 1], max_new_tokens=2), ERR_INVALID, None)
    add("prompt_too_long_text", lambda r, c: j(r, prompt="hello " * 3000, max_new_tokens=2),
        ("error", "prompt_too_long"), None, cap=60)
    add("prompt_too_long_token_ids", lambda r, c: j(r, prompt_token_ids=[1] * 2040, max_new_tokens=100),
        ("error", "prompt_too_long"), None)
    add("max_new_tokens_past_model_len", lambda r, c: jp(r, max_new_tokens=4096), ("error", "prompt_too_long"), None)
    add("deadline_epoch_start", lambda r, c: jp(r, deadline_ms=1000, max_new_tokens=2), ("rejected", "deadline"),
        None)
    add("deadline_a_minute_ago", lambda r, c: jp(r, deadline_ms=c.now_ms - 60_000, max_new_tokens=2),
        ("rejected", "deadline"), None)
    add("timeout_before_old_timestamp", lambda r, c: jp(r, timeout_ms=1000, max_new_tokens=2),
        ("rejected", "deadline"), None, old_timestamp=True)
    return k


KINDS = _kinds()


def valid_request(n: int) -> bytes:
    """The n-th valid request (id ok-<n>): short prompts, 2 to 4 new tokens, several shapes."""
    rid = f"ok-{n}"
    mnt = 2 + n % 3
    shape = n % 5
    if shape == 0:
        return j(rid, prompt=f"Tell me about number {n}.", max_new_tokens=mnt)
    if shape == 1:
        return j(rid, messages=[{"role": "user", "content": f"Hello {n}"}], max_new_tokens=mnt)
    if shape == 2:
        return j(rid, prompt_token_ids=[1, 2, 3, 100 + n], max_new_tokens=mnt, sampling={"temperature": 0.7,
                                                                                            "seed": n})
    if shape == 3:  # unknown extra fields: valid (producers may be newer than workers)
        return j(rid, prompt=f"Extra fields {n}", max_new_tokens=mnt, future_field={"nested": [1, {"a": None}]},
                 trace_id=f"t{n}", sampling={"temperature": 0.0, "brand_new_knob": 3})
    return j(rid, prompt=f"No stream {n}", max_new_tokens=mnt, stream=False, metadata={"n": str(n)})


@dataclass
class Rec:
    """One produced record and what it expects."""

    tag: int
    kind: Kind | None  # None: a valid request
    rid: str
    priority: int
    key: bytes | None
    value: bytes | None
    codec: str
    partition: int
    timestamp_ms: int | None
    offset: int | None = None


def build_records(kafka: KafkaSettings, ctx: Ctx) -> list[Rec]:
    capped = [kind for kind in KINDS if kind.cap]
    uncapped = [kind for kind in KINDS if not kind.cap]
    capped_seq: list[Kind] = []
    remaining = {kind.name: kind.cap for kind in capped}
    while any(remaining.values()):
        for kind in capped:
            if remaining[kind.name]:
                capped_seq.append(kind)
                remaining[kind.name] -= 1
    sequence: list[Kind | None] = [None] * NUM_HOSTILE
    for m, kind in enumerate(capped_seq):  # spread the large ones evenly
        sequence[int((m + 0.5) * NUM_HOSTILE / len(capped_seq))] = kind
    u = 0
    for n in range(NUM_HOSTILE):
        if sequence[n] is None:
            sequence[n] = uncapped[u % len(uncapped)]
            u += 1
    records: list[Rec] = []
    num_valid = 0
    for n, kind in enumerate(sequence):
        rid = f"h-{n}"
        priority = n % 3
        if kind.key == "huge":
            key_text = rid + "-" + "k" * 1_000_000
        else:
            key_text = rid
        key = None if kind.key == "none" else key_text.encode()
        codec = kind.codecs[n % len(kind.codecs)]
        records.append(Rec(len(records), kind, rid, priority, key, kind.make(rid, ctx), codec,
                           request_partition(kafka, priority, key_text),
                           ctx.now_ms - 120_000 if kind.old_timestamp else None))
        if n % VALID_EVERY == VALID_EVERY // 2:
            vid = f"ok-{num_valid}"
            vprio = num_valid % 3
            records.append(Rec(len(records), None, vid, vprio, vid.encode(), valid_request(num_valid),
                               CODECS[num_valid % len(CODECS)], request_partition(kafka, vprio, vid), None))
            num_valid += 1
    return records


def produce_tracked(kafka: KafkaSettings, codec: str, recs: list[Rec], linger_ms: int = 20) -> None:
    """As real_producers.produce_librdkafka (same producer settings), but each record's (partition, offset)
    from its delivery report is kept, so dead letters can be matched to the records they stand for."""
    producer = Producer({"bootstrap.servers": kafka.bootstrap_servers, "compression.type": codec,
                         "linger.ms": linger_ms, "enable.idempotence": True, "message.max.bytes": 2_000_000})
    errors: list = []

    def on_delivery_for(rec: Rec):
        def on_delivery(err, msg) -> None:
            if err is not None:
                errors.append((rec.kind.name if rec.kind else "valid", rec.rid, err))
            else:
                assert msg.partition() == rec.partition
                rec.offset = msg.offset()
        return on_delivery

    for rec in recs:
        kwargs = {"timestamp": rec.timestamp_ms} if rec.timestamp_ms is not None else {}
        while True:
            try:
                producer.produce(kafka.request_topic, value=rec.value, key=rec.key, partition=rec.partition,
                                 on_delivery=on_delivery_for(rec), **kwargs)
                break
            except BufferError:
                producer.poll(0.05)
        producer.poll(0)
    assert producer.flush(90) == 0, f"{codec}: records still undelivered after 90 s"
    assert not errors, f"{codec}: {len(errors)} deliveries failed, e.g. {errors[:3]}"


def decoder_agrees(rec: Rec) -> str | None:
    """The decoder's verdict on one sample of a kind, against what the kind declares (no Kafka involved), so
    a disagreement is reported as the decoder's, not the transport's."""
    decoded = decode_request(rec.value)
    kind = rec.kind
    if isinstance(decoded, RequestError):
        if kind.dead_letter is None:
            return f"decodes to an error {decoded.code} ({decoded.message[:120]}), declared to decode"
        want_id = rec.rid if kind.final is not None else None
        if decoded.code != kind.dead_letter or decoded.request_id != want_id:
            return (f"decoder gives code={decoded.code} id={decoded.request_id!r} ({decoded.message[:120]}), "
                    f"declared code={kind.dead_letter} id={want_id!r}")
        return None
    if kind.dead_letter is not None:
        return f"decodes to a request, declared dead letter {kind.dead_letter}"
    if not isinstance(decoded, GenerationRequest) or decoded.id != rec.rid:
        return f"decodes to {decoded!r:.120}"
    return None


class Progress:
    """What is still unanswered, updated incrementally from the collector's results."""

    def __init__(self, records: list[Rec]) -> None:
        self.want_final = {rec.rid for rec in records if rec.kind is None or rec.kind.final is not None}
        self.want_dead = {(rec.partition, rec.offset) for rec in records if rec.kind and rec.kind.dead_letter}
        self._seen_dead = 0

    def __call__(self, results) -> bool:
        if self.want_final:
            self.want_final = {rid for rid in self.want_final if rid not in results.finals}
        dead = results.dead_letters
        for d in dead[self._seen_dead:len(dead)]:
            self.want_dead.discard((d.partition, d.offset))
        self._seen_dead = len(dead)
        return not self.want_final and not self.want_dead


def check(records: list[Rec], results, request_topic: str) -> list[str]:
    """Every floor statement about answers; returns the failures, one line each, grouped by kind."""
    failures: dict[str, list[str]] = defaultdict(list)
    by_rid = {rec.rid: rec for rec in records}
    dead_by_place: dict[tuple[int, int], list] = defaultdict(list)
    for d in results.dead_letters:
        dead_by_place[(d.partition, d.offset)].append(d)
    for rec in records:
        name = rec.kind.name if rec.kind else "valid"
        finals = results.finals.get(rec.rid, [])
        dead = dead_by_place.pop((rec.partition, rec.offset), [])
        if rec.kind is None:
            got = [(f.status, f.reason) for f in finals]
            if len(finals) != 1 or finals[0].status != "completed":
                failures[name].append(f"{rec.rid} (priority {rec.priority}): finals {got}, want one completed")
            if dead:
                failures[name].append(f"{rec.rid}: unexpected dead letter {dead[0].error_code}")
            continue
        kind = rec.kind
        if kind.final is not None:
            got = [(f.status, f.reason) for f in finals]
            if got != [kind.final]:
                failures[name].append(f"{rec.rid}: finals {got}, want exactly [{kind.final}]"
                                      + (f" ({finals[0].message[:100]})" if finals else ""))
        elif finals:
            failures[name].append(f"{rec.rid} (key only, no readable id): unexpected finals "
                                  f"{[(f.status, f.reason) for f in finals]}")
        if kind.dead_letter is None:
            if dead:
                failures[name].append(f"{rec.rid}: unexpected dead letter {dead[0].error_code}")
            continue
        if len(dead) != 1:
            failures[name].append(f"{rec.rid} at {rec.partition}/{rec.offset}: {len(dead)} dead letters, want 1")
            continue
        d = dead[0]
        want_key = None if rec.key is None else rec.key[:MAX_DEAD_LETTER_KEY]
        want_value = None if rec.value is None else rec.value[:512 * 1024]
        problems = []
        if d.error_code != kind.dead_letter:
            problems.append(f"error_code {d.error_code}, want {kind.dead_letter}")
        if d.topic != request_topic:
            problems.append(f"topic {d.topic}")
        if d.key != want_key:
            problems.append(f"key of {None if d.key is None else len(d.key)} bytes, want "
                            f"{None if want_key is None else len(want_key)}")
        if d.value != want_value:
            problems.append(f"value of {None if d.value is None else len(d.value)} bytes differs from the record's")
        if d.request_id != (rec.rid if kind.final else None):
            problems.append(f"request_id {d.request_id!r}")
        if problems:
            failures[name].append(f"{rec.rid}: dead letter {'; '.join(problems)}")
    for place, dead in dead_by_place.items():
        failures["stray dead letters"].append(f"{place}: {[d.error_code for d in dead]}")
    for rid in results.finals:
        if rid not in by_rid:
            failures["stray finals"].append(f"{rid}: {[(f.status, f.reason) for f in results.finals[rid]]}")
    lines = []
    for name, problems in sorted(failures.items()):
        lines.append(f"{name}: {len(problems)} failed, e.g. " + " | ".join(problems[:3]))
    return lines


async def test_ten_thousand_hostile_records_of_sixty_kinds_and_every_codec(kafka_topics, tiny_model_path):
    kafka = kafka_topics
    engine = tiny_engine(tiny_model_path)
    calibrate(engine, repeats=1)  # as `llm-worker serve` does: load estimates start from measured step times
    records = build_records(kafka, Ctx(vocab_size=engine.runner.vocab_size, now_ms=int(time.time() * 1000)))
    hostile = [rec for rec in records if rec.kind is not None]
    valid = [rec for rec in records if rec.kind is None]
    kind_counts = Counter(rec.kind.name for rec in hostile)
    codec_counts = Counter(rec.codec for rec in records)
    assert len(hostile) >= 10_000 and len(kind_counts) >= 60 and len(valid) >= 200, (len(hostile), len(kind_counts))
    assert set(codec_counts) == set(CODECS), codec_counts
    assert {rec.priority for rec in valid} == {0, 1, 2}
    first_valid = records.index(valid[0])
    assert 0 < first_valid and records.index(valid[-1]) < len(records) - 1  # interleaved, not first or last

    # What the decoder makes of one record of each kind, before any Kafka: a wrong declaration shows here.
    samples = {}
    for rec in hostile:
        samples.setdefault(rec.kind.name, rec)
    disagreements = [f"{name}: {why}" for name, rec in samples.items() if (why := decoder_agrees(rec))]
    assert not disagreements, "kinds whose declared expectation the decoder does not share:\n" + "\n".join(
        disagreements)

    print(f"\n{len(hostile)} hostile records of {len(kind_counts)} kinds, {len(valid)} valid requests; "
          f"records per codec {dict(sorted(codec_counts.items()))}")
    print("records per kind: " + ", ".join(f"{name} {n}" for name, n in sorted(kind_counts.items())))

    by_codec: dict[str, list[Rec]] = defaultdict(list)
    for rec in records:
        by_codec[rec.codec].append(rec)
    loop = asyncio.get_running_loop()
    async with Collector(kafka) as collector:
        # No shedding: a busy machine slows the worker's first steps, and the backlog of ten thousand records
        # would then be shed by its predicted wait; what each record gets is this test's subject, not the load.
        no_shedding = worker_settings(max_queue_time_s=[0.0, 0.0, 0.0])
        async with running_worker(kafka, no_shedding, engine, max_num_seqs=16) as worker:
            started = loop.time()
            # Five librdkafka producers at once, one per codec: their batches interleave in every partition.
            await asyncio.gather(*(asyncio.to_thread(produce_tracked, kafka, codec, recs)
                                   for codec, recs in by_codec.items()))
            last_produced = loop.time()
            assert all(rec.offset is not None for rec in records)
            commits = asyncio.create_task(wait_until_committed_to_end(kafka, COMMIT_FLOOR_S))
            progress = Progress(records)
            try:
                await collector.wait_until(progress, ANSWER_TIMEOUT_S)
            except TimeoutError:
                pass  # reported below, record by record
            answered = loop.time()
            state = await commits
            committed_at = loop.time()
            await asyncio.sleep(1.0)  # a duplicate answer, if any, would arrive now
            num_pending = worker.tracker.num_pending()
            stopping = worker.stopping.is_set()
            num_dead_letters = worker.answers.num_dead_letters
    results = collector.results

    shed_finals = [(rid, f.reason) for rid, fs in results.finals.items() for f in fs if f.reason == "shed"]
    shedding_reported = sum(1 for s in results.statuses if s.shedding)
    print(f"produced in {last_produced - started:.1f} s; every answer {answered - last_produced:.1f} s after the "
          f"last record; commits at the log end {committed_at - last_produced:.1f} s after it "
          f"({'reached' if all(c == e for c, e in state.values()) else 'NOT reached'}); "
          f"{len(results.dead_letters)} dead letters ({num_dead_letters} by the worker), "
          f"{sum(len(fs) for fs in results.finals.values())} finals, {len(shed_finals)} shed, "
          f"{shedding_reported} of {len(results.statuses)} status records say shedding")

    # Every floor statement is checked and all failures are reported together.
    failures = []
    # 1. every valid request completes; none is shed because of the bad records (the rest of 1 is in check).
    valid_shed = [rid for rid, _ in shed_finals if rid.startswith("ok-")]
    if valid_shed:
        failures.append(f"shed: {len(valid_shed)} valid requests were answered rejected/shed, e.g. {valid_shed[:10]}")
    # 2 and 3. one final per readable id, with its kind's status and reason; a dead letter at the (partition,
    # offset) of each record that cannot be decoded, and nothing else.
    if not progress(results):
        failures.append(f"unanswered {ANSWER_TIMEOUT_S:.0f} s after the last record: {len(progress.want_final)} "
                        f"finals, e.g. {sorted(progress.want_final)[:5]}; {len(progress.want_dead)} dead letters")
    failures += check(records, results, kafka.request_topic)
    if results.undecodable:
        failures.append(f"{results.undecodable} records on the result/dead-letter/status topics did not decode")
    # 4. within 30 s of the last record, the committed offset is the log end on every partition.
    behind = {p: (c, e) for p, (c, e) in state.items() if c != e}
    if behind:
        failures.append(f"commits: {COMMIT_FLOOR_S:.0f} s after the last record, partitions (committed, end) not "
                        f"at the log end: {behind}")
    elif committed_at - last_produced > COMMIT_FLOOR_S + 2.0:  # + one poll of the committed offsets
        failures.append(f"commits: at the log end only {committed_at - last_produced:.1f} s after the last record")
    if num_pending or stopping:
        failures.append(f"worker: {num_pending} offsets still pending, stopping={stopping}")
    assert not failures, "\n".join(failures)

"""A wire request's response_format as the engine's StructuredOutput (dispatcher.structured_output): one grammar
spec per kind, the schema as compact JSON in its own key order (the order the output's keys are generated in,
and the engine's compile-cache key). The transport itself never imports the grammar library."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
from aiokafka import TopicPartition

from schemas.decode import decode_request
from worker.engine.api import StructuredOutput
from worker.transport.requests.dispatcher import structured_output, to_engine_requests
from worker.transport.requests.local_queue import QueuedRequest

SCHEMA = {"type": "object", "properties": {"zeta": {"type": "integer"}, "alpha": {"enum": ["a", "b"]}},
          "required": ["zeta", "alpha"]}


def decoded(response_format) -> object:
    request = decode_request(json.dumps({"id": "x", "prompt": "hi", "response_format": response_format}).encode())
    return request.response_format


@pytest.mark.parametrize("response_format, expected", [
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}},
     StructuredOutput("json_schema", json.dumps(SCHEMA, separators=(",", ":")))),
    ({"type": "json_object"}, StructuredOutput("json_schema", '{"type":"object"}')),
    ({"type": "regex", "regex": "[0-9]{3}"}, StructuredOutput("regex", "[0-9]{3}")),
    ({"type": "grammar", "grammar": 'start: "a"+'}, StructuredOutput("grammar", 'start: "a"+')),
    ({"type": "text"}, None),
    (None, None),
])
def test_each_response_format_becomes_one_grammar_spec(response_format, expected):
    assert structured_output(decoded(response_format)) == expected


def test_equal_schemas_give_equal_specs_and_key_order_counts():
    spaced = decoded({"type": "json_schema", "json_schema": {"schema": json.loads(json.dumps(SCHEMA, indent=4))}})
    reordered = dict(reversed(list(SCHEMA.items())))
    other = decoded({"type": "json_schema", "json_schema": {"schema": reordered}})
    assert structured_output(spaced) == structured_output(decoded({"type": "json_schema",
                                                                    "json_schema": {"schema": SCHEMA}}))
    assert structured_output(other) != structured_output(spaced)
    assert msgspec.json.decode(structured_output(other).spec) == SCHEMA  # the same schema, another key order


def test_every_completion_of_the_request_carries_the_grammar():
    request = decode_request(json.dumps({"id": "x", "prompt": "hi", "max_new_tokens": 7, "n": 2,
                                         "response_format": {"type": "json_object"}}).encode())
    queued = QueuedRequest(request=request, partition=TopicPartition("t", 0), offset=1, priority=0, attempt=1,
                           timestamp_ms=int(time.time() * 1000), deadline_ms=None, reply_topic="r",
                           num_prompt_tokens=1, engine_id="x#1@0:1")
    specs = {r.sampling.structured for r in to_engine_requests(queued)}
    assert specs == {StructuredOutput("json_schema", '{"type":"object"}')}

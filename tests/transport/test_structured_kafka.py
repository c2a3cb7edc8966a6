"""Structured output through a real broker and an in-process worker on the tiny model: requests with a
response_format (JSON Schema, JSON object, regex) stream text that parses and validates, beside a free-text
request in the same batches; a schema the grammar library refuses gets one error/invalid_request final carrying
the library's message, and no chunk."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from benchmarks.lib.structured_schemas import SCHEMAS
from schemas.request import (ChatMessage, GenerationRequest, JsonObjectFormat, JsonSchemaFormat, JsonSchemaSpec,
                             RegexFormat, SamplingSpec)
from tests.transport.kafka_helpers import Collector, produce_requests, running_worker, worker_settings

pytestmark = pytest.mark.kafka

NAMES = ("enums", "numbers", "arrays")


def tiny_engine(model_path):
    from worker.model.settings import EngineSettings
    from worker.engine.engine import LLMEngine

    return LLMEngine(EngineSettings(model=str(model_path), device="cpu", dtype="float32", max_num_seqs=16,
                                    num_kv_blocks=128, max_num_batched_tokens=256, max_model_len=256))


def request(request_id: str, response_format=None, temperature: float = 0.0) -> GenerationRequest:
    return GenerationRequest(
        id=request_id, messages=[ChatMessage(role="user", content=f"Answer as JSON ({request_id}).")],
        max_new_tokens=150, sampling=SamplingSpec(temperature=temperature, seed=3 if temperature else None),
        response_format=response_format)


async def test_response_formats_through_kafka(kafka_topics, tiny_model_path):
    kafka = kafka_topics
    schema_requests = {f"{name}-{t}": request(f"{name}-{t}", JsonSchemaFormat(
        json_schema=JsonSchemaSpec(name=name, schema=SCHEMAS[name])), t) for name in NAMES for t in (0.0, 1.0)}
    bad = request("bad-schema", JsonSchemaFormat(json_schema=JsonSchemaSpec(
        schema={"type": "object", "properties": {"a": {"type": "strin"}}})))
    others = [request("object", JsonObjectFormat()), request("regex", RegexFormat(regex="[a-z]{2,5}-[0-9]{3}")),
              request("free", None, 0.8)]
    requests = [*schema_requests.values(), bad, *others]
    async with Collector(kafka) as collector:
        async with running_worker(kafka, worker_settings(), tiny_engine(tiny_model_path), max_num_seqs=16):
            await produce_requests(kafka, [(i % 3, r) for i, r in enumerate(requests)])
            await collector.wait_until(lambda r: len(r.finals) == len(requests), 120)
    results = collector.results
    finals = {r.id: results.finals[r.id] for r in requests}
    assert all(len(f) == 1 for f in finals.values()), finals
    final = {request_id: f[0] for request_id, f in finals.items()}
    for request_id in schema_requests:
        got = final[request_id]
        assert (got.status, got.reason) == ("completed", "stop"), got
        assert results.stream_text(request_id, got.attempt) == got.text
        jsonschema.validate(json.loads(got.text), SCHEMAS[request_id.rsplit("-", 1)[0]])
    # Any object: the random model may write one endless key, so only the stop case can be parsed.
    got = final["object"]
    assert got.status == "completed" and got.text.startswith("{")
    assert got.reason == "length" or isinstance(json.loads(got.text), dict)
    assert re.fullmatch("[a-z]{2,5}-[0-9]{3}", final["regex"].text) and final["regex"].reason == "stop"
    assert final["free"].status == "completed"
    refused = final["bad-schema"]
    assert (refused.status, refused.reason) == ("error", "invalid_request")
    assert "Invalid type: strin" in refused.message and refused.num_chunks == 0
    assert results.dead_letters == [] and results.undecodable == 0

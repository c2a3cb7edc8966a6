"""The OpenAI `model` field selects a LoRA adapter through the gateway (the official `openai` SDK as the client), a
real broker and a worker serving two adapters on the tiny model: GET /v1/models lists the base and the adapters the
workers report, an adapter's answer is the engine's own greedy output for that adapter, and an unknown model is a
404 model_not_found before anything reaches Kafka."""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest

from tests.gateway.test_gateway_kafka import MODEL, RunningGateway
from tests.model.lora_adapters import ATTENTION, make_adapter
from tests.transport.kafka_helpers import running_worker, worker_settings
from gateway.settings import GatewaySettings
from worker.model.settings import EngineSettings
from worker.kafka_settings import KafkaSettings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

PROMPT = "Once upon a time"


def engine(model_path, adapters_dir):
    from worker.engine.engine import LLMEngine

    return LLMEngine(EngineSettings(model=str(model_path), device="cpu", dtype="float32", max_num_seqs=16,
                                    num_kv_blocks=256, max_num_batched_tokens=256, adapters_dir=str(adapters_dir)))


async def test_model_selects_an_adapter_through_the_sdk(kafka_bootstrap, tiny_model_path, tmp_path):
    from worker.broker.topics import ensure_topics
    from worker.engine.api import EngineRequest, SamplingParams

    make_adapter(tiny_model_path, tmp_path / "adapters" / "alpha", seed=21, rank=8)
    make_adapter(tiny_model_path, tmp_path / "adapters" / "beta", seed=22, rank=4, targets=ATTENTION)
    direct = engine(tiny_model_path, tmp_path / "adapters")
    expected = {model: direct.generate([EngineRequest(model or "base", prompt=PROMPT, model=model,
                                                      sampling=SamplingParams(max_new_tokens=6))])[model or "base"].text
                for model in (None, "alpha", "beta")}
    assert len(set(expected.values())) == 3, expected

    suffix = uuid.uuid4().hex[:10]
    prefix = f"test.replies.{suffix}."
    kafka = KafkaSettings(bootstrap_servers=kafka_bootstrap, request_topic=f"test.requests.{suffix}",
                          result_topic=f"test.results.{suffix}", dead_letter_topic=f"test.dead-letter.{suffix}",
                          status_topic=f"test.status.{suffix}", control_topic=f"test.control.{suffix}",
                          group_id=f"test-workers-{suffix}", allowed_reply_topic_prefixes=[prefix])
    await ensure_topics(kafka)
    settings = GatewaySettings(reply_topic_prefix=prefix, data_dir=tmp_path / "gateway")
    async with running_worker(kafka, worker_settings(), engine(tiny_model_path, tmp_path / "adapters"),
                              max_num_seqs=16):
        async with RunningGateway(kafka, settings) as gateway:
            client = gateway.client()
            async with asyncio.timeout(20):  # until a status record with the adapters reached the gateway
                while len((await client.models.list()).data) < 3:
                    await asyncio.sleep(0.2)
            listed = await client.models.list()
            assert [m.id for m in listed.data] == [MODEL, "alpha", "beta"]
            answers = await asyncio.gather(*(
                client.completions.create(model=model or MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
                for model in (None, "alpha", "beta")))
            for model, answer in zip((None, "alpha", "beta"), answers):
                assert answer.model == (model or MODEL)
                assert answer.choices[0].text == expected[model], model
            chat = await client.chat.completions.create(model="beta", messages=[{"role": "user", "content": "Hi"}],
                                                        max_tokens=4, temperature=0)
            assert chat.model == "beta" and chat.choices[0].message.content is not None
            with pytest.raises(openai.NotFoundError) as raised:
                await client.completions.create(model="gamma", prompt=PROMPT, max_tokens=2)
            assert raised.value.code == "model_not_found" and "gamma" in str(raised.value)

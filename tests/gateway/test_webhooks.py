"""The webhook queue with no broker: events kept on disk across a restart and delivered once each, every one
verified with the openai SDK; an event past the retry bound dropped and counted."""

from __future__ import annotations

import pytest

import asyncio

import openai
from prometheus_client import CollectorRegistry, generate_latest

from gateway.webhooks import Webhooks, new_secret
from gateway.settings import GatewaySettings

SECRET = new_secret()


class Endpoint:
    def __init__(self) -> None:
        self.sdk = openai.OpenAI(api_key="-", base_url="http://127.0.0.1:1")
        self.events: list = []
        self.server = None
        self.port = 0

    async def up(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def down(self) -> None:
        self.server.close()
        await self.server.wait_closed()

    async def _serve(self, reader, writer) -> None:
        await reader.readline()
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers["content-length"]))
        self.events.append(self.sdk.webhooks.unwrap(body, headers, secret=SECRET))  # raises on a bad signature
        writer.write(b"HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n")
        await writer.drain()
        writer.close()


def settings(endpoint: Endpoint, **kw) -> GatewaySettings:
    return GatewaySettings(webhook_urls=[f"http://127.0.0.1:{endpoint.port}/in"], webhook_secret=SECRET,
                           webhook_allowed_hosts=["127.0.0.1"], webhook_backoff_initial_s=0.05,
                           webhook_backoff_max_s=0.2, **kw)


@pytest.mark.slow
async def test_events_survive_a_restart_and_each_is_delivered_once(tmp_path):
    endpoint = Endpoint()
    await endpoint.up()
    await endpoint.down()  # the port is known and closed: every attempt fails
    hooks = Webhooks(settings(endpoint), tmp_path, CollectorRegistry())
    await hooks.start()
    for i in range(3):
        await hooks.emit(f"evt_{i}", "response.completed", f"resp_{i}")
    await hooks.emit("evt_0", "response.completed", "resp_0")  # the same end queued twice
    async with asyncio.timeout(10):
        while hooks.num_failed_attempts < 6:
            await asyncio.sleep(0.02)
    await hooks.stop()
    assert len(list((tmp_path / "webhooks" / "pending").iterdir())) == 3

    await endpoint.up()
    registry = CollectorRegistry()
    again = Webhooks(settings(endpoint), tmp_path, registry)
    await again.start()
    try:
        assert await again.drained(10)
        await asyncio.sleep(0.3)
        assert sorted(e.data.id for e in endpoint.events) == ["resp_0", "resp_1", "resp_2"]
        await again.emit("evt_1", "response.completed", "resp_1")  # delivered already: not again
        await asyncio.sleep(0.3)
        assert len(endpoint.events) == 3
        text = generate_latest(registry).decode()
        assert 'llm_gateway_webhook_attempts_total{outcome="delivered",type="response.completed"} 3.0' in text
    finally:
        await again.stop()
        await endpoint.down()


async def test_an_event_past_the_retry_bound_is_dropped_and_counted(tmp_path):
    endpoint = Endpoint()
    await endpoint.up()
    await endpoint.down()
    registry = CollectorRegistry()
    hooks = Webhooks(settings(endpoint, webhook_retry_s=0.5), tmp_path, registry)
    await hooks.start()
    try:
        await hooks.emit("evt_x", "batch.failed", "batch_x")
        assert await hooks.drained(10)
        assert hooks.num_dropped == 1 and hooks.num_delivered == 0
        assert 'llm_gateway_webhook_dropped_total{type="batch.failed"} 1.0' in generate_latest(registry).decode()
        assert not list((tmp_path / "webhooks" / "pending").iterdir())
    finally:
        await hooks.stop()

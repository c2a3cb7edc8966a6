"""Stopping an aiokafka client whatever state its broker is in. Shared by the worker and the client side (the
gateway, llm_client): neither may stop halfway through its shutdown because one client could not say goodbye.

aiokafka's consumer.stop() re-raises the CancelledError of its own fetch task when that task was backing off from
a broker that went away, and a producer's stop() waits, without a limit, for batches a broker that is gone will
never take. Left alone, the first skips every client stopped after it and the second never returns; either way
clients keep polling the dead address for the life of the process. So a stop that fails or outlasts its limit is
finished here by hand, through aiokafka's private state (the one read of it outside
worker/transport/kafka/aiokafka_compat.py, whose test checks these attributes too): the producer's unsent batches
are failed, its sender closed, and the client's connections closed."""

from __future__ import annotations

import asyncio
import logging

from aiokafka.errors import KafkaTimeoutError

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0


async def stop_client(client, what: str, timeout_s: float = STOP_TIMEOUT_S,
                      unsent_error: Exception | None = None) -> None:
    """`await client.stop()` (close() for an admin client) within `timeout_s`; its errors are logged, not raised.
    A producer's batches still unsent then are failed with `unsent_error` (a KafkaTimeoutError naming `what` by
    default). A cancellation of the caller's own task still propagates."""
    stop = getattr(client, "stop", None) or client.close
    try:
        await asyncio.wait_for(stop(), timeout_s)
        return
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        log.warning("the %s's Kafka client was cancelled inside its own stop; closing its connections", what)
    except asyncio.TimeoutError:
        log.warning("the %s's Kafka client did not stop within %.0f s (a broker away?); dropping what it still "
                    "holds and closing its connections", what, timeout_s)
    except Exception as exc:  # noqa: BLE001 - a broker away: the client is closed as far as it can be
        log.warning("the %s's Kafka client did not stop cleanly (%r); closing its connections", what, exc)
    await _close_by_hand(client, what, unsent_error)


async def _close_by_hand(client, what: str, unsent_error: Exception | None) -> None:
    accumulator = getattr(client, "_message_accumulator", None)
    if accumulator is not None:  # a producer: its stop waits for these, and its sender task sends them
        accumulator.fail_all(unsent_error or KafkaTimeoutError(f"the {what}'s producer stopped before delivering"))
    sender = getattr(client, "_sender", None)
    connections = getattr(client, "_client", None) or getattr(client, "client", None)
    for step in (sender, connections):
        if step is None:
            continue
        try:
            await asyncio.wait_for(step.close(), 1.0)
        except Exception as exc:  # noqa: BLE001 - the next step is tried all the same
            log.warning("the %s's %s did not close (%r)", what, type(step).__name__, exc)

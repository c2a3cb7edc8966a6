"""The Python client of the workers: send generation requests to the request topic, read their token chunks and
finals from a result or reply topic, cancel, and back off while the workers report congestion.

    from llm_client import LLMClient

It needs Kafka's client and the wire schemas, not the worker's engine: importing it never imports torch
(tests/test_layers.py). The gateway, the `llm-worker generate`/`loadgen`/`demo` commands (`commands/`) and the
examples in producer_examples/ are built on it.
"""

from llm_client.backoff import BackoffPolicy
from llm_client.client import LLMClient
from llm_client.handle import ClientError, Delta, RequestHandle, RequestTimeout, StreamGap
from worker.kafka_settings import KafkaSettings  # where to connect and which topics: the workers' own

__all__ = ["BackoffPolicy", "ClientError", "Delta", "KafkaSettings", "LLMClient", "RequestHandle", "RequestTimeout",
           "StreamGap"]

"""The gateway's Prometheus metrics (`GET /metrics`): answers and tokens per API key id.

Labels stay bounded: a key id is one of the keys file's (an operator's list), `none` on a gateway without keys,
`unauthenticated` for a refused caller; past MAX_KEY_LABELS distinct ids the rest count as `other`. A key is
never a label, only its id.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

MAX_KEY_LABELS = 1000
NO_KEY = "none"
UNAUTHENTICATED = "unauthenticated"


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("llm_gateway_requests", "Answers by API key id, route and HTTP status.",
                                ["key_id", "route", "status"], registry=self.registry)
        self.tokens = Counter("llm_gateway_tokens", "Tokens of completed generations by API key id.",
                              ["key_id", "kind"], registry=self.registry)
        self._keys: set[str] = set()

    def _key(self, key_id: str) -> str:
        if key_id in self._keys:
            return key_id
        if len(self._keys) >= MAX_KEY_LABELS:
            return "other"
        self._keys.add(key_id)
        return key_id

    def answered(self, key_id: str, route: str, status: int) -> None:
        self.requests.labels(self._key(key_id), route, str(status)).inc()

    def used(self, key_id: str, prompt_tokens: int, completion_tokens: int) -> None:
        key = self._key(key_id)
        self.tokens.labels(key, "prompt").inc(prompt_tokens)
        self.tokens.labels(key, "completion").inc(completion_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

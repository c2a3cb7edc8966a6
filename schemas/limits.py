"""Size limits a worker enforces on incoming requests, beyond what the wire types themselves check.

The wire types (schemas/request.py) carry the protocol's own bounds: value ranges, the id's shape, the
largest integers. These limits are deployment policy instead, so they live apart and a worker may be
configured with others; the JSON Schema states only the protocol bounds and mentions these defaults in
field descriptions.

No imports beyond the standard library: producers in other processes import this package.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

SCHEMA_VERSION = 1
"""Version written into every record. Adding an optional field does not change it (readers ignore fields
they do not know); changing the meaning of an existing field does, and a worker rejects requests whose
version is higher than the one it knows."""

MAX_ID_CHARS = 128
"""Protocol bound on request ids: an id is a Kafka key, a log field and is echoed in every result record."""
MAX_TENANT_CHARS = 64
"""Protocol bound on tenant names: a tenant is a metric label and a status field."""
MAX_CACHE_SALT_CHARS = 256

MAX_SAFE_INT = 2**53 - 1
"""Largest integer every JSON reader keeps exactly (JavaScript numbers are doubles): the bound of counts and
times in milliseconds on the wire."""

MAX_INT32 = 2**31 - 1
MAX_SEED = 2**63 - 1
MAX_TOP_LOGPROBS = 20
"""Protocol bound on sampling.top_logprobs (as OpenAI's API)."""
MAX_COMPLETIONS = 16
"""Protocol bound on n and best_of: the completions one request may ask for."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_record_bytes: int = 1024 * 1024
    """Largest encoded request; Kafka's default message.max.bytes is about the same."""
    max_prompt_chars: int = 200_000
    """Characters of `prompt`, or of all message contents together."""
    max_messages: int = 256
    max_prompt_token_ids: int = 32_768
    max_new_tokens: int = 4096
    """Cap on a request's max_new_tokens; a larger value is rejected, not clamped, so the client knows."""
    max_stop_strings: int = 8
    max_stop_chars: int = 64
    """Characters of each stop string: the detokenizer holds back this much text while it checks them."""
    max_stop_token_ids: int = 32
    max_metadata_entries: int = 16
    max_metadata_chars: int = 256
    """Characters of each metadata key and of each value; metadata is echoed in the final record."""
    max_id_chars: int = MAX_ID_CHARS
    """May only tighten the protocol bound MAX_ID_CHARS."""
    max_response_format_chars: int = 1_000_000
    """Characters of `response_format`'s regex or grammar, or of its JSON schema as compact JSON: a bound on the
    text the grammar compiler is given (its own limits bound the work; the worker's ENGINE_GRAMMAR_* settings).
    A 50,000-value enum of short strings (v0 ... v49999) is about 440,000."""

    max_tools: int = 128
    """Functions one request may offer (OpenAI's bound)."""
    max_tools_chars: int = 200_000
    """Characters of a request's tools as compact JSON: they are rendered into the prompt, and a forced call's
    grammar is built from their schemas."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Limits.{f.name} must be a positive int, got {value!r}")
        if self.max_id_chars > MAX_ID_CHARS:
            raise ValueError(f"Limits.max_id_chars may not exceed the protocol bound {MAX_ID_CHARS}")


DEFAULT_LIMITS = Limits()

"""Admission control: decide, before a request costs compute, whether it is answered now instead of served.

Order of checks for a decoded request (decode errors are handled by schemas.decode before this):

1. reply topic: must be the result topic, in `KafkaSettings.allowed_reply_topics`, or start with one of
   `KafkaSettings.allowed_reply_topic_prefixes` (a gateway instance's own reply topic), else `error` /
   `reply_topic_not_allowed`; an allowed one known to be missing or not writable gives `error` /
   `reply_topic_unavailable` (both answered on the result topic, never on the topic the sender named).
2. deadline: already past, or unreachable by estimate, gives `rejected` / `deadline`. The estimate
   (service_model.py) is the queue wait (tokens ahead of it in the local queue and the engine's waiting
   queue / the saturated capacity in tokens per second) + its prefill + max_new_tokens - 1 decode steps at the
   step time the engine will run, with a safety margin: the prediction × DEADLINE_SAFETY_FACTOR +
   DEADLINE_SAFETY_S must fit before the deadline. Checked at intake, and again when the request leaves the
   local queue for the engine (its service alone, then). A request that would finish late is refused before it
   costs compute: its tokens would be wasted. With no estimate at all (an engine that has measured nothing)
   only the queue wait is taken as 0. The protected priorities (EngineSettings.protected_priorities: 0 and 1 by
   default) are admitted on the shortest service the engine can give (ServiceModel.squeezed_service_s): the
   scheduler shrinks its steps for a running request whose deadline needs it, at the expense of the bulk
   priority's throughput.
3. latency target (when moving a request from the local queue into the engine's batch): it is held back
   while admitting it would push the predicted step time past the inter-token latency target of a running
   request that is more urgent. With nothing more urgent running, a request is always admitted, so holding
   back cannot starve the queue.

Pure: no aiokafka, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.api import EngineStats

CHARS_PER_TOKEN = 4
"""Prompt length estimate for text prompts: the tokenizer lives in the engine thread, and for English
text about four characters make a token. Used only for time estimates, never for limits."""


@dataclass(slots=True, frozen=True)
class Verdict:
    status: str
    """"error" or "rejected"."""
    reason: str
    message: str
    retry_after_s: float | None = None
    """When waiting cures it (a quota): how long until the same request would be accepted."""


def estimate_prompt_tokens(prompt: str | None, messages: list | None, prompt_token_ids: list[int] | None,
                           tools_chars: int = 0) -> int:
    if prompt_token_ids is not None:
        return len(prompt_token_ids)
    if prompt is not None:
        return max(1, len(prompt) // CHARS_PER_TOKEN)
    # Chat templates add a few tokens of framing per message; tools are rendered into the prompt too.
    return (sum(max(1, m.num_chars // CHARS_PER_TOKEN) + 4 for m in messages or [])
            + tools_chars // CHARS_PER_TOKEN)


DEADLINE_SAFETY_FACTOR = 1.2
"""Predictions are stretched by this much before they are compared with a deadline..."""
DEADLINE_SAFETY_S = 0.25
"""...and this much is added (a step that runs long, the final record's trip to the client)."""
URGENT_SAFETY_FACTOR = 1.1
"""The stretch for the most urgent priority (0) instead: its deadline is the first promise, and a refusal breaks
it as surely as a late answer, so it is refused only when a tighter margin misses too (on a slow CPU, where its
8 steps take most of a 10 s deadline, 1.2 refused about one in ten that then finished in time)."""


def step_time_s(stats: EngineStats, num_tokens: int) -> float:
    return stats.step_time_base_s + stats.step_time_per_token_s * num_tokens


@dataclass(slots=True)
class Admission:
    result_topic: str
    allowed_reply_topics: frozenset[str]
    itl_target_ms: list[float]
    """Per priority (last value covers the rest); 0 disables the target."""
    max_num_batched_tokens: int = 512
    unavailable_reply_topics: dict[str, str] = field(default_factory=dict)
    """Allowed reply topics known to be missing or not writable now, with why (publisher's destinations)."""
    allowed_reply_topic_prefixes: tuple[str, ...] = ()
    """A reply topic that starts with one of these is allowed too."""

    def allows_reply_topic(self, topic: str) -> bool:
        return (topic == self.result_topic or topic in self.allowed_reply_topics
                or any(topic.startswith(prefix) for prefix in self.allowed_reply_topic_prefixes))

    def check_reply_topic(self, reply_topic: str | None) -> Verdict | None:
        if reply_topic is None or reply_topic == self.result_topic:
            return None
        if not self.allows_reply_topic(reply_topic):
            return Verdict("error", "reply_topic_not_allowed", f"reply topic {reply_topic!r} is not in the allow-list")
        why = self.unavailable_reply_topics.get(reply_topic)
        if why is not None:
            return Verdict("error", "reply_topic_unavailable", f"reply topic {reply_topic!r} unavailable: {why}")
        return None

    def check_deadline(
        self, deadline_ms: int | None, now_ms: float, est_queue_s: float | None, est_service_s: float, priority: int
    ) -> Verdict | None:
        if deadline_ms is None:
            return None
        if now_ms >= deadline_ms:
            return Verdict("rejected", "deadline", f"deadline passed {now_ms - deadline_ms:.0f} ms before admission")
        est_s = (est_queue_s or 0.0) + est_service_s
        factor = URGENT_SAFETY_FACTOR if priority == 0 else DEADLINE_SAFETY_FACTOR
        if now_ms + (est_s * factor + DEADLINE_SAFETY_S) * 1000.0 > deadline_ms:
            return Verdict(
                "rejected",
                "deadline",
                f"estimated finish in {est_s * 1000:.0f} ms (queue {(est_queue_s or 0) * 1000:.0f} ms, service "
                f"{est_service_s * 1000:.0f} ms) with its safety margin is past the deadline, "
                f"{deadline_ms - now_ms:.0f} ms away",
            )
        return None

    def itl_target_for(self, priority: int) -> float:
        return self.itl_target_ms[min(priority, len(self.itl_target_ms) - 1)]

    def may_enter_batch(
        self, priority: int, num_prompt_tokens: int, num_running_by_priority: list[int], stats: EngineStats
    ) -> bool:
        """False when this request would slow a more urgent running request past its ITL target."""
        if priority == 0 or not any(self.itl_target_ms):
            return True  # the common case, decided without arithmetic: nothing to protect
        num_running = sum(num_running_by_priority)
        if num_running == 0:
            return True
        num_tokens = min(num_running + num_prompt_tokens, max(self.max_num_batched_tokens, num_running + 1))
        predicted_ms = step_time_s(stats, num_tokens) * 1000.0
        for urgent in range(min(priority, len(num_running_by_priority))):
            target = self.itl_target_for(urgent)
            if num_running_by_priority[urgent] > 0 and target > 0 and predicted_ms > target:
                return False
        return True

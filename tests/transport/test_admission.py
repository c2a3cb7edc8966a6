"""Admission: reply-topic allow-list, deadlines by estimate, latency-target hold-back."""

from schemas.request import ChatMessage
from worker.broker.acls import Acl, client_acls, worker_acls
from gateway.settings import GatewaySettings
from worker.kafka_settings import KafkaSettings
from worker.engine.api import EngineStats
from worker.transport.load.admission import DEADLINE_SAFETY_FACTOR, DEADLINE_SAFETY_S, Admission, estimate_prompt_tokens


def make(itl=(50.0, 0.0, 0.0)) -> Admission:
    return Admission("results", frozenset({"team-a.results"}), list(itl), max_num_batched_tokens=512)


def test_reply_topic_allow_list():
    admission = make()
    assert admission.check_reply_topic(None) is None
    assert admission.check_reply_topic("results") is None
    assert admission.check_reply_topic("team-a.results") is None
    verdict = admission.check_reply_topic("someone-elses-topic")
    assert (verdict.status, verdict.reason) == ("error", "reply_topic_not_allowed")


def test_reply_topic_prefix_allows_each_gateway_instance_its_own_topic():
    admission = Admission("results", frozenset(), [0.0], allowed_reply_topic_prefixes=("llm.replies.",))
    assert admission.check_reply_topic("llm.replies.gw-a1b2") is None
    assert admission.check_reply_topic("llm.replies.gw-c3d4") is None
    for topic in ("llm.replies", "llm.repliesX", "other.llm.replies.gw"):
        assert admission.check_reply_topic(topic).reason == "reply_topic_not_allowed", topic


def test_a_worker_on_its_defaults_answers_a_gateway_on_its_defaults():
    """The worker's default prefixes allow the reply topic a default gateway creates, and the ACLs written for a
    worker by the broker helper let it write there (a secured fleet)."""
    kafka, gateway = KafkaSettings(_env_file=None), GatewaySettings(_env_file=None)
    admission = Admission(kafka.result_topic, frozenset(kafka.allowed_reply_topics), [0.0],
                          allowed_reply_topic_prefixes=tuple(kafka.allowed_reply_topic_prefixes))
    assert admission.check_reply_topic(gateway.reply_topic_prefix + "gw-a1b2") is None
    assert Acl("worker", "TOPIC", gateway.reply_topic_prefix, "WRITE", "PREFIXED") in worker_acls(kafka)
    # A gateway (the client principal) makes, reads, heartbeats for and sweeps topics under the same prefix.
    granted = set(client_acls(kafka))
    for kind, op in (("TOPIC", "CREATE"), ("TOPIC", "READ"), ("TOPIC", "DELETE"), ("GROUP", "READ")):
        assert Acl("client", kind, gateway.reply_topic_prefix, op, "PREFIXED") in granted


def test_deadline_passed_or_unreachable_is_rejected():
    admission = make()
    assert admission.check_deadline(None, 1000.0, 5.0, 5.0, 1) is None
    margin_ms = (0.9 * DEADLINE_SAFETY_FACTOR + DEADLINE_SAFETY_S) * 1000  # a 0.9 s prediction with its margin
    assert admission.check_deadline(round(1000 + margin_ms + 1), 1000.0, 0.5, 0.4, 1) is None
    passed = admission.check_deadline(900, 1000.0, 0.0, 0.0, 1)
    assert (passed.status, passed.reason) == ("rejected", "deadline")
    # 0.9 s fits in the 1.0 s left, but not with the margin: refused before it costs compute.
    unreachable = admission.check_deadline(2000, 1000.0, 0.5, 0.4, 1)
    assert (unreachable.reason == "deadline" and "900 ms" in unreachable.message
            and "queue 500 ms" in unreachable.message)
    # The most urgent priority is refused only past a tighter margin: 6 s of 7.1 s left fit 6 × 1.1 + 0.25,
    # not 6 × 1.2 + 0.25.
    assert admission.check_deadline(8100, 1000.0, 1.0, 5.0, priority=0) is None
    assert admission.check_deadline(8100, 1000.0, 1.0, 5.0, priority=1).reason == "deadline"


def test_prompt_token_estimate():
    assert estimate_prompt_tokens(None, None, [1, 2, 3]) == 3
    assert estimate_prompt_tokens("x" * 400, None, None) == 100
    assert estimate_prompt_tokens(None, [ChatMessage(role="user", content="y" * 40)], None) == 14


def test_latency_target_holds_back_a_less_urgent_request():
    admission = make(itl=(50.0, 0.0, 0.0))
    stats = EngineStats(step_time_base_s=0.02, step_time_per_token_s=0.0001)
    # 4 urgent requests running; a 400-token prompt gives 0.02 + 0.0001 * 404 = 60 ms > 50 ms.
    assert not admission.may_enter_batch(2, 400, [4, 0, 0], stats)
    assert admission.may_enter_batch(2, 40, [4, 0, 0], stats)  # 24 ms
    assert admission.may_enter_batch(0, 400, [4, 0, 0], stats)  # nothing more urgent than p0
    assert admission.may_enter_batch(2, 400, [0, 3, 0], stats)  # p1 has no target
    assert admission.may_enter_batch(2, 400, [0, 0, 0], stats)  # idle engine always admits

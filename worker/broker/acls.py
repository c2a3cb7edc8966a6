"""The ACLs of a secured broker (secure.py): what the worker and the client principals may do, created and
withdrawn through the admin API by a super user.

- worker: READ the request and control topics, READ its consumer group, WRITE the result, dead-letter and status
  topics and the allowed reply topics, DESCRIBE_CONFIGS on the topics it writes (it reads their record limit),
  and WRITE the transactional ids that start with its group id and a dot (one per request partition, when its
  finals are written in transactions).
- client: WRITE the request and control topics (requests and cancels), READ the result and status topics,
  and READ consumer groups whose names start with `client-` (for readers of results that commit offsets).
  As a gateway, on the allowed reply prefixes: CREATE, DESCRIBE, READ and DELETE its reply topics (it makes
  one per instance and sweeps those of crashed instances) and READ the groups of the same names (their
  heartbeats); on the background responses' topic (GATEWAY_RESPONSES_TOPIC): CREATE (the first gateway makes
  it), DESCRIBE, READ and WRITE (every instance reads all of it and writes the states of what it runs).

Consuming with a group needs READ on the group too; the worker's control reader and the example client read
without a group. Every name is taken from KafkaSettings.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.kafka_settings import KafkaSettings


def default_responses_topic() -> str:
    """GATEWAY_RESPONSES_TOPIC's default, from the gateway's settings class where it is installed (the worker
    never imports the gateway: config_cli finds the class through its entry point)."""
    from worker.config_cli import SETTINGS_CLASSES

    for cls in SETTINGS_CLASSES:
        if "responses_topic" in cls.model_fields:
            return cls.model_fields["responses_topic"].default
    return "llm.responses"

# Kafka's protocol codes (org.apache.kafka.common.resource.ResourceType, acl.AclOperation, acl.AclPermissionType,
# resource.PatternType).
RESOURCE_TYPES = {"TOPIC": 2, "GROUP": 3, "CLUSTER": 4, "TRANSACTIONAL_ID": 5}
OPERATIONS = {"READ": 3, "WRITE": 4, "CREATE": 5, "DELETE": 6, "ALTER": 7, "DESCRIBE": 8, "DESCRIBE_CONFIGS": 10}
ALLOW = 3
CLIENT_GROUP_PREFIX = "client-"
PATTERNS = {"LITERAL": 3, "PREFIXED": 4}


@dataclass(frozen=True, slots=True)
class Acl:
    principal: str
    """User name, as in User:<name>."""
    resource_type: str
    resource_name: str
    operation: str
    pattern: str = "LITERAL"
    """LITERAL: the resource of that name; PREFIXED: every resource whose name starts with it."""

    def __str__(self) -> str:
        names = "names starting with " if self.pattern == "PREFIXED" else ""
        return f"User:{self.principal} may {self.operation} {self.resource_type.lower()} {names}{self.resource_name}"


def worker_acls(kafka: KafkaSettings, principal: str = "worker") -> list[Acl]:
    written = [kafka.result_topic, kafka.dead_letter_topic, kafka.status_topic, *kafka.allowed_reply_topics,
               *([kafka.usage_topic] if kafka.usage_topic else [])]
    return [
        Acl(principal, "TOPIC", kafka.request_topic, "READ"),
        Acl(principal, "TOPIC", kafka.control_topic, "READ"),
        # Written in a partition's transactions, read back by its next owner.
        *(Acl(principal, "TOPIC", kafka.progress_topic, op) for op in ("READ", "WRITE", "DESCRIBE_CONFIGS")
          if kafka.progress_topic),
        Acl(principal, "GROUP", kafka.group_id, "READ"),
        *(Acl(principal, "TOPIC", topic, op) for topic in written for op in ("WRITE", "DESCRIBE_CONFIGS")),
        # Streams are read back from where they went when a partition's next owner resumes them.
        *(Acl(principal, "TOPIC", topic, "READ") for topic in (kafka.result_topic, *kafka.allowed_reply_topics)
          if kafka.progress_topic),
        # The gateways' reply topics, one per instance, by prefix.
        *(Acl(principal, "TOPIC", prefix, op, "PREFIXED") for prefix in kafka.allowed_reply_topic_prefixes
          for op in ("WRITE", "DESCRIBE_CONFIGS", *(("READ",) if kafka.progress_topic else ()))),
        Acl(principal, "TRANSACTIONAL_ID", f"{kafka.group_id}.", "WRITE", "PREFIXED"),
    ]


def client_acls(kafka: KafkaSettings, principal: str = "client", responses_topic: str | None = None) -> list[Acl]:
    responses_topic = responses_topic or default_responses_topic()
    return [
        Acl(principal, "TOPIC", kafka.request_topic, "WRITE"),
        Acl(principal, "TOPIC", kafka.control_topic, "WRITE"),
        Acl(principal, "TOPIC", kafka.result_topic, "READ"),
        Acl(principal, "TOPIC", kafka.status_topic, "READ"),
        Acl(principal, "GROUP", CLIENT_GROUP_PREFIX, "READ", "PREFIXED"),
        *(Acl(principal, kind, prefix, op, "PREFIXED") for prefix in kafka.allowed_reply_topic_prefixes
          for kind, op in (("TOPIC", "CREATE"), ("TOPIC", "DESCRIBE"), ("TOPIC", "READ"), ("TOPIC", "DELETE"),
                           ("GROUP", "READ"))),
        *(Acl(principal, "TOPIC", responses_topic, op) for op in ("CREATE", "DESCRIBE", "READ", "WRITE")),
    ]


async def create_acls(admin_settings: KafkaSettings, acls: list[Acl]) -> None:
    """Grant `acls` (as the super user `admin_settings` names); granting an existing ACL again is a no-op."""
    from aiokafka.protocol.admin import CreateAclsRequest

    await _send_each(admin_settings, [CreateAclsRequest(
        RESOURCE_TYPES[acl.resource_type], acl.resource_name, PATTERNS[acl.pattern], f"User:{acl.principal}", "*",
        OPERATIONS[acl.operation], ALLOW) for acl in acls], "creation_responses")


async def delete_acls(admin_settings: KafkaSettings, acls: list[Acl]) -> None:
    """Withdraw `acls`; a missing one is a no-op."""
    from aiokafka.protocol.admin import DeleteAclsRequest

    await _send_each(admin_settings, [DeleteAclsRequest(
        RESOURCE_TYPES[acl.resource_type], acl.resource_name, PATTERNS[acl.pattern], f"User:{acl.principal}", "*",
        OPERATIONS[acl.operation], ALLOW) for acl in acls], "filter_responses")


async def _send_each(admin_settings: KafkaSettings, requests: list, results_field: str) -> None:
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.errors import for_code

    from worker.transport.kafka.aiokafka_compat import send_admin_request

    admin = AIOKafkaAdminClient(**admin_settings.client_kwargs())
    await admin.start()
    try:
        for request in requests:  # aiokafka's request objects carry one binding each
            response = await send_admin_request(admin, request)
            for result in getattr(response, results_field):
                if result[0] != 0:
                    raise for_code(result[0])(result[1])
    finally:
        await admin.close()

"""Wire records shared by the worker and by producers and consumers in other processes.

Imports only msgspec and the standard library (never torch, aiokafka or worker.*), so a producer can use
it without the worker's dependencies. JSON Schemas of the records are in schemas/json/, example requests in
schemas/examples/.
"""

from schemas.control import CancelRecord, ControlRecord
from schemas.dead_letter import DeadLetterRecord
from schemas.decode import (
    RequestError,
    check_limits,
    decode_control,
    decode_dead_letter,
    decode_request,
    decode_result,
    decode_status,
    decode_usage,
    encode,
)
from schemas.limits import DEFAULT_LIMITS, SCHEMA_VERSION, Limits
from schemas.priority import partition_for, partitions_for_priority, priority_of_partition
from schemas.request import (
    ChatMessage,
    GenerationRequest,
    GrammarFormat,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    RegexFormat,
    ResponseFormat,
    SamplingSpec,
    TextFormat,
)
from schemas.result import (
    CANCEL_REASONS,
    ERROR_REASONS,
    FINISH_REASONS,
    REJECT_REASONS,
    FinalRecord,
    ResultRecord,
    StreamChunk,
    Timings,
    Usage,
)
from schemas.tools import FunctionCall, FunctionSpec, NamedToolChoice, Tool, ToolCall, ToolCallDelta, ToolChoice
from schemas.status import PriorityStatus, Throughput, WorkerStatus
from schemas.usage import UsageRecord

__all__ = [
    "CANCEL_REASONS",
    "CancelRecord",
    "ChatMessage",
    "ControlRecord",
    "DEFAULT_LIMITS",
    "DeadLetterRecord",
    "ERROR_REASONS",
    "FINISH_REASONS",
    "FinalRecord",
    "FunctionCall",
    "FunctionSpec",
    "GenerationRequest",
    "GrammarFormat",
    "JsonObjectFormat",
    "JsonSchemaFormat",
    "JsonSchemaSpec",
    "Limits",
    "NamedToolChoice",
    "PriorityStatus",
    "REJECT_REASONS",
    "RegexFormat",
    "RequestError",
    "ResponseFormat",
    "ResultRecord",
    "SCHEMA_VERSION",
    "SamplingSpec",
    "StreamChunk",
    "TextFormat",
    "Throughput",
    "Timings",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolChoice",
    "Usage",
    "UsageRecord",
    "WorkerStatus",
    "check_limits",
    "decode_control",
    "decode_dead_letter",
    "decode_request",
    "decode_result",
    "decode_status",
    "decode_usage",
    "encode",
    "partition_for",
    "partitions_for_priority",
    "priority_of_partition",
]

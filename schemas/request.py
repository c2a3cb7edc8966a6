"""The generation request as it travels on the requests topic (JSON, key = request id).

Policy for unknown fields: ignored (msgspec's default, `forbid_unknown_fields=False`). A newer producer may
add optional fields and an older worker still serves it; the cost is that a misspelt optional field
(`temprature`) is silently dropped, so producers should validate against the exported JSON Schema.

Constraints written here are protocol bounds, checked on every decode and stated in the JSON Schema.
Size limits that a deployment may change (prompt length, max_new_tokens cap, ...) live in limits.py and are
checked by decode.decode_request.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from schemas.limits import DEFAULT_LIMITS as _L
from schemas.tools import NamedToolChoice, Tool, ToolCall, ToolChoice, parameters_problem
from schemas.limits import (MAX_CACHE_SALT_CHARS, MAX_COMPLETIONS, MAX_ID_CHARS, MAX_INT32, MAX_SAFE_INT, MAX_SEED,
                            MAX_TENANT_CHARS, MAX_TOP_LOGPROBS, SCHEMA_VERSION)

# Visible ASCII only: an id becomes a Kafka key, a log field and a metric label, where spaces, control
# characters and look-alike Unicode cause more trouble than they are worth.
ID_PATTERN = "^[!-~]+$"
# Kafka's legal topic-name characters and length.
TOPIC_PATTERN = "^[a-zA-Z0-9._-]{1,249}$"

RequestId = Annotated[
    str,
    Meta(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN, description="Visible ASCII, 1 to 128 chars."),
]
TenantId = Annotated[
    str,
    Meta(min_length=1, max_length=MAX_TENANT_CHARS, pattern=ID_PATTERN,
         description=f"Visible ASCII, 1 to {MAX_TENANT_CHARS} chars."),
]
SchemaVersion = Annotated[int, Meta(ge=1, le=MAX_INT32, description="Wire schema version; absent means 1.")]
TokenId = Annotated[int, Meta(ge=0, le=MAX_INT32)]

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
"""The three ways to give a prompt; a request names exactly one."""


class WireRecord(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """Base of every top-level record on the wire: map-encoded JSON, frozen, a schema version.

    frozen and forbid_unknown_fields pass to subclasses; kw_only does not, so each subclass repeats it.
    """

    schema_version: SchemaVersion = SCHEMA_VERSION


class ChatMessage(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """One turn of a chat; the worker renders the list with the model's chat template (docs/wire-format.md, "Tool
    calling", for how calls and their results are rendered)."""

    role: Literal["system", "user", "assistant", "tool"]
    content: Annotated[str, Meta(description=(
        "The turn's text; null only on an assistant turn that made tool_calls."))] | None = None
    tool_calls: Annotated[list[ToolCall], Meta(min_length=1, description=(
        "An assistant turn's calls, as a final record's tool_calls gave them."))] | None = None
    tool_call_id: Annotated[str, Meta(min_length=1, max_length=MAX_ID_CHARS, description=(
        "A tool turn (the result of a call): the id of the call it answers."))] | None = None

    def __post_init__(self) -> None:
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"only an assistant message has tool_calls, not a {self.role} one")
        if self.content is None and self.tool_calls is None:
            raise ValueError(f"a {self.role} message needs content (null only beside tool_calls)")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id" if self.role == "tool"
                             else f"only a tool message has tool_call_id, not a {self.role} one")

    @property
    def num_chars(self) -> int:
        """Characters of its content and of its calls' names and arguments."""
        calls = sum(len(c.function.name) + len(c.function.arguments) for c in self.tool_calls or ())
        return len(self.content or "") + calls


class SamplingSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """How to pick each next token.

    The default is greedy: with at-least-once delivery a redelivered request then reproduces the stream
    it had, and so does a sampled one that carries a seed.
    """

    temperature: Annotated[float, Meta(ge=0.0, le=2.0, description="0 means greedy.")] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0, description="Nucleus mass; 1 keeps every token.")] = 1.0
    top_k: Annotated[int, Meta(ge=0, le=MAX_INT32, description="0 means no top-k cut.")] = 0
    seed: (
        Annotated[
            int,
            Meta(
                ge=0,
                le=MAX_SEED,
                description="Same seed, same tokens, whatever else shares the batch. JavaScript producers: "
                "keep it below 2**53.",
            ),
        ]
        | None
    ) = None
    stop: Annotated[
        list[Annotated[str, Meta(min_length=1)]],
        Meta(
            description=f"Stop strings: generation ends before them and they are not emitted. Worker default "
            f"limits: {_L.max_stop_strings} strings of at most {_L.max_stop_chars} chars."
        ),
    ] = []
    stop_token_ids: Annotated[
        list[TokenId],
        Meta(
            description=f"Stop tokens besides the model's EOS; not emitted. Worker default limit: "
            f"{_L.max_stop_token_ids}."
        ),
    ] = []
    ignore_eos: Annotated[bool, Meta(description="Keep going past EOS (benchmarks of fixed length).")] = False
    min_tokens: Annotated[
        int,
        Meta(ge=0, le=MAX_INT32, description="EOS and stop tokens cannot end the output before this many tokens "
             "(at most max_new_tokens). Stop strings still apply."),
    ] = 0
    presence_penalty: Annotated[
        float,
        Meta(ge=-2.0, le=2.0, description="Subtracted from the logit of every token already in the output "
             "(OpenAI's definition)."),
    ] = 0.0
    frequency_penalty: Annotated[
        float,
        Meta(ge=-2.0, le=2.0, description="Times the number of occurrences in the output so far, subtracted from "
             "a token's logit (OpenAI's definition)."),
    ] = 0.0
    repetition_penalty: Annotated[
        float,
        Meta(gt=0.0, description="1 means none. Each token of the prompt or output: a positive logit is divided "
             "by it, another multiplied (vLLM, transformers). Above 1 discourages repeats."),
    ] = 1.0
    logprobs: Annotated[
        bool,
        Meta(description="Return each output token's log-probability: under the model's distribution after "
             "penalties and min_tokens, before temperature, top_k and top_p."),
    ] = False
    top_logprobs: Annotated[
        int,
        Meta(ge=0, le=MAX_TOP_LOGPROBS, description="With logprobs: also this many most likely tokens at each "
             "step, with their log-probabilities."),
    ] = 0

    def __post_init__(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")


class _Format(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False, tag_field="type"):
    """Base of the response_format variants; `type` names which one (OpenAI's and vLLM's shape)."""


class TextFormat(_Format, kw_only=True, tag="text"):
    """Free text: no constraint (the same as no response_format)."""


class JsonObjectFormat(_Format, kw_only=True, tag="json_object"):
    """Any JSON object (the schema {"type": "object"})."""


class JsonSchemaSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=False):
    """OpenAI's `json_schema` object; only `schema` is used."""

    schema: Annotated[
        dict[str, Any],
        Meta(description="The JSON Schema the output must validate against. Objects are written in the order of "
             "their `properties`, on one line. A schema the worker's grammar library refuses (an unknown type, "
             "an unsupported keyword) ends the request with error/invalid_request and the library's message."),
    ]
    name: Annotated[str, Meta(description="Informational (OpenAI's API asks for it).")] | None = None
    description: Annotated[str, Meta(description="Informational.")] | None = None
    strict: Annotated[bool, Meta(description="Informational: the output always follows the schema.")] | None = None


class JsonSchemaFormat(_Format, kw_only=True, tag="json_schema"):
    """Output that validates against a JSON Schema."""

    json_schema: JsonSchemaSpec


class RegexFormat(_Format, kw_only=True, tag="regex"):
    """Output that matches a regular expression as a whole (Rust regex syntax, as llguidance reads it)."""

    regex: Annotated[str, Meta(min_length=1)]


class GrammarFormat(_Format, kw_only=True, tag="grammar"):
    """Output in the language of a context-free grammar, in llguidance's Lark syntax (`start: ...`)."""

    grammar: Annotated[str, Meta(min_length=1)]


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat | RegexFormat | GrammarFormat
"""What the output must look like, constrained token by token; `type` says which."""


class GenerationRequest(WireRecord, kw_only=True):
    """A request for one completion (or n). Exactly one of prompt, messages and prompt_token_ids is given.

    Every request gets exactly one final record on the reply topic (completed, rejected or error), preceded
    by stream chunks when `stream` is true.
    """

    id: RequestId
    prompt: (
        Annotated[
            str,
            Meta(min_length=1, description=f"Raw text prompt. Worker default limit: {_L.max_prompt_chars} chars."),
        ]
        | None
    ) = None
    messages: (
        Annotated[
            list[ChatMessage],
            Meta(
                min_length=1,
                description=f"Chat turns. Worker default limits: {_L.max_messages} messages, "
                f"{_L.max_prompt_chars} chars of content in all.",
            ),
        ]
        | None
    ) = None
    prompt_token_ids: (
        Annotated[
            list[TokenId],
            Meta(
                min_length=1,
                description=f"Already tokenized prompt. Worker default limit: {_L.max_prompt_token_ids} ids.",
            ),
        ]
        | None
    ) = None
    max_new_tokens: Annotated[
        int,
        Meta(
            ge=1,
            le=MAX_INT32,
            description=f"Worker default cap: {_L.max_new_tokens}; above it the request is rejected.",
        ),
    ] = 256
    sampling: SamplingSpec = msgspec.field(default_factory=SamplingSpec)
    response_format: (
        Annotated[
            ResponseFormat,
            Meta(description="Structured output: text, json_object, json_schema, regex or grammar (Lark). The "
                 "output follows it token by token and ends (stop) when it is complete; max_new_tokens can still "
                 "cut it short (finish_reason length). Needs a worker that knows the field (older ones ignore "
                 "it)."),
        ]
        | None
    ) = None
    deadline_ms: (
        Annotated[int, Meta(ge=0, le=MAX_SAFE_INT, description="Absolute deadline, unix epoch milliseconds.")] | None
    ) = None
    timeout_ms: (
        Annotated[
            int,
            Meta(
                ge=1,
                le=MAX_SAFE_INT,
                description="Deadline relative to the record's Kafka timestamp. With deadline_ms too, the "
                "earlier of the two holds.",
            ),
        ]
        | None
    ) = None
    reply_topic: (
        Annotated[
            str,
            Meta(
                pattern=TOPIC_PATTERN,
                description="Where to send the results; must be the result topic or one the worker allows.",
            ),
        ]
        | None
    ) = None
    metadata: (
        Annotated[
            dict[str, str],
            Meta(
                description=f"Echoed back in the final record. Worker default limits: {_L.max_metadata_entries} "
                f"entries, keys and values of at most {_L.max_metadata_chars} chars."
            ),
        ]
        | None
    ) = None
    priority: (
        Annotated[
            int,
            Meta(
                ge=0,
                le=255,
                description="Informational only: the partition a record is written to decides its priority "
                "(schemas.priority.partition_for).",
            ),
        ]
        | None
    ) = None
    stream: Annotated[
        bool, Meta(description="Send stream chunks; when false, only the final record, which then holds the text.")
    ] = True
    n: Annotated[int, Meta(ge=1, le=MAX_COMPLETIONS, description=(
        "Completions of the prompt to return. With n > 1 chunks and finals carry `index` (0 to n-1): each "
        "completion has its own chunk sequence and final record, then one request-level final (no index) ends "
        "the request. The completions share the prompt's KV blocks; with a seed, completion i samples with a "
        "seed derived from (seed, i), so a redelivery reproduces each."))] = 1
    best_of: (
        Annotated[int, Meta(ge=1, le=MAX_COMPLETIONS, description=(
            "Generate this many completions (>= n) and return the n with the highest cumulative log-probability "
            "(ranked, index 0 the best). Above n, no chunks are sent: which completions are returned is known "
            "only at the end."))]
        | None
    ) = None

    tools: (
        Annotated[list[Tool], Meta(min_length=1, description=(
            f"Functions the model may call (a chat request's only). Worker default limits: {_L.max_tools} tools, "
            f"{_L.max_tools_chars} chars of them all as compact JSON. Names are unique; each `parameters` is a "
            "JSON Schema of an object. See docs/wire-format.md, \"Tool calling\"."))]
        | None
    ) = None
    tool_choice: (
        Annotated[ToolChoice, Meta(description=(
            "With tools: auto (the default: the model answers or calls, calls are parsed from its output), none "
            "(tools are not shown to the model, nothing is parsed), required (the output is constrained to one "
            "call or more of the tools, with arguments that satisfy their schemas), or {\"type\": \"function\", "
            "\"function\": {\"name\": ...}} (constrained to one call of that function). A constrained call "
            "cannot be combined with response_format."))]
        | None
    ) = None
    parallel_tool_calls: Annotated[bool, Meta(description=(
        "Whether one answer may hold several calls: with tool_choice required, false constrains it to exactly "
        "one; with auto, false keeps only the first call parsed."))] = True

    tenant: (
        Annotated[TenantId, Meta(description=(
            "Who the request is for (a team, a customer). Within a priority, tenants share the worker fairly by "
            "tokens served; quotas apply per tenant; prefix-cache blocks are shared only within a tenant. Absent: "
            "the requests without a tenant form one tenant of their own."))]
        | None
    ) = None
    session_id: (
        Annotated[RequestId, Meta(description=(
            "A conversation's id. When given, it (not the request id) picks the partition within the priority "
            "(schemas.priority.partition_for), so the turns of a conversation reach the same worker and find "
            "their history in its prefix cache."))]
        | None
    ) = None
    cache_salt: (
        Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS, description=(
            "Prefix-cache blocks are shared only among requests of the same tenant and the same cache_salt (as "
            "vLLM's): a salt known only to some clients hides their prompts' cache state from the rest of the "
            "tenant. The completions of one request (n > 1) always share."))]
        | None
    ) = None
    model: (
        Annotated[RequestId, Meta(description=(
            "Which model answers: the name of a LoRA adapter the workers serve (a folder under their "
            "ENGINE_ADAPTERS_DIR), or the base model's name. Absent: the base model. An adapter no worker knows "
            "ends in an error final (invalid_request) naming it. Requests for different adapters and the base run "
            "in one batch; prefix-cache blocks are never shared between adapters. See docs/lora.md."))]
        | None
    ) = None

    def __post_init__(self) -> None:
        # Checked here rather than in decode.py so that a request built in Python is held to it too.
        given = [name for name in PROMPT_FIELDS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"exactly one of {', '.join(PROMPT_FIELDS)} must be given, got {given or 'none'}")
        if self.sampling.min_tokens > self.max_new_tokens:
            raise ValueError(f"sampling.min_tokens ({self.sampling.min_tokens}) exceeds max_new_tokens "
                             f"({self.max_new_tokens})")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        self._check_tools()

    def _check_tools(self) -> None:
        if self.tools is None:
            if self.tool_choice is not None and self.tool_choice != "none":
                raise ValueError("tool_choice needs tools")
            return
        if self.messages is None:
            raise ValueError("tools need messages (a chat request)")
        names = [tool.function.name for tool in self.tools]
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"tool names must be unique: {', '.join(duplicates)} given more than once")
        for i, tool in enumerate(self.tools):
            if tool.function.parameters is not None:
                problem = parameters_problem(tool.function.parameters)
                if problem is not None:
                    raise ValueError(f"tools[{i}] ({tool.function.name}): {problem}")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools "
                             f"({', '.join(names)})")
        if self.forces_tool_call and self.response_format is not None:
            raise ValueError("response_format cannot be combined with tool_choice required or a named function: "
                             "the output is then the call")

    @property
    def effective_tool_choice(self) -> ToolChoice:
        """What the request's tools do: `none` without tools, `auto` where tool_choice is not given."""
        if self.tools is None:
            return "none"
        return self.tool_choice if self.tool_choice is not None else "auto"

    @property
    def forces_tool_call(self) -> bool:
        """The output is constrained to a call (tool_choice required or a named function)."""
        return self.tools is not None and (self.tool_choice == "required"
                                          or isinstance(self.tool_choice, NamedToolChoice))

    @property
    def num_tools_chars(self) -> int:
        """Characters of the tools as compact JSON; 0 for none."""
        return len(msgspec.json.encode(self.tools)) if self.tools else 0

    @property
    def routing_key(self) -> str:
        """What picks the request's partition within its priority: the session id, else the adapter it names
        (`model`: its requests reach the workers that hold it loaded), else the request id."""
        if self.session_id is not None:
            return self.session_id
        return self.model if self.model is not None else self.id

    @property
    def num_completions(self) -> int:
        """How many completions the worker generates: best_of, else n."""
        return self.best_of if self.best_of is not None else self.n

    def deadline_at_ms(self, record_timestamp_ms: int) -> int | None:
        """The absolute deadline in epoch ms: the earlier of deadline_ms and timestamp + timeout_ms."""
        candidates = [self.deadline_ms] if self.deadline_ms is not None else []
        if self.timeout_ms is not None:
            candidates.append(record_timestamp_ms + self.timeout_ms)
        return min(candidates) if candidates else None

    @property
    def num_response_format_chars(self) -> int:
        """Characters of the response_format's regex, grammar, or JSON schema as compact JSON; 0 for none."""
        fmt = self.response_format
        if isinstance(fmt, RegexFormat):
            return len(fmt.regex)
        if isinstance(fmt, GrammarFormat):
            return len(fmt.grammar)
        if isinstance(fmt, JsonSchemaFormat):
            return len(msgspec.json.encode(fmt.json_schema.schema))
        return 0

    @property
    def num_prompt_chars(self) -> int:
        """Characters of text prompt or of all message contents; 0 for a token-id prompt."""
        if self.prompt is not None:
            return len(self.prompt)
        if self.messages is not None:
            return sum(m.num_chars for m in self.messages)
        return 0


"""OpenAI's request and response shapes, translated to and from the wire records. Pure: no HTTP, no Kafka.

`to_request` turns a `/v1/chat/completions` or `/v1/completions` body into a `GenerationRequest` (checked by
the same decoder the workers use, so a request the workers would refuse is refused here, before anything is
produced); `completion_body`, `chunk_body` and `usage_body` build the answers; `ApiError` is OpenAI's error
JSON with its HTTP status; `final_error` says which status a final that is not `completed` becomes.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import msgspec

from schemas.decode import decode_request
from schemas.limits import MAX_COMPLETIONS, MAX_TOP_LOGPROBS
from schemas.request import GenerationRequest
from schemas.result import FinalRecord, TokenLogprob, Usage
from schemas.tools import ToolCallDelta

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ENDPOINTS = (CHAT, COMPLETIONS)

DEFAULT_MAX_TOKENS = 256
"""max_new_tokens of a request that names neither max_tokens nor max_completion_tokens."""
MAX_STOP = 4
"""OpenAI's bound on stop sequences."""
UNSUPPORTED_FIELDS = ("functions", "function_call", "logit_bias", "audio", "prediction", "web_search_options",
                      "suffix")
"""Fields refused when set (non-null, non-empty): silently dropping them would answer another question.
`functions` and `function_call` are OpenAI's deprecated form of tools: their answers have another shape
(message.function_call), so they are refused with a pointer to `tools` rather than mapped."""
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


@dataclass(slots=True)
class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    key_id: str | None = None
    """The caller's API key id, where the error is about the key (its metrics label)."""

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(slots=True, frozen=True)
class Options:
    """What the gateway needs to know of one request besides its wire record, to shape the answer."""

    endpoint: str
    model: str
    stream: bool
    include_usage: bool
    n: int
    logprobs: bool
    top_logprobs: int
    service_tier: str | None
    tools: bool = False
    """The answer may hold tool calls (tools given, tool_choice not none): content and calls come from the
    worker's parse."""


@dataclass(slots=True, frozen=True)
class Tiers:
    """service_tier -> priority. `priority` and `scale` are the most urgent, `flex` the least; `auto`, `default`
    and none take the gateway's default priority."""

    num_priorities: int
    default_priority: int

    def priority(self, tier: str | None, header: str | None, most_urgent: int = 0) -> int:
        """The request's priority; `most_urgent`: the most urgent one its API key may use. Asked for explicitly
        (a header or a tier), a more urgent one is refused with 403; by default, it is lowered to the ceiling."""
        wanted = self._wanted(tier, header)
        if wanted >= most_urgent:
            return wanted
        if header is not None or tier not in (None, "auto", "default"):
            asked = f"X-Priority {header}" if header is not None else f"service_tier {tier!r}"
            raise ApiError(403, f"{asked} asks for priority {wanted}; this API key may use {most_urgent} and "
                           "less urgent ones", code="priority_not_allowed",
                           param="X-Priority" if header is not None else "service_tier")
        return min(most_urgent, self.num_priorities - 1)

    def _wanted(self, tier: str | None, header: str | None) -> int:
        if header is not None:
            try:
                value = int(header)
            except ValueError:
                raise bad_request(f"X-Priority must be an integer, got {header!r}", "X-Priority") from None
            if not 0 <= value < self.num_priorities:
                raise bad_request(f"X-Priority {value} is outside 0..{self.num_priorities - 1}", "X-Priority")
            return value
        if tier in (None, "auto", "default"):
            return min(self.default_priority, self.num_priorities - 1)
        if tier in ("priority", "scale"):
            return 0
        if tier == "flex":
            return self.num_priorities - 1
        raise bad_request(f"unknown service_tier {tier!r}", "service_tier")


def _opt(body: dict, name: str, kind: type | tuple, default: Any = None) -> Any:
    value = body.get(name)
    if value is None:
        return default
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind in (int, float)):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise bad_request(f"{name} must be {names}", name)
    return value


def _content(message: dict, i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones are supported
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts are supported", f"messages[{i}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request("content must be a string or a list of text parts", f"messages[{i}].content")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request("each message must be an object", f"messages[{i}]")
        role = ROLES.get(message.get("role"))
        if role is None:
            raise bad_request(f"unsupported role {message.get('role')!r} (system, developer, user, assistant, "
                              "tool)", f"messages[{i}].role")
        tool_calls = message.get("tool_calls") if role == "assistant" else None
        if tool_calls is not None and not isinstance(tool_calls, list):
            raise bad_request("tool_calls must be a list", f"messages[{i}].tool_calls")
        entry: dict[str, Any] = {"role": role}
        if tool_calls:  # the wire checks each call's shape; content may then be null
            entry["tool_calls"] = tool_calls
            entry["content"] = None if message.get("content") in (None, "") else _content(message, i)
        else:
            entry["content"] = _content(message, i)
        if role == "tool":
            entry["tool_call_id"] = message.get("tool_call_id")
        out.append(entry)
    return out


def _tools(body: dict) -> dict:
    """tools, tool_choice and parallel_tool_calls as the wire takes them; the decoder checks their contents."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    out: dict[str, Any] = {}
    if tools not in (None, []):
        if not isinstance(tools, list):
            raise bad_request("tools must be a list", "tools")
        out["tools"] = tools
    if choice is not None and (tools not in (None, []) or choice != "none"):
        out["tool_choice"] = choice
    parallel = _opt(body, "parallel_tool_calls", bool)
    if parallel is not None:
        out["parallel_tool_calls"] = parallel
    return out


_AT_PATH = re.compile(r"at `\$\.((?:messages|tools|tool_choice)\b[^`]*)`")
"""msgspec's path of the error, where it is a body field the wire takes as the body has it."""


def _param_of(message: str) -> str | None:
    """The body field a decoder message is about: the path msgspec gives, else a tool field it names."""
    at = _AT_PATH.search(message)
    if at is not None:
        return at.group(1)
    for name in ("tool_choice", "tools"):
        if name in message:
            return name
    return None


def _prompt(body: dict) -> dict:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return {"prompt": prompt}
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt_token_ids": prompt}
    raise bad_request("prompt must be a string, a list of token ids, or a list of one of them "
                      "(several prompts in one request are not supported)", "prompt")


def _response_format(body: dict) -> dict | None:
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object", "response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad_request("response_format.json_schema.schema must be an object", "response_format")
        return {"type": "json_schema", "json_schema": {"schema": spec["schema"]}}
    raise bad_request(f"unsupported response_format type {kind!r} (text, json_object, json_schema)",
                      "response_format")


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_request("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise bad_request(f"at most {MAX_STOP} stop sequences", "stop")
    return stops


def _logprobs(body: dict, endpoint: str) -> tuple[bool, int]:
    if endpoint == CHAT:
        wanted = _opt(body, "logprobs", bool, False)
        top = _opt(body, "top_logprobs", int, 0)
        if top and not wanted:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    else:  # the legacy endpoint: logprobs is the number of alternatives, 0 for the chosen token alone
        top = _opt(body, "logprobs", int)
        wanted = top is not None
        top = top or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}", "top_logprobs")
    return wanted, top


def to_request(body: Any, endpoint: str, request_id: str, models: list[str], tiers: Tiers, *,
               priority_header: str | None = None, timeout_header: str | None = None,
               reply_topic: str | None = None, default_timeout_ms: int | None = None,
               tenant: str | None = None, session_header: str | None = None, most_urgent: int = 0,
               adapters: Collection[str] = (),
               ) -> tuple[GenerationRequest, int, Options]:
    """(the wire request, its priority, how to shape its answer); raises ApiError for what cannot be served.

    Tenants and sessions: the tenant is the caller's API key's, or the X-Tenant header's where the caller may
    name one (a trusted key, or a gateway without keys behind an authenticating proxy), never the body's; the
    session from `prompt_cache_key` (OpenAI's key for requests that share a prefix) or the X-Session-Id header;
    `cache_salt` as vLLM takes it. `adapters`: the LoRA adapters the workers serve besides `models` (their
    status reports); a `model` naming one travels in the wire's `model`, the base models' names do not."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model is required", "model")
    if model not in models and model not in adapters:
        raise ApiError(404, f"The model `{model}` does not exist; served: {', '.join([*models, *adapters])}",
                       code="model_not_found", param="model")
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) not in (None, [], {}, ""):
            raise bad_request(f"{name} is not supported by this gateway", name, "unsupported_parameter")
    if endpoint == COMPLETIONS and body.get("echo"):
        raise bad_request("echo is not supported by this gateway", "echo", "unsupported_parameter")
    n = _opt(body, "n", int, 1)
    if not 1 <= n <= MAX_COMPLETIONS:
        raise bad_request(f"n must be in 1..{MAX_COMPLETIONS}", "n")
    best_of = _opt(body, "best_of", int) if endpoint == COMPLETIONS else None
    stream = _opt(body, "stream", bool, False)
    stream_options = _opt(body, "stream_options", dict, {})
    if best_of is not None and best_of > n and stream:
        raise bad_request("best_of > n cannot be streamed", "best_of")
    logprobs, top_logprobs = _logprobs(body, endpoint)
    max_tokens = _opt(body, "max_completion_tokens", int) if endpoint == CHAT else None
    max_tokens = max_tokens if max_tokens is not None else _opt(body, "max_tokens", int, DEFAULT_MAX_TOKENS)
    tier = _opt(body, "service_tier", str)
    priority = tiers.priority(tier, priority_header, most_urgent)
    timeout_ms = _timeout_ms(body, timeout_header) or default_timeout_ms
    seed = _opt(body, "seed", int)
    sampling = {
        "temperature": _opt(body, "temperature", float, 1.0),
        "top_p": _opt(body, "top_p", float, 1.0),
        "stop": _stop(body),
        "presence_penalty": _opt(body, "presence_penalty", float, 0.0),
        "frequency_penalty": _opt(body, "frequency_penalty", float, 0.0),
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
    }
    if seed is not None:
        sampling["seed"] = seed
    record: dict[str, Any] = {"id": request_id, "max_new_tokens": max_tokens, "sampling": sampling,
                              "stream": stream, "n": n, "priority": priority}
    record.update({"messages": _messages(body)} if endpoint == CHAT else _prompt(body))
    if endpoint == CHAT:
        record.update(_tools(body))
    elif body.get("tools") not in (None, []):
        raise bad_request("tools need /v1/chat/completions", "tools", "unsupported_parameter")
    if best_of is not None:
        record["best_of"] = best_of
    response_format = _response_format(body)
    if response_format is not None:
        record["response_format"] = response_format
    metadata = _opt(body, "metadata", dict)
    if metadata:
        record["metadata"] = metadata
    if timeout_ms is not None:
        record["timeout_ms"] = timeout_ms
    if reply_topic is not None:
        record["reply_topic"] = reply_topic
    if tenant:
        record["tenant"] = tenant
    if model not in models:
        record["model"] = model
    session = _opt(body, "prompt_cache_key", str) or session_header
    if session:
        record["session_id"] = session
    cache_salt = _opt(body, "cache_salt", str)
    if cache_salt:
        record["cache_salt"] = cache_salt
    decoded = decode_request(msgspec.json.encode(record))
    if not isinstance(decoded, GenerationRequest):
        raise bad_request(decoded.message, _param_of(decoded.message), code=decoded.code)
    options = Options(endpoint, model, stream, bool(stream_options.get("include_usage")), n, logprobs,
                      top_logprobs, tier, decoded.effective_tool_choice != "none")
    return decoded, priority, options


def _timeout_ms(body: dict, header: str | None) -> int | None:
    """`timeout` in the body (seconds, as the SDKs' extra_body can send it) or the X-Timeout-Ms header."""
    if header is not None:
        try:
            value = float(header)
        except ValueError:
            raise bad_request(f"X-Timeout-Ms must be a number, got {header!r}", "X-Timeout-Ms") from None
        if not value > 0:
            raise bad_request("X-Timeout-Ms must be positive", "X-Timeout-Ms")
        return max(1, round(value))
    seconds = _opt(body, "timeout", float)
    if seconds is None:
        return None
    if not seconds > 0:
        raise bad_request("timeout must be positive (seconds)", "timeout")
    return max(1, round(seconds * 1000))


# -- answers -------------------------------------------------------------------------------------------------

class TokenText:
    """Token ids to text for logprobs: a tokenizer.json when one is given, else `token_id:<id>` (vLLM's form for
    tokens returned as ids)."""

    def __init__(self, tokenizer=None) -> None:
        self._tokenizer = tokenizer
        self.text = lru_cache(maxsize=65536)(self._text)

    def _text(self, token_id: int) -> str:
        if self._tokenizer is None:
            return f"token_id:{token_id}"
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def load_token_text(tokenizer: str, models_dir, model: str) -> TokenText:
    """TokenText from a tokenizer.json (or a folder holding one): `tokenizer` if given, else the provisioned
    model's; without one, tokens are written as ids. Only the `tokenizers` package, never the engine."""
    from pathlib import Path

    path = Path(tokenizer) if tokenizer else Path(models_dir) / model
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        if tokenizer:
            raise FileNotFoundError(f"no tokenizer.json at {tokenizer}")
        return TokenText(None)
    from tokenizers import Tokenizer

    return TokenText(Tokenizer.from_file(str(path)))


def _entry(tokens: TokenText, token_id: int, logprob: float) -> dict:
    text = tokens.text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}


def chat_logprobs(tokens: TokenText, logprobs: list[TokenLogprob] | None) -> dict | None:
    if logprobs is None:
        return None
    return {"content": [dict(_entry(tokens, lp.token_id, lp.logprob),
                             top_logprobs=[_entry(tokens, t.token_id, t.logprob) for t in lp.top_logprobs])
                        for lp in logprobs], "refusal": None}


def text_logprobs(tokens: TokenText, logprobs: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
    """The legacy endpoint's shape: parallel lists, and the alternatives as {token: logprob} maps."""
    if logprobs is None:
        return None
    texts = [tokens.text(lp.token_id) for lp in logprobs]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{tokens.text(t.token_id): t.logprob for t in lp.top_logprobs} for lp in logprobs],
            "text_offset": offsets}


def usage_body(usage: Usage) -> dict:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def response_id(options: Options, request_id: str) -> str:
    return ("chatcmpl-" if options.endpoint == CHAT else "cmpl-") + request_id


def completion_body(options: Options, request_id: str, created: int, final: FinalRecord,
                    completions: list[FinalRecord], tokens: TokenText) -> dict:
    """The non-streamed answer, from the request's final and its completions' finals (by index)."""
    choices = []
    for index, done in enumerate(completions):
        text = done.text or ""
        if options.endpoint == CHAT:
            message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
            if options.tools and done.content is not None:
                message["content"] = done.content
            if done.tool_calls:
                message["content"] = done.content or None
                message["tool_calls"] = [msgspec.to_builtins(call) for call in done.tool_calls]
            choice = {"index": index, "message": message,
                      "logprobs": chat_logprobs(tokens, done.logprobs) if options.logprobs else None}
        else:
            choice = {"index": index, "text": text,
                      "logprobs": text_logprobs(tokens, done.logprobs) if options.logprobs else None}
        choice["finish_reason"] = done.finish_reason or "stop"
        choices.append(choice)
    return {"id": response_id(options, request_id),
            "object": "chat.completion" if options.endpoint == CHAT else "text_completion",
            "created": created, "model": options.model, "choices": choices, "usage": usage_body(final.usage),
            "service_tier": options.service_tier, "system_fingerprint": None}


def chunk_body(options: Options, request_id: str, created: int, choices: list[dict],
               usage: Usage | None = None, with_usage_field: bool = False) -> dict:
    body = {"id": response_id(options, request_id),
            "object": "chat.completion.chunk" if options.endpoint == CHAT else "text_completion",
            "created": created, "model": options.model, "choices": choices,
            "service_tier": options.service_tier, "system_fingerprint": None}
    if usage is not None:
        body["usage"] = usage_body(usage)
    elif with_usage_field:
        body["usage"] = None
    return body


def tool_call_deltas(pieces: list[ToolCallDelta] | None) -> list[dict]:
    """A chunk's tool-call pieces as OpenAI's delta.tool_calls entries: the first of a call with its id, type and
    name (arguments ""), the others with an arguments fragment."""
    out = []
    for piece in pieces or ():
        if piece.id is not None:
            out.append({"index": piece.index, "id": piece.id, "type": "function",
                        "function": {"name": piece.name, "arguments": piece.arguments}})
        else:
            out.append({"index": piece.index, "function": {"arguments": piece.arguments}})
    return out


def delta_choice(options: Options, index: int, text: str, logprobs: list[TokenLogprob] | None,
                 tokens: TokenText, *, first: bool = False, finish_reason: str | None = None,
                 tool_calls: list[dict] | None = None) -> dict:
    if options.endpoint == CHAT:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        if finish_reason is not None and not text and not first:
            delta = {}
        if tool_calls:
            delta["content"] = text or None
            delta["tool_calls"] = tool_calls
        lp = chat_logprobs(tokens, logprobs) if options.logprobs and logprobs else None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
    lp = text_logprobs(tokens, logprobs) if options.logprobs and logprobs else None
    return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}


def final_error(final: FinalRecord, retry_after_s: float | None = None) -> ApiError:
    """The HTTP answer to a final that is not `completed`: rejected/shed (and overloaded, queue_full) -> 429
    with Retry-After; rejected/deadline -> 504; error/internal, result_too_large and the reply-topic errors ->
    500; other errors (invalid_request, too_large, prompt_too_long, decode_error) -> 400; cancelled -> 409."""
    text = final.message or final.reason
    if final.status == "rejected":
        if final.reason == "deadline":
            return ApiError(504, f"the request's deadline passed: {text}", "timeout", "deadline_exceeded")
        if final.retry_after_ms is not None:
            retry_after_s = final.retry_after_ms / 1000
        retry = str(max(1, math.ceil(retry_after_s or 1.0)))
        if final.reason == "quota_exceeded":
            return ApiError(429, f"over quota: {text}", "rate_limit_error", "rate_limit_exceeded",
                            headers={"Retry-After": retry})
        return ApiError(429, f"the workers are shedding this priority: {text}", "rate_limit_error",
                        "rate_limit_exceeded", headers={"Retry-After": retry})
    if final.status == "cancelled":
        return ApiError(409, f"the request was cancelled: {text}", "invalid_request_error", "cancelled")
    if final.reason in ("internal", "result_too_large", "reply_topic_not_allowed", "reply_topic_unavailable",
                        "poison_request"):
        return ApiError(500, f"{final.reason}: {text}", "server_error", final.reason)
    return ApiError(400, text, "invalid_request_error", final.reason)


def now_s() -> int:
    return int(time.time())

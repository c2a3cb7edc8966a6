"""The HTTP side of the gateway: OpenAI's routes on Starlette, in front of one `Door` (door.py).

A request is checked whole (body size, JSON, model, every field, the same limits the workers apply) and then
refused with 429 + Retry-After if the status topic says its priority is shed or paused, all before anything is
produced. A streamed answer starts only once the first chunk or the final has come, so a request that the
workers refuse (shed, deadline, invalid) still gets a proper status code; after that, an error comes as an
`error` event in the stream. A client that goes away cancels its request through the control topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from gateway.batch_jobs import BatchJobs
from gateway.batch_run import Translator
from gateway.door import Door
from gateway.files import ANONYMOUS, FRAMING_BYTES, FileStore, int_param
from gateway.keys import KeyEntry, Keys
from gateway.metrics import NO_KEY, UNAUTHENTICATED, GatewayMetrics
from gateway.openai_api import (CHAT, COMPLETIONS, ApiError, Options, Tiers, TokenText, bad_request, chunk_body,
                                completion_body, delta_choice, final_error, now_s, to_request, tool_call_deltas)
from gateway.responses import Responses
from gateway.responses_api import (RESPONSES, StreamEvents, answer_of, new_response_id, outcome, response_object,
                                   to_wire)
from gateway.webhooks import Webhooks, configuration_error
from aiokafka.errors import KafkaError

from llm_client import ClientError, Delta, RequestHandle, RequestTimeout
from schemas.result import FinalRecord

log = logging.getLogger(__name__)

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
OUTAGE_RETRY_S = 5
"""Retry-After of a 503 when Kafka does not take a request: about a broker's restart or a leader election."""
TRACEPARENT = re.compile(rb"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$")
"""A W3C traceparent of version 00 (the only one defined); anything else is not passed on."""
MAX_TRACESTATE_BYTES = 512


@dataclass(slots=True, frozen=True)
class Caller:
    """Who sent a request: its API key, or None on a gateway without keys (every caller trusted)."""

    key: KeyEntry | None

    @property
    def owner(self) -> str:
        """Whose files and batches: the key's id (never the key)."""
        return self.key.id if self.key is not None else ANONYMOUS

    @property
    def label(self) -> str:
        """Its metrics label: the key's id."""
        return self.key.id if self.key is not None else NO_KEY

    @property
    def most_urgent(self) -> int:
        return self.key.most_urgent if self.key is not None else 0

    def tenant(self, header: str | None) -> str | None:
        """The request's tenant: the key's, or X-Tenant where the caller may name one."""
        key = self.key
        if key is None or (key.trusted and header):
            return header
        if header and header != key.tenant:
            raise ApiError(403, f"this API key is for tenant {key.tenant!r} and may not name another (X-Tenant)",
                           code="tenant_not_allowed", param="X-Tenant")
        return key.tenant


OPEN = Caller(None)


def _header(scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class Gateway:
    def __init__(self, door: Door, tokens: TokenText) -> None:
        self.door = door
        settings = door.settings
        self.models = list(settings.models)
        self.tiers = Tiers(door.num_priorities, settings.default_priority)
        self.tokens = tokens
        self.files = FileStore(settings.data_dir, max_files_per_owner=settings.max_files_per_owner)
        self.batches = BatchJobs(settings.data_dir, self.files, door.client,
                                 Translator(self.models, self.tiers, tokens),
                                 priority=door.bulk_priority, concurrency=settings.batch_concurrency,
                                 max_lines=settings.max_batch_lines, refusal=door.refusal,
                                 max_active_per_owner=settings.max_active_batches_per_owner)
        self.num_requests = 0
        self.keys = Keys(settings.keys_path)
        self.metrics = GatewayMetrics()
        refusal = configuration_error(settings)
        if refusal is not None:
            raise ValueError(refusal)
        self.webhooks = Webhooks(settings, settings.data_dir, self.metrics.registry)
        self.batches.notify = self._batch_ended
        self.responses = Responses(door, settings.data_dir, self.webhooks)
        self.keys.load()  # a bad keys file stops the start, with its path and what is wrong

    # -- lifecycle --------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        await self.door.start()
        self.keys.start()
        await self.webhooks.start()
        await self.files.load()
        await self.responses.start()
        await self.batches.load()
        sweeper = asyncio.create_task(self.files.sweep_every(self.door.settings.file_sweep_interval_s))
        try:
            yield
        finally:
            sweeper.cancel()
            await asyncio.gather(sweeper, return_exceptions=True)
            # Each part stops even when one before it fails (a broker gone mid-shutdown): a part left running
            # keeps its clients polling the dead address.
            for part in (self.batches, self.responses, self.webhooks, self.keys, self.door):
                try:
                    await part.stop()
                except Exception:  # logged; the next part still stops
                    log.exception("the gateway's %s did not stop cleanly", type(part).__name__)

    def app(self):
        routes = [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
            Route("/v1/files", self.upload, methods=["POST"]),
            Route("/v1/files", self.list_files, methods=["GET"]),
            Route("/v1/files/{file_id}", self.get_file, methods=["GET"]),
            Route("/v1/files/{file_id}", self.delete_file, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self.file_content, methods=["GET"]),
            Route("/v1/batches", self.create_batch, methods=["POST"]),
            Route("/v1/batches", self.list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.get_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel_batch, methods=["POST"]),
            Route("/v1/responses", self.create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"]),
            Route("/v1/responses/{response_id}/cancel", self.cancel_response, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
        ]
        routed = Starlette(routes=routes, lifespan=self.lifespan,
                           exception_handlers={ApiError: self._on_api_error, 404: self._on_not_found,
                                               405: self._on_not_allowed, Exception: self._on_error})
        generate = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS, RESPONSES: RESPONSES}

        async def app(scope, receive, send) -> None:
            if scope["type"] != "http":
                await routed(scope, receive, send)
                return
            path = scope["path"]
            if not path.startswith("/v1/"):
                await routed(scope, receive, send)
                return
            try:
                caller = self._authenticate(scope)
            except ApiError as error:
                self.metrics.answered(UNAUTHENTICATED if error.status == 401 else error.key_id or NO_KEY,
                                      _route(path), error.status)
                await error_response(error)(scope, receive, send)
                return
            scope.setdefault("state", {})["caller"] = caller
            # The generation routes skip Starlette's middleware and router: at a thousand requests a second,
            # its layers of wrapped send and receive callables cost more than the route itself.
            endpoint = generate.get(path)
            if endpoint is None or scope["method"] != "POST":
                await routed(scope, receive, _counting(send, self.metrics, caller.label, _route(path)))
                return
            try:
                request = Request(scope, receive, send)
                response = await (self.create_response(request) if endpoint == RESPONSES
                                  else self._generate(request, endpoint))
            except ApiError as error:
                if error.status == 403:  # a key asking for what it may not have: worth a line, by key id
                    log.warning("API key %s refused: %s", caller.label, error.message)
                response = error_response(error)
            except Exception as exc:  # noqa: BLE001 - every answer in OpenAI's shape, never a bare 500
                response = error_response(self._unexpected(exc))
            self.metrics.answered(caller.label, endpoint, response.status_code)
            await response(scope, receive, send)

        return app

    def _authenticate(self, scope) -> Caller:
        """The caller of a /v1/ route: 401 without a valid key (when keys are on), 429 past its rate."""
        if not self.keys.enabled:
            return OPEN
        authorization = _header(scope, b"authorization")
        entry = self.keys.check(authorization.decode("latin-1") if authorization is not None else None)
        if entry is None:
            raise ApiError(401, "Incorrect API key provided" if authorization else
                           "You didn't provide an API key (Authorization: Bearer <key>)", code="invalid_api_key")
        wait_s = self.keys.wait_s(entry)
        if wait_s > 0:
            raise ApiError(429, f"API key {entry.id} is past its {entry.requests_per_minute} requests a minute",
                           "rate_limit_error", "rate_limit_exceeded",
                           headers={"Retry-After": str(max(1, math.ceil(wait_s)))}, key_id=entry.id)
        return Caller(entry)

    def _unexpected(self, exc: BaseException) -> ApiError:
        """An error that is not the gateway's own, in OpenAI's shape: Kafka not answering is 503 (retry), a
        wait that ran out 504, anything else 500 (logged with its traceback)."""
        if isinstance(exc, RequestTimeout):  # before the next: it is a ClientError and a TimeoutError too
            return ApiError(504, str(exc), "timeout", "gateway_timeout")
        if isinstance(exc, (KafkaError, ClientError, TimeoutError)):
            return ApiError(503, f"the Kafka cluster is not answering ({type(exc).__name__}); retry later",
                            "server_error", "service_unavailable", headers={"Retry-After": str(OUTAGE_RETRY_S)})
        log.error("unexpected error serving a request", exc_info=exc)
        return ApiError(500, "the gateway failed to serve this request", "server_error", "internal_error")

    async def _on_error(self, request: Request, exc: Exception) -> JSONResponse:
        return error_response(self._unexpected(exc))

    async def _on_api_error(self, request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    async def _on_not_found(self, request: Request, exc) -> JSONResponse:
        return error_response(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    async def _on_not_allowed(self, request: Request, exc) -> JSONResponse:
        return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                                       code="method_not_allowed"))

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")

    async def health(self, request: Request) -> JSONResponse:
        body = {"status": "ok", "reply_topic": self.door.reply_topic}
        if self.webhooks.enabled:  # a failing endpoint shows here as well as in /metrics and the log
            hooks = self.webhooks
            body["webhooks"] = {"pending": hooks.num_pending, "delivered": hooks.num_delivered,
                                "failed_attempts": hooks.num_failed_attempts, "dropped": hooks.num_dropped}
        return JSONResponse(body)

    # -- bodies -----------------------------------------------------------------------------------------
    async def _body(self, request: Request, limit: int) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, f"the body has {declared} bytes, the limit is {limit}", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:  # the rest is left unread, so the connection cannot carry another request
                raise ApiError(413, f"the body exceeds {limit} bytes", code="request_too_large",
                               headers={"connection": "close"})
            chunks.append(chunk)
        return b"".join(chunks)

    async def _json(self, request: Request) -> dict:
        try:
            body = msgspec.json.decode(await self._body(request, self.door.settings.max_body_bytes))
        except msgspec.DecodeError as exc:
            raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object")
        return body

    # -- generation -------------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETIONS)

    async def _generate(self, request: Request, endpoint: str) -> Response:
        body = await self._json(request)
        caller = caller_of(request)
        headers = request.headers
        request_id = f"{self.door.instance_id}-{os.urandom(8).hex()}"
        wire, priority, options = to_request(
            body, endpoint, request_id, self.models, self.tiers,
            priority_header=headers.get("x-priority"), timeout_header=headers.get("x-timeout-ms"),
            tenant=caller.tenant(headers.get("x-tenant")), session_header=headers.get("x-session-id"),
            most_urgent=caller.most_urgent, adapters=self._adapters())
        handle = await self._submit(request, wire, priority)
        watch = Disconnect(request)
        handed_over = False
        try:
            first = await _first_or_gone(handle, watch)
            if first is None:
                return Response(status_code=499)
            if isinstance(first, FinalRecord) and first.status != "completed":
                raise final_error(first, self._retry_after(priority))
            if not options.stream:
                watch.stop()
                final = await handle.result()
                self.metrics.used(caller.label, final.usage.prompt_tokens, final.usage.completion_tokens)
                completions = await handle.completions()
                return JSONResponse(completion_body(options, request_id, now_s(), final, completions, self.tokens))
            handed_over = True
            return SSEResponse(self._events(handle, options, request_id, first, caller.label), watch, handle)
        finally:
            if not handed_over:
                watch.stop()

    async def _submit(self, request: Request, wire, priority: int) -> RequestHandle:
        """Sends a foreground request: 429 while its priority is refused, 503 while the workers would not answer
        on this gateway's reply topic or when Kafka does not take it; nothing is produced before either."""
        refused = self.door.refusal(priority)
        if refused is not None:
            why, retry_s = refused
            raise ApiError(429, f"priority {priority} is congested ({why}); retry after {retry_s} s",
                           "rate_limit_error", "rate_limit_exceeded", headers={"Retry-After": str(retry_s)})
        mismatch = self.door.reply_topic_refusal()
        if mismatch is not None:
            raise ApiError(503, mismatch, "server_error", "reply_topic_not_allowed")
        self.num_requests += 1
        try:
            async with asyncio.timeout(self.door.settings.submit_timeout_s):
                return await self.door.submit(wire, priority, headers=trace_headers(request.scope))
        except TimeoutError:
            # The record may still reach Kafka once it is back: cancelled then, it costs no worker time.
            self.door.client.cancel_later(wire.id, "not taken by Kafka in time")
            raise ApiError(503, f"Kafka did not take the request within {self.door.settings.submit_timeout_s:g} s; "
                           "retry later", "server_error", "service_unavailable",
                           headers={"Retry-After": str(OUTAGE_RETRY_S)}) from None

    def _retry_after(self, priority: int) -> float:
        refused = self.door.refusal(priority)
        return float(refused[1]) if refused else 1.0

    async def _events(self, handle: RequestHandle, options: Options, request_id: str, first,
                      key_label: str) -> AsyncIterator[dict]:
        """OpenAI's chunks: per completion a first delta with the role, deltas, a last one with finish_reason;
        with include_usage a last chunk with no choices and the usage (every other chunk has usage null)."""
        created = now_s()
        started: set[int] = set()
        with_usage = options.include_usage

        def piece(index: int, text: str, logprobs, finish_reason=None, tool_calls=None) -> dict:
            first_of_index = index not in started
            started.add(index)
            choice = delta_choice(options, index, text, logprobs, self.tokens, first=first_of_index,
                                  finish_reason=finish_reason, tool_calls=tool_calls)
            return chunk_body(options, request_id, created, [choice], with_usage_field=with_usage)

        async def deltas():
            if isinstance(first, Delta):  # taken off the stream to learn that the answer had started
                yield first
            async for delta in handle.stream():
                yield delta

        async for delta in deltas():
            if delta.restarted or delta.rewound_to is not None:  # what was sent cannot be taken back
                raise ApiError(500, "the request was served again after a worker failed; its stream restarted",
                               "server_error", "stream_restarted")
            if options.tools:
                # The worker's parse: content outside calls and the calls' pieces; text it holds back (a
                # possible call opening) makes chunks with neither, which need not go out.
                chunk = delta.chunk
                calls = tool_call_deltas(chunk.tool_calls)
                if chunk.content or calls or chunk.logprobs or delta.index not in started:
                    yield piece(delta.index, chunk.content or "", chunk.logprobs, tool_calls=calls)
                continue
            yield piece(delta.index, delta.text, delta.chunk.logprobs)
        final = await handle.result()
        if final.status != "completed":
            raise final_error(final, self._retry_after(handle.priority))
        self.metrics.used(key_label, final.usage.prompt_tokens, final.usage.completion_tokens)
        for index, done in enumerate(await handle.completions()):
            yield piece(index, "", None, done.finish_reason or "stop")
        if with_usage:
            yield chunk_body(options, request_id, created, [], usage=final.usage)

    # -- models -----------------------------------------------------------------------------------------
    def _model(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "kafka-llm-worker"}

    def _adapters(self) -> list[str]:
        """LoRA adapters the workers report serving, less any that shares a base model's name."""
        return [name for name in self.door.adapters() if name not in self.models]

    async def list_models(self, request: Request) -> JSONResponse:
        adapters = [{**self._model(name), "parent": self.models[0]} for name in self._adapters()]
        return JSONResponse({"object": "list", "data": [self._model(m) for m in self.models] + adapters})

    async def get_model(self, request: Request) -> JSONResponse:
        name = request.path_params["model"]
        if name not in self.models and name not in self._adapters():
            raise ApiError(404, f"The model `{name}` does not exist", code="model_not_found", param="model")
        return JSONResponse(self._model(name))

    # -- files and batches ------------------------------------------------------------------------------
    def _owner(self, request: Request) -> str:
        """Who the files and batches a request touches belong to: its API key's id (`anonymous` without keys)."""
        return caller_of(request).owner

    async def upload(self, request: Request) -> Response:
        limit = self.door.settings.max_upload_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit + FRAMING_BYTES:
            raise ApiError(413, f"the upload has {declared} bytes, the limit is {limit}", code="file_too_large",
                           headers={"connection": "close"})
        try:
            meta = await self.files.upload(request.stream(), request.headers.get("content-type", ""),
                                           self._owner(request), max_bytes=limit)
        except ClientDisconnect:
            return Response(status_code=499)
        return JSONResponse(meta)

    async def list_files(self, request: Request) -> JSONResponse:
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise bad_request("order must be 'asc' or 'desc'", "order")
        return JSONResponse(self.files.list(self._owner(request), purpose=query.get("purpose"),
                                            after=query.get("after"), order=order,
                                            limit=int_param(query.get("limit"), "limit", 10_000, 1, 10_000)))

    async def get_file(self, request: Request) -> JSONResponse:
        return JSONResponse(self.files.get(request.path_params["file_id"], self._owner(request)))

    async def delete_file(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.files.delete(request.path_params["file_id"], self._owner(request)))

    async def file_content(self, request: Request) -> Response:
        path = self.files.content_path(request.path_params["file_id"], self._owner(request))
        return FileResponse(path, media_type="application/jsonl")  # read in a thread by Starlette

    async def create_batch(self, request: Request) -> JSONResponse:
        tenant = caller_of(request).tenant(request.headers.get("x-tenant"))
        return JSONResponse(await self.batches.create(await self._json(request), self._owner(request), tenant))

    async def list_batches(self, request: Request) -> JSONResponse:
        query = request.query_params
        return JSONResponse(self.batches.list(self._owner(request), after=query.get("after"),
                                              limit=int_param(query.get("limit"), "limit", 20, 1, 100)))

    async def get_batch(self, request: Request) -> JSONResponse:
        return JSONResponse(self.batches.get(request.path_params["batch_id"], self._owner(request)))

    async def cancel_batch(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.batches.cancel(request.path_params["batch_id"], self._owner(request)))

    async def _batch_ended(self, batch: dict) -> None:
        status = batch["status"]
        await self.webhooks.emit(f"evt_{batch['id'][6:]}", f"batch.{status}", batch["id"],
                                 batch.get(f"{status}_at"))

    # -- responses --------------------------------------------------------------------------------------
    async def create_response(self, request: Request) -> Response:
        body = await self._json(request)
        caller = caller_of(request)
        headers = request.headers
        response_id = new_response_id()
        background = body.get("background") is True
        if background and caller.key is not None and not caller.key.background:
            raise ApiError(403, "this API key may not create background responses", code="background_not_allowed",
                           param="background")
        request_id = f"{response_id}.0" if background else f"{self.door.instance_id}-{os.urandom(8).hex()}"
        tenant = caller.tenant(headers.get("x-tenant"))
        wire, priority, options = to_wire(
            body, request_id, self.models, self.tiers, priority_header=headers.get("x-priority"),
            timeout_header=headers.get("x-timeout-ms"), tenant=tenant, session_header=headers.get("x-session-id"),
            most_urgent=caller.most_urgent, adapters=self._adapters())
        if background:
            return JSONResponse(await self.responses.create(response_id, wire, priority, options, caller.owner,
                                                            tenant))
        handle = await self._submit(request, wire, priority)
        watch = Disconnect(request)
        handed_over = False
        try:
            first = await _first_or_gone(handle, watch)
            if first is None:
                return Response(status_code=499)
            if isinstance(first, FinalRecord) and first.status not in ("completed", "cancelled"):
                raise final_error(first, self._retry_after(priority))
            if not options.stream:
                watch.stop()
                final = await handle.result()
                self.metrics.used(caller.label, final.usage.prompt_tokens, final.usage.completion_tokens)
                done = (await handle.completions())[0]
                status, error, incomplete = outcome(final, done.finish_reason)
                text, calls = answer_of(done, final, options)
                now = now_s()
                return JSONResponse(response_object(response_id, now, options, status=status, text=text,
                                                    usage=final.usage, error=error, incomplete_details=incomplete,
                                                    completed_at=now if status == "completed" else None,
                                                    tool_calls=calls))
            handed_over = True
            return ResponseEventStream(self._response_events(handle, response_id, options, first, caller.label),
                                       watch, handle)
        finally:
            if not handed_over:
                watch.stop()

    async def _response_events(self, handle: RequestHandle, response_id: str, options, first,
                               key_label: str) -> AsyncIterator[dict]:
        events = StreamEvents(response_id, options)
        for event in events.start():
            yield event
        try:
            def text_of(delta: Delta) -> str:  # with tools, the worker's content outside the calls
                return (delta.chunk.content or "") if options.may_call else delta.text

            if isinstance(first, Delta) and text_of(first):
                yield events.delta(text_of(first))
            async for delta in handle.stream():
                if delta.restarted or delta.rewound_to is not None:
                    raise ApiError(500, "the request was served again after a worker failed; its stream restarted",
                                   "server_error", "stream_restarted")
                if text_of(delta):
                    yield events.delta(text_of(delta))
            final = await handle.result()
        except ApiError as error:
            yield events.error(error)
            return
        except RequestTimeout as exc:
            yield events.error(ApiError(504, str(exc), "timeout", "gateway_timeout"))
            return
        self.metrics.used(key_label, final.usage.prompt_tokens, final.usage.completion_tokens)
        done = (await handle.completions())[0] if final.status == "completed" else None
        _, calls = answer_of(done, final, options)
        for event in events.finish(final, done.finish_reason if done is not None else None, calls):
            yield event

    async def get_response(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.responses.get(request.path_params["response_id"], self._owner(request)))

    async def cancel_response(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.responses.cancel(request.path_params["response_id"], self._owner(request)))

    async def delete_response(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.responses.delete(request.path_params["response_id"], self._owner(request)))


def _route(path: str) -> str:
    """A bounded label for a path: ids in it are dropped (/v1/files/file-abc/content -> /v1/files/content)."""
    parts = [p for p in path.split("/") if p and not p.startswith(("file-", "batch_", "batch-", "resp_"))]
    return "/" + "/".join(parts[:3])


def _counting(send, metrics: GatewayMetrics, key_label: str, route: str):
    """`send`, counting the answer's status as it starts."""

    async def counted(message) -> None:
        if message["type"] == "http.response.start":
            metrics.answered(key_label, route, message["status"])
        await send(message)

    return counted


def caller_of(request: Request) -> Caller:
    return request.scope.get("state", {}).get("caller", OPEN)


def trace_headers(scope) -> list[tuple[str, bytes]] | None:
    """The caller's W3C trace context, for the request record: the worker's span continues the caller's trace."""
    parent = _header(scope, b"traceparent")
    if parent is None or not TRACEPARENT.match(parent):
        return None
    state = _header(scope, b"tracestate")
    if state is not None and len(state) <= MAX_TRACESTATE_BYTES:
        return [("traceparent", parent), ("tracestate", state)]
    return [("traceparent", parent)]


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client has gone (the body was read already, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class Disconnect:
    """Cancels the task serving a request when its client goes away, until stop(). One watcher task and a
    callback, where racing the work against the watcher with asyncio.wait would cost a task and two waits
    more per request; the served task tells this cancellation from others by `gone`."""

    def __init__(self, request: Request) -> None:
        self.task = asyncio.current_task()
        self.gone = False
        self.armed = True
        self.watcher = asyncio.ensure_future(_wait_disconnect(request))
        self.watcher.add_done_callback(self._on_done)

    def _on_done(self, watcher: asyncio.Task) -> None:
        if watcher.cancelled() or watcher.exception() is not None or not self.armed:
            return
        self.gone = True
        self.task.cancel()

    def stop(self) -> None:
        """Called with no await since the last send: uvicorn's receive() also answers `http.disconnect` once
        the response is complete, and that must not cancel anything."""
        self.armed = False
        self.watcher.cancel()


async def _first_or_gone(handle: RequestHandle, watch: Disconnect):
    """The first chunk or the final, or None when the client went away before either came (its request is then
    cancelled). Any other failure cancels the request too, and is raised."""
    try:
        return await _first_record(handle)
    except asyncio.CancelledError:
        if not watch.gone:
            raise
        asyncio.current_task().uncancel()
        await handle.cancel("client disconnected")
        return None
    except BaseException:
        watch.stop()
        await handle.cancel("client disconnected") if not handle.done else None
        raise


async def _first_record(handle: RequestHandle):
    """The first chunk or the final, whichever comes first."""
    async for delta in handle.stream():
        return delta
    return await handle.result()


class SSEResponse(Response):
    """Server-sent events from an async iterator of JSON objects, ending with `data: [DONE]`. While it streams,
    `Disconnect` cancels it when the client goes; then the stream stops and the request is cancelled."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[dict], watch: Disconnect, handle: RequestHandle) -> None:
        # No super().__init__: it would declare a Content-Length for an empty body.
        self.status_code = 200
        self.background = None
        self.init_headers(SSE_HEADERS)
        self.events = events
        self.watch = watch
        self.handle = handle

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self._send_all(send)
        except asyncio.CancelledError:
            if not self.watch.gone:
                raise
            asyncio.current_task().uncancel()
            if not self.handle.done:
                await self.handle.cancel("client disconnected")
            return
        except OSError:
            pass
        finally:
            self.watch.stop()

    async def _send_all(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        encode = msgspec.json.encode
        # Once the final has come, every event left is ready: they go out in one write with [DONE] (a short
        # answer often comes whole in one fetch), where a write per event would cost a syscall each.
        frames: list[bytes] = []
        try:
            async for event in self.events:
                frames.append(b"data: " + encode(event) + b"\n\n")
                if not self.handle.done:
                    await send({"type": "http.response.body", "body": b"".join(frames), "more_body": True})
                    frames.clear()
        except ApiError as error:
            frames.append(b"data: " + encode(error.body()) + b"\n\n")
        except RequestTimeout as exc:
            body = ApiError(504, str(exc), "timeout", "gateway_timeout").body()
            frames.append(b"data: " + encode(body) + b"\n\n")
        frames.append(b"data: [DONE]\n\n")
        await send({"type": "http.response.body", "body": b"".join(frames), "more_body": False})


class ResponseEventStream(SSEResponse):
    """The Responses API's server-sent events: each named by its type (`event: response.output_text.delta`), and
    no `[DONE]` at the end (the terminal event says the stream is over)."""

    async def _send_all(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        encode = msgspec.json.encode
        frames: list[bytes] = []
        async for event in self.events:
            frames.append(b"event: " + event["type"].encode() + b"\ndata: " + encode(event) + b"\n\n")
            if not self.handle.done:
                await send({"type": "http.response.body", "body": b"".join(frames), "more_body": True})
                frames.clear()
        await send({"type": "http.response.body", "body": b"".join(frames), "more_body": False})

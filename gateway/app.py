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
import os
from collections.abc import AsyncIterator

import msgspec
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from gateway.batch_jobs import BatchJobs
from gateway.batch_run import Translator
from gateway.door import Door
from gateway.files import ANONYMOUS, FRAMING_BYTES, FileStore, int_param
from gateway.openai_api import (CHAT, COMPLETIONS, ApiError, Options, Tiers, TokenText, bad_request, chunk_body,
                                completion_body, delta_choice, final_error, now_s, to_request)
from producer_examples.client import Delta, RequestHandle, RequestTimeout
from schemas.result import FinalRecord

log = logging.getLogger(__name__)

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


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

    # -- lifecycle --------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette):
        await self.door.start()
        await self.files.load()
        await self.batches.load()
        sweeper = asyncio.create_task(self.files.sweep_every(self.door.settings.file_sweep_interval_s))
        try:
            yield
        finally:
            sweeper.cancel()
            await asyncio.gather(sweeper, return_exceptions=True)
            await self.batches.stop()
            await self.door.stop()

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
            Route("/health", self.health, methods=["GET"]),
        ]
        routed = Starlette(routes=routes, lifespan=self.lifespan,
                           exception_handlers={ApiError: self._on_api_error, 404: self._on_not_found,
                                               405: self._on_not_allowed})
        generate = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETIONS}

        async def app(scope, receive, send) -> None:
            # The two generation routes skip Starlette's middleware and router: at a thousand requests a
            # second, its layers of wrapped send and receive callables cost more than the route itself.
            # Everything else (and an error that is not an ApiError) goes the usual way.
            endpoint = generate.get(scope.get("path")) if scope["type"] == "http" else None
            if endpoint is None or scope["method"] != "POST":
                await routed(scope, receive, send)
                return
            try:
                response = await self._generate(Request(scope, receive, send), endpoint)
            except ApiError as error:
                response = error_response(error)
            await response(scope, receive, send)

        return app

    async def _on_api_error(self, request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc)

    async def _on_not_found(self, request: Request, exc) -> JSONResponse:
        return error_response(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    async def _on_not_allowed(self, request: Request, exc) -> JSONResponse:
        return error_response(ApiError(405, f"{request.method} is not allowed on {request.url.path}",
                                       code="method_not_allowed"))

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok", "reply_topic": self.door.reply_topic})

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
        request_id = f"{self.door.instance_id}-{os.urandom(8).hex()}"
        wire, priority, options = to_request(
            body, endpoint, request_id, self.models, self.tiers,
            priority_header=request.headers.get("x-priority"), timeout_header=request.headers.get("x-timeout-ms"),
            tenant_header=request.headers.get("x-tenant"), session_header=request.headers.get("x-session-id"))
        refused = self.door.refusal(priority)
        if refused is not None:
            why, retry_s = refused
            raise ApiError(429, f"priority {priority} is congested ({why}); retry after {retry_s} s",
                           "rate_limit_error", "rate_limit_exceeded", headers={"Retry-After": str(retry_s)})
        self.num_requests += 1
        handle = await self.door.submit(wire, priority)
        watch = Disconnect(request)
        handed_over = False
        try:
            try:
                first = await _first_record(handle)
            except asyncio.CancelledError:
                if not watch.gone:
                    raise
                asyncio.current_task().uncancel()  # the client went away before anything came
                await handle.cancel("client disconnected")
                return Response(status_code=499)
            except BaseException:
                watch.stop()
                await handle.cancel("client disconnected") if not handle.done else None
                raise
            if isinstance(first, FinalRecord) and first.status != "completed":
                raise final_error(first, self._retry_after(priority))
            if not options.stream:
                watch.stop()
                final = await handle.result()
                completions = await handle.completions()
                return JSONResponse(completion_body(options, request_id, now_s(), final, completions, self.tokens))
            handed_over = True
            return SSEResponse(self._events(handle, options, request_id, first), watch, handle)
        finally:
            if not handed_over:
                watch.stop()

    def _retry_after(self, priority: int) -> float:
        refused = self.door.refusal(priority)
        return float(refused[1]) if refused else 1.0

    async def _events(self, handle: RequestHandle, options: Options, request_id: str, first) -> AsyncIterator[dict]:
        """OpenAI's chunks: per completion a first delta with the role, deltas, a last one with finish_reason;
        with include_usage a last chunk with no choices and the usage (every other chunk has usage null)."""
        created = now_s()
        started: set[int] = set()
        with_usage = options.include_usage

        def piece(index: int, text: str, logprobs, finish_reason=None) -> dict:
            first_of_index = index not in started
            started.add(index)
            choice = delta_choice(options, index, text, logprobs, self.tokens, first=first_of_index,
                                  finish_reason=finish_reason)
            return chunk_body(options, request_id, created, [choice], with_usage_field=with_usage)

        async def deltas():
            if isinstance(first, Delta):  # taken off the stream to learn that the answer had started
                yield first
            async for delta in handle.stream():
                yield delta

        async for delta in deltas():
            if delta.restarted:  # a redelivery starts over: what was sent cannot be taken back
                raise ApiError(500, "the request was served again after a worker failed; its stream restarted",
                               "server_error", "stream_restarted")
            yield piece(delta.index, delta.text, delta.chunk.logprobs)
        final = await handle.result()
        if final.status != "completed":
            raise final_error(final, self._retry_after(handle.priority))
        for index, done in enumerate(await handle.completions()):
            yield piece(index, "", None, done.finish_reason or "stop")
        if with_usage:
            yield chunk_body(options, request_id, created, [], usage=final.usage)

    # -- models -----------------------------------------------------------------------------------------
    def _model(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "kafka-llm-worker"}

    async def list_models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [self._model(m) for m in self.models]})

    async def get_model(self, request: Request) -> JSONResponse:
        name = request.path_params["model"]
        if name not in self.models:
            raise ApiError(404, f"The model `{name}` does not exist", code="model_not_found", param="model")
        return JSONResponse(self._model(name))

    # -- files and batches ------------------------------------------------------------------------------
    def _owner(self, request: Request) -> str:
        """Who the files and batches a request touches belong to: every request is one owner's until requests
        carry a key that names another."""
        return ANONYMOUS

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
        return JSONResponse(await self.batches.create(await self._json(request), self._owner(request)))

    async def list_batches(self, request: Request) -> JSONResponse:
        query = request.query_params
        return JSONResponse(self.batches.list(self._owner(request), after=query.get("after"),
                                              limit=int_param(query.get("limit"), "limit", 20, 1, 100)))

    async def get_batch(self, request: Request) -> JSONResponse:
        return JSONResponse(self.batches.get(request.path_params["batch_id"], self._owner(request)))

    async def cancel_batch(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.batches.cancel(request.path_params["batch_id"], self._owner(request)))


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

"""`llm-worker generate "prompt"`: send one request, stream the answer to stdout, summarize on stderr.

Exit status 0 when the request completed, 1 when it was rejected, failed or timed out, 2 on bad arguments, 130
after Ctrl-C: the request is then cancelled (a cancel record on the control topic), and the rest of its text and
its `cancelled` final are printed if they arrive within --cancel-wait-s. A second Ctrl-C exits at once.
The prompt goes as chat messages (optional --system turn, then the user turn) unless --raw sends it as a
plain text prompt. Worker-side deadline: --deadline-ms (absolute, unix epoch ms) or --timeout-s (relative to
when the request is written); the client then waits until that deadline plus a grace period for the final.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
import uuid
from dataclasses import dataclass

import msgspec
from aiokafka.errors import KafkaError

from llm_client import BackoffPolicy, ClientError, LLMClient, RequestHandle, RequestTimeout, StreamGap
from schemas.decode import encode
from schemas.request import ChatMessage, GenerationRequest, JsonSchemaFormat, JsonSchemaSpec, SamplingSpec
from schemas.result import FinalRecord
from worker.kafka_settings import KafkaSettings

HELP = "send one prompt and stream the answer (example client)"
"""The one-line help of `llm-worker --help` (worker/cli.py finds this command by its entry point)."""

CANCEL_WAIT_S = 5.0
INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, as shells report it)."""


@dataclass(slots=True)
class Shown:
    """What stream_to printed, kept across an interruption so the text is not printed twice."""

    printed: bool = False


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user's message (or raw prompt with --raw)")
    parser.add_argument("--priority", type=int, default=1, help="0 is the most urgent (default 1)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    parser.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    parser.add_argument("--stop", nargs="+", default=[], metavar="S", help="stop strings")
    parser.add_argument("--system", default=None, help="a system message before the prompt")
    parser.add_argument("--raw", action="store_true", help="send a plain text prompt, no chat template")
    deadline = parser.add_mutually_exclusive_group()
    deadline.add_argument("--deadline-ms", type=int, default=None, help="absolute deadline, unix epoch ms")
    deadline.add_argument("--timeout-s", type=float, default=None, help="deadline in seconds from now")
    parser.add_argument("--wait-s", type=float, default=300.0, help="client wait without a deadline (default 300)")
    parser.add_argument("--id", default=None, help="request id (default: a random one)")
    parser.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (KAFKA_BOOTSTRAP_SERVERS)")
    parser.add_argument("--no-backoff", action="store_true", help="send at once even if workers report shedding")
    parser.add_argument("--n", type=int, default=1,
                        help="completions of the prompt (default 1); above 1 each is printed when all are done")
    parser.add_argument("--json-schema", default=None, metavar="FILE",
                        help="structured output: the answer is JSON that validates against this JSON Schema file")
    parser.add_argument("--tenant", default=None, help="who the request is for: fair share, quotas, cache namespace")
    parser.add_argument("--session-id", default=None,
                        help="a conversation's id: it picks the partition, so every turn reaches the same worker")
    parser.add_argument("--cache-salt", default=None, help="share prefix-cache blocks only with this salt")
    parser.add_argument("--cancel-wait-s", type=float, default=CANCEL_WAIT_S,
                        help=f"after Ctrl-C, how long to wait for the cancelled final (default {CANCEL_WAIT_S:g})")


def build_request(args: argparse.Namespace) -> GenerationRequest:
    sampling = SamplingSpec(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            stop=list(args.stop))
    prompt_fields: dict = {}
    if args.raw:
        if args.system:
            raise ValueError("--system needs the chat form; drop --raw")
        prompt_fields["prompt"] = args.prompt
    else:
        messages = [ChatMessage(role="system", content=args.system)] if args.system else []
        prompt_fields["messages"] = [*messages, ChatMessage(role="user", content=args.prompt)]
    if args.json_schema is not None:
        try:
            with open(args.json_schema, "rb") as f:
                schema = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"--json-schema {args.json_schema}: {exc}") from None
        prompt_fields["response_format"] = JsonSchemaFormat(json_schema=JsonSchemaSpec(schema=schema))
    request = GenerationRequest(
        id=args.id or f"gen-{uuid.uuid4().hex[:12]}",
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        n=args.n,
        stream=args.n == 1,  # several completions are printed one after the other at the end
        deadline_ms=args.deadline_ms,
        timeout_ms=None if args.timeout_s is None else max(1, int(args.timeout_s * 1000)),
        tenant=args.tenant,
        session_id=args.session_id,
        cache_salt=args.cache_salt,
        **prompt_fields,
    )
    try:
        # Structs check their bounds only when decoded: a round trip catches --temperature 5 here.
        msgspec.json.decode(encode(request), type=GenerationRequest)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None
    return request


def summary_line(final: FinalRecord | None, handle: RequestHandle, error: str | None = None) -> str:
    """One line: status (reason), tokens, client-side TTFT and end to end, attempt, worker."""
    if final is None:
        return f"[{handle.request_id}] {error or 'no answer'}"

    def ms(seconds: float | None) -> str:
        return "-" if seconds is None else f"{seconds * 1000:.0f} ms"

    parts = [f"{final.status} ({final.reason})", f"{final.usage.completion_tokens} tokens",
             f"TTFT {ms(handle.ttft_s)}", f"e2e {ms(handle.e2e_s)}", f"priority {handle.priority}",
             f"attempt {final.attempt}"]
    if handle.backoff_s:
        parts.append(f"backoff {handle.backoff_s * 1000:.0f} ms")
    if final.worker_id:
        parts.append(f"worker {final.worker_id}")
    if final.message:
        parts.append(final.message)
    return f"[{handle.request_id}] " + " · ".join(parts)


async def stream_to(handle: RequestHandle, out=sys.stdout, err=sys.stderr, timeout: float | None = None,
                    shown: Shown | None = None) -> FinalRecord:
    """Print the stream as it arrives, then return the final record. A restart (a worker died and another
    serves the request again) is announced on err and the new attempt printed from the start. `timeout`: the
    wait (default: the handle's); `shown`: what an earlier, interrupted call printed already."""
    shown = shown if shown is not None else Shown()
    try:
        async for delta in handle.stream(timeout):
            if delta.restarted:
                print(f"\n[attempt {delta.attempt} supersedes the text above; starting over]", file=err, flush=True)
            elif delta.rewound_to is not None:
                print(f"\n[attempt {delta.attempt} resumes at chunk {delta.rewound_to}; the text above since then "
                      "is replaced]", file=err, flush=True)
            out.write(delta.text)
            out.flush()
            shown.printed = shown.printed or bool(delta.text)
    except StreamGap as gap:
        print(f"\n[{gap}; the final record's text follows]", file=err, flush=True)
        final = await handle.result(timeout)
        out.write(final.text or "")
        shown.printed = True
    final = await handle.result(timeout)
    completions = await handle.completions(timeout)
    if completions != [final]:  # n > 1: each completion, one after the other
        for completion in completions:
            out.write(f"[completion {completion.index}: {completion.status} ({completion.reason})]\n"
                      f"{completion.text or ''}\n")
        shown.printed = True
    if not shown.printed and final.text:  # a stream=False answer, or one whose chunks carried no text
        out.write(final.text)
    if shown.printed or final.text:
        out.write("\n")
    out.flush()
    return final


class Interrupted(Exception):
    """Ctrl-C, while a step of `generate` was waiting."""


async def until_interrupted(awaitable, interrupted: asyncio.Event):
    """`awaitable`'s result, or Interrupted (the awaitable cancelled) once `interrupted` is set. Ctrl-C sets an
    event rather than cancelling the main task: on Python 3.11 a cancellation that lands while asyncio.wait_for
    completes (the client's stream waits that way) can be swallowed, and the stream then ran to its end."""
    work = asyncio.ensure_future(awaitable)
    interrupt = asyncio.ensure_future(interrupted.wait())
    try:
        await asyncio.wait({work, interrupt}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        interrupt.cancel()
    if interrupted.is_set():
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise Interrupted
    return work.result()


def on_ctrl_c(loop: asyncio.AbstractEventLoop, interrupted: asyncio.Event) -> bool:
    """The first Ctrl-C sets `interrupted`; a second one raises KeyboardInterrupt at once (the handler is
    removed after the first, which restores Python's). False where the loop cannot take signal handlers."""
    def first() -> None:
        interrupted.set()
        loop.remove_signal_handler(signal.SIGINT)

    try:
        loop.add_signal_handler(signal.SIGINT, first)
    except (NotImplementedError, RuntimeError, ValueError):  # Windows, or not the main thread
        return False
    return True


async def generate(settings: KafkaSettings, request: GenerationRequest, priority: int, wait_s: float,
                   backoff: BackoffPolicy, cancel_wait_s: float = CANCEL_WAIT_S) -> int:
    # Cancels are sent here (with a reason), not by the client's cancel_on_abandon.
    async with LLMClient(settings, backoff=backoff, default_timeout_s=wait_s, cancel_on_abandon=False) as client:
        handle: RequestHandle | None = None
        shown = Shown()
        interrupted = asyncio.Event()
        handled = on_ctrl_c(asyncio.get_running_loop(), interrupted)
        try:
            handle = await until_interrupted(client.submit(request, priority), interrupted)
            final = await until_interrupted(stream_to(handle, shown=shown), interrupted)
        except RequestTimeout as exc:
            print(summary_line(None, handle, f"timed out: {exc}"), file=sys.stderr)
            return 1
        except Interrupted:
            return await cancel_and_finish(client, request.id, handle, shown, cancel_wait_s)
        except asyncio.CancelledError:
            # Ctrl-C where no handler could be set: asyncio.run cancels this task once.
            asyncio.current_task().uncancel()
            return await cancel_and_finish(client, request.id, handle, shown, cancel_wait_s)
        finally:
            if handled and not interrupted.is_set():
                asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)
    print(summary_line(final, handle), file=sys.stderr)
    return 0 if final.status == "completed" else 1


async def cancel_and_finish(client: LLMClient, request_id: str, handle: RequestHandle | None, shown: Shown,
                            wait_s: float, out=sys.stdout, err=sys.stderr) -> int:
    """After Ctrl-C: send the cancel, print the rest of the text and the `cancelled` final if they come within
    wait_s (a request that finished first prints its final as it is)."""
    print("\n[interrupted: cancelling the request]", file=err, flush=True)
    try:
        if handle is None:  # interrupted while sending: the request may be in Kafka or not; a cancel is harmless
            await asyncio.wait_for(client.cancel(request_id, "interrupted (Ctrl-C)"), wait_s)
            print(f"[{request_id}] interrupted while sending; a cancel was sent", file=err)
            return INTERRUPTED
        await asyncio.wait_for(handle.cancel("interrupted (Ctrl-C)"), wait_s)
        final = await stream_to(handle, out, err, timeout=wait_s, shown=shown)
    except (RequestTimeout, asyncio.TimeoutError, ClientError, KafkaError) as exc:
        print(summary_line(None, handle, f"no final within {wait_s:g} s of the cancel: {exc!r}")
              if handle is not None else f"[{request_id}] cancel not sent: {exc!r}", file=err)
        return INTERRUPTED
    print(summary_line(final, handle), file=err)
    return INTERRUPTED


def run(args: argparse.Namespace) -> int:
    logging.getLogger("aiokafka").setLevel(logging.WARNING)  # its INFO lines would interleave the output
    settings = KafkaSettings(**({"bootstrap_servers": args.bootstrap} if args.bootstrap else {}))
    try:
        request = build_request(args)
    except ValueError as exc:  # msgspec checks bounds only when decoding; __post_init__ checks the prompt
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not 0 <= args.priority < settings.num_priorities:
        print(f"error: --priority must be in 0..{settings.num_priorities - 1}", file=sys.stderr)
        return 2
    backoff = BackoffPolicy(enabled=not args.no_backoff)
    started = time.monotonic()
    try:
        return asyncio.run(generate(settings, request, args.priority, args.wait_s, backoff, args.cancel_wait_s))
    except KeyboardInterrupt:
        print(f"\ninterrupted after {time.monotonic() - started:.1f} s", file=sys.stderr)
        return INTERRUPTED

"""An interactive chat over Kafka: `python -m producer_examples.chat [--system "..."] [--priority N]`.

The worker keeps no conversation state, so the client does: every turn sends the whole message list
(system, then alternating user and assistant turns) as a new request, and appends the streamed answer as
the assistant's turn. Commands: /quit (or end of input) leaves, /reset forgets the conversation.
A turn that does not complete (rejected, error, timeout) is dropped from the history, answer and question.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid

from llm_client import LLMClient, RequestTimeout
from llm_client.commands.generate import stream_to, summary_line
from schemas.request import ChatMessage, GenerationRequest, SamplingSpec
from worker.kafka_settings import KafkaSettings


class Conversation:
    def __init__(self, system: str | None = None) -> None:
        self.system = system
        self.messages: list[ChatMessage] = []
        self.reset()

    def reset(self) -> None:
        self.messages = [ChatMessage(role="system", content=self.system)] if self.system else []

    def request(self, user_text: str, max_new_tokens: int, sampling: SamplingSpec) -> GenerationRequest:
        """The next request: the history plus the new user turn (not added to the history until answered)."""
        return GenerationRequest(id=f"chat-{uuid.uuid4().hex[:12]}", max_new_tokens=max_new_tokens,
                                 sampling=sampling,
                                 messages=[*self.messages, ChatMessage(role="user", content=user_text)])

    def answered(self, user_text: str, answer: str) -> None:
        self.messages += [ChatMessage(role="user", content=user_text), ChatMessage(role="assistant", content=answer)]


async def read_line(prompt: str) -> str | None:
    """One line of stdin without blocking the event loop; None at end of input."""
    if sys.stdin.isatty():
        print(prompt, end="", flush=True)
    line = await asyncio.to_thread(sys.stdin.readline)
    return None if line == "" else line.rstrip("\n")


async def chat(settings: KafkaSettings, args: argparse.Namespace) -> int:
    conversation = Conversation(args.system)
    sampling = SamplingSpec(temperature=args.temperature, seed=args.seed)
    num_failed = 0
    async with LLMClient(settings, default_timeout_s=args.wait_s) as client:
        print("chat: type a message; /reset forgets the conversation, /quit leaves.", file=sys.stderr)
        while True:
            line = await read_line("you> ")
            if line is None or line.strip() == "/quit":
                break
            if line.strip() == "/reset":
                conversation.reset()
                print("(conversation forgotten)", file=sys.stderr)
                continue
            if not line.strip():
                continue
            request = conversation.request(line, args.max_new_tokens, sampling)
            handle = await client.submit(request, args.priority)
            if sys.stdout.isatty():
                print("bot> ", end="", flush=True)
            try:
                final = await stream_to(handle)
            except RequestTimeout as exc:
                print(summary_line(None, handle, f"timed out: {exc}"), file=sys.stderr)
                num_failed += 1
                continue
            if args.verbose:
                print(summary_line(final, handle), file=sys.stderr)
            if final.status == "completed":
                conversation.answered(line, final.text or "")
            else:
                num_failed += 1
                print(summary_line(final, handle), file=sys.stderr)
    return 0 if num_failed == 0 else 1


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", default="You are a helpful assistant. Answer briefly.")
    parser.add_argument("--priority", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--wait-s", type=float, default=300.0, help="longest wait for one answer")
    parser.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (KAFKA_BOOTSTRAP_SERVERS)")
    parser.add_argument("--verbose", action="store_true", help="a summary line after every answer")


def run(args: argparse.Namespace) -> int:
    settings = KafkaSettings(**({"bootstrap_servers": args.bootstrap} if args.bootstrap else {}))
    try:
        return asyncio.run(chat(settings, args))
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m producer_examples.chat", description=__doc__.split("\n")[0])
    configure_parser(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

"""`llm-worker batch run input.jsonl --output output.jsonl`: OpenAI's batch format, from files on disk.

Resumable: a rerun after Ctrl-C, a kill or a crash sends only the custom_ids without an answer in the output
or error file, and never writes one twice (gateway/batch_run.py). Ctrl-C (or SIGTERM) stops sending, cancels
what is in flight through the control topic, prints the summary and exits 130. Shows a progress bar on a
terminal (done/total, tokens/s, ETA), a line every 10 % otherwise; ends with a summary. Exit 0 when every line
has an answer (in the output or the error file).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from gateway.batch_run import AnswerFile, BatchRunner, Progress, Translator, parse_input
from gateway.door import Door
from gateway.openai_api import Tiers, load_token_text
from gateway.settings import GatewaySettings
from worker.paths import PathSettings
from worker.kafka_settings import KafkaSettings

HELP = "run an OpenAI batch file (JSONL) through the workers, resumably"
"""The one-line help of `llm-worker --help` (worker/cli.py finds this command by its entry point)."""

BAR_WIDTH = 30
REDRAW_S = 0.2


def configure_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    run_parser = sub.add_parser("run", help="send every line of a batch file, write the answers")
    run_parser.add_argument("input", type=Path, help="OpenAI batch JSONL (custom_id, method, url, body)")
    run_parser.add_argument("--output", type=Path, required=True, help="answers (appended; a rerun resumes)")
    run_parser.add_argument("--errors", type=Path, default=None,
                            help="refused lines (default: OUTPUT with .errors.jsonl)")
    run_parser.add_argument("--priority", type=int, default=None,
                            help="request priority (default: GATEWAY_BATCH_PRIORITY, the least urgent)")
    run_parser.add_argument("--concurrency", type=int, default=None,
                            help="requests in flight (default GATEWAY_BATCH_CONCURRENCY)")
    run_parser.add_argument("--bootstrap", default=None, help="Kafka bootstrap servers (KAFKA_BOOTSTRAP_SERVERS)")
    run_parser.add_argument("--quiet", action="store_true", help="no progress, only the summary")


def errors_path(output: Path) -> Path:
    name = output.name[:-len(".jsonl")] if output.name.endswith(".jsonl") else output.name
    return output.with_name(name + ".errors.jsonl")


def _clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60:02d}:{seconds % 60:02d}"


def progress_line(p: Progress) -> str:
    share = p.done / p.total if p.total else 1.0
    filled = round(share * BAR_WIDTH)
    return (f"[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {p.done}/{p.total} "
            f"{p.tokens_per_s:.0f} tok/s ETA {_clock(p.eta_s())} ({p.failed} failed)")


class ProgressBar:
    def __init__(self, quiet: bool, stream=sys.stderr) -> None:
        self.quiet = quiet
        self.stream = stream
        self.tty = stream.isatty()
        self._last_draw = 0.0
        self._last_tenth = -1

    def __call__(self, p: Progress) -> None:
        if self.quiet:
            return
        if self.tty:
            if p.elapsed_s - self._last_draw >= REDRAW_S or p.done == p.total:
                self._last_draw = p.elapsed_s
                self.stream.write("\r" + progress_line(p))
                self.stream.flush()
            return
        tenth = int(10 * p.done / p.total) if p.total else 10
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            print(progress_line(p), file=self.stream, flush=True)

    def end(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\n")


def summary(p: Progress, output: Path, errors: Path, interrupted: bool) -> str:
    state = "interrupted (rerun the same command to resume)" if interrupted else "done"
    return (f"batch {state}: {p.total} lines, {p.done_before} answered before this run, {p.completed} completed "
            f"and {p.failed} failed in this run, {p.total - p.done} left; {p.output_tokens} output tokens in "
            f"{p.elapsed_s:.1f} s ({p.tokens_per_s:.0f} tok/s); answers in {output}, errors in {errors}")


async def run_batch(kafka: KafkaSettings, settings: GatewaySettings, args: argparse.Namespace) -> int:
    errors = args.errors or errors_path(args.output)
    door = Door(kafka, settings, kind="batch")
    priority = door.bulk_priority if args.priority is None else args.priority
    if not 0 <= priority < kafka.num_priorities:
        print(f"--priority must be in 0..{kafka.num_priorities - 1}", file=sys.stderr)
        return 2
    translator = Translator(list(settings.models), Tiers(kafka.num_priorities, settings.default_priority),
                            load_token_text(settings.tokenizer, PathSettings().models_dir, settings.models[0]))
    output_file = await asyncio.to_thread(AnswerFile(args.output).open)
    error_file = await asyncio.to_thread(AnswerFile(errors).open)
    parsed = await asyncio.to_thread(lambda: parse_input(args.input.read_bytes()))
    bar = ProgressBar(args.quiet)
    runner = BatchRunner(door.client, translator, parsed, output_file, error_file,
                         priority=priority, concurrency=args.concurrency or settings.batch_concurrency,
                         on_progress=bar, refusal=door.refusal)
    loop = asyncio.get_running_loop()
    interrupted = False

    def interrupt() -> None:
        nonlocal interrupted
        interrupted = True
        runner.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupt)
    try:
        await door.start()
        try:
            progress = await runner.run()
        finally:
            await door.stop()
    finally:
        await output_file.close()
        await error_file.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    bar.end()
    print(summary(progress, args.output, errors, interrupted or progress.done < progress.total), file=sys.stderr)
    if progress.done < progress.total:
        return 130 if interrupted else 1
    return 0


def run(args: argparse.Namespace) -> int:
    kafka = KafkaSettings() if args.bootstrap is None else KafkaSettings(bootstrap_servers=args.bootstrap)
    # Its own reply topic, whatever GATEWAY_INSTANCE_ID says (that names a gateway's).
    return asyncio.run(run_batch(kafka, GatewaySettings().model_copy(update={"instance_id": ""}), args))

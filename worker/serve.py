"""`llm-worker serve`: the worker process. Builds the engine named by the settings and runs a
`worker.transport.worker.Worker` around it until SIGTERM/SIGINT. The process's allocator is set up before this
module is imported (worker/process.py, run by the CLI).

The one module that knows both sides: the transport only sees the `Engine` protocol (worker/engine/api.py).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import signal

from worker.allocator_settings import AllocatorSettings
from worker.model.settings import EngineSettings
from worker.kafka_settings import KafkaSettings
from worker.worker_settings import WorkerSettings
from worker.config_cli import masked_dump
from worker.engine.api import Engine
from worker import memory
from worker.process import configure_allocator
from worker.transport.kafka.access_check import AccessDenied, Needs, check_access
from worker.transport.requests.engine_process import EngineProcess
from worker.transport.worker import ACCESS_DENIED_EXIT, Worker

log = logging.getLogger(__name__)


def build_engine_process(allocator: AllocatorSettings, kind: str, engine_settings: EngineSettings,
                         instant_step_ms: float, fake: dict | None = None) -> Engine:
    """The build of an engine in a process of its own (WORKER_ENGINE_PROCESS): that process allocates the
    engine's native memory, so it gets the worker's allocator settings first and trims its heap on the
    worker's interval from a thread of its own (it runs no event loop)."""
    configure_allocator(allocator)
    engine = build_engine(kind, engine_settings, instant_step_ms, fake)
    memory.trim_every(allocator.malloc_trim_interval_s)
    return engine


def build_engine(kind: str, engine_settings: EngineSettings, instant_step_ms: float,
                 fake: dict | None = None) -> Engine:
    """`instant`: the model-free engine; `fake`: model-free with the real engine's dynamics (dynamic.py; `fake`
    holds its knobs); `llm`: LLMEngine on the runner ENGINE_DEVICE names (a real device, or a simulated GPU for
    sim:h100 / sim:h200, worker/model/sim.py)."""
    if kind == "fake":
        from worker.engine.dynamic import DynamicEngine

        return DynamicEngine(max_num_seqs=engine_settings.max_num_seqs, **(fake or {}))
    if kind == "instant":
        from worker.engine.instant import InstantEngine

        return InstantEngine(max_num_seqs=engine_settings.max_num_seqs, step_time_s=instant_step_ms / 1000.0)
    from worker.engine.calibrate import calibrate
    from worker.engine.engine import LLMEngine

    engine = LLMEngine(engine_settings)
    calibrate(engine)  # a cold worker's admission and shedding estimates start from measured step times
    memory.freeze_startup_objects()
    return engine



def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="model folder or provisioned name (ENGINE_MODEL)")
    parser.add_argument("--policy", choices=["continuous", "dynamic", "static"], help="batching policy (ENGINE_POLICY)")
    parser.add_argument("--device", help="auto, cpu, cuda, or a simulated GPU: sim:h100, sim:h200 (ENGINE_DEVICE)")
    parser.add_argument("--sim-model", help="simulated device: smollm2-135m, llama-3.1-8b or a config.json "
                                            "(ENGINE_SIM_MODEL)")
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (KAFKA_BOOTSTRAP_SERVERS)")
    parser.add_argument("--group", help="consumer group (KAFKA_GROUP_ID)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus port, 0 disables (WORKER_METRICS_PORT)")
    parser.add_argument("--worker-id", help="name in status and final records (WORKER_WORKER_ID)")
    parser.add_argument("--engine", choices=["llm", "instant", "fake"], default="llm",
                        help="llm: the model; instant: model-free, for plumbing benchmarks; fake: model-free with "
                             "the model's dynamics (lengths that vary, prompt cost, step time growing with the "
                             "batch, preemption that recomputes), for fault tests")
    parser.add_argument("--instant-step-ms", type=float, default=0.0, help="instant engine: emulated step time")
    parser.add_argument("--fake-step-ms", type=float, default=20.0, help="fake engine: an empty step's time")
    parser.add_argument("--fake-per-seq-ms", type=float, default=1.0, help="fake engine: added per running request")
    parser.add_argument("--fake-prefill-us-per-token", type=float, default=50.0,
                        help="fake engine: per prompt (or recomputed) token of each request seated in a step")
    parser.add_argument("--fake-eos-probability", type=float, default=0.3,
                        help="fake engine: the share of requests that stop early, at a seeded point")


def run(args: argparse.Namespace) -> int:
    kafka_over = {k: v for k, v in (("bootstrap_servers", args.bootstrap), ("group_id", args.group)) if v}
    worker_over = {k: v for k, v in (("metrics_port", args.metrics_port), ("worker_id", args.worker_id))
                   if v is not None}
    engine_over = {k: v for k, v in (("model", args.model), ("policy", args.policy), ("device", args.device),
                                      ("sim_model", args.sim_model)) if v}
    kafka, settings, engine_settings = (KafkaSettings(**kafka_over), WorkerSettings(**worker_over),
                                        EngineSettings(**engine_over))
    try:  # before the model loads: a wrong password or a missing ACL is known in a second, not after a minute
        asyncio.run(check_access(kafka, Needs.of_worker(kafka)))
    except AccessDenied as exc:
        log.error("cannot serve: %s", exc)
        return ACCESS_DENIED_EXIT
    if args.engine == "llm":
        log.info("engine configuration: %s", json.dumps(masked_dump(engine_settings), default=str))
    fake = {"step_time_s": args.fake_step_ms / 1000.0, "per_seq_s": args.fake_per_seq_ms / 1000.0,
            "prefill_s_per_token": args.fake_prefill_us_per_token / 1e6,
            "eos_probability": args.fake_eos_probability}
    allocator = AllocatorSettings()
    if settings.engine_process:
        engine = EngineProcess.spawn(functools.partial(build_engine_process, allocator, args.engine, engine_settings,
                                                       args.instant_step_ms, fake))
    else:
        engine = build_engine(args.engine, engine_settings, args.instant_step_ms, fake)
    # What a burst freed stops counting in the resident size (worker/memory.py); a thread of its own, since a
    # trim of a fragmented heap takes tens of milliseconds.
    memory.trim_every(allocator.malloc_trim_interval_s)
    return asyncio.run(_serve(kafka, settings, engine, engine_settings))


async def _serve(kafka, settings, engine, engine_settings: EngineSettings) -> int:
    worker = Worker(kafka, settings, engine, max_num_seqs=engine_settings.max_num_seqs,
                    max_num_batched_tokens=engine_settings.max_num_batched_tokens)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    return await worker.run()

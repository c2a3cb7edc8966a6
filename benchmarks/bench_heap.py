"""The soak's mix on the engine alone, as fast as it runs: glibc's heap against the distinct schemas compiled.

The soak (bench_soak.py) needs a quarter hour at 8 requests/s to show the free heap's rise in the mix: what
drives it is how many distinct grammars have passed through the cache, and at the soak's 20 % schemas that is
1.6 a second. Here the soak's requests (bench_soak.make_request, turned into engine requests by the worker's
own conversion; a cancel is sent as the request it would cancel) go straight to an LLMEngine, `--in-flight`
at once, so a thousand schemas take minutes. The allocator is set up as `llm-worker serve` sets it (the arena
cap; the mmap threshold when asked) and trimmed every 60 s, and the engine steps on a thread of its own,
prepared as the worker's engine thread is. Every `--every` finals it prints the resident size, glibc's heap
(in use, free) and the resident size of the stepping thread's arena; at the end, glibc's own account per arena
(malloc_info) goes to `--malloc-info` when given.

    .venv/bin/python -m benchmarks.bench_heap --requests 5000 --in-flight 16
    .venv/bin/python -m benchmarks.bench_heap --requests 5000 --in-flight 16 --arena-max 2
    .venv/bin/python -m benchmarks.bench_heap --requests 4000 --in-flight 8 --burst-every 500 --burst-size 64 \
        --mmap-threshold 4194304        # the worker's defaults, with a burst every 500 finals

Run it on a quiet machine: the rise depends on how the threads' allocations interleave, and a run beside
other work came out flat where the same run alone rose.
"""

from __future__ import annotations

import argparse
import ctypes
import threading
import time

from benchmarks.bench_soak import GLIBC_HEAP_ALIGN, kind_at, make_request
from worker import memory


def engine_requests(i: int, max_new_tokens: int) -> tuple[str, list]:
    """Request i of the soak's mix as the worker hands it to the engine (one engine request per completion);
    a cancel is sent as the plain request it would have cancelled."""
    from worker.transport.requests.dispatcher import to_engine_requests
    from worker.transport.requests.local_queue import QueuedRequest

    kind = kind_at(i, "mix")
    request = make_request(i, "plain" if kind == "cancel" else kind, max_new_tokens, "heap")
    now_ms = int(time.time() * 1000)
    queued = QueuedRequest(request=request, partition=0, offset=i, priority=1, attempt=0, timestamp_ms=now_ms,
                           deadline_ms=None, reply_topic="", num_prompt_tokens=0, engine_id=request.id)
    return kind, to_engine_requests(queued)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=5000, help="finals to wait for (an n = 2 request gives two)")
    p.add_argument("--in-flight", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=12)
    p.add_argument("--arena-max", type=int, default=128, help="WORKER_MALLOC_ARENA_MAX (the worker's default)")
    p.add_argument("--mmap-threshold", type=int, default=0, help="WORKER_MALLOC_MMAP_THRESHOLD_BYTES")
    p.add_argument("--numpy-huge-pages", action="store_true",
                   help="WORKER_NUMPY_HUGE_PAGES: numpy's huge-page advice left on, as numpy does by default")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--burst-every", type=int, default=0,
                   help="every this many finals, hold --burst-size requests in flight until that many more are sent "
                        "(a backlog, or a rebalance handing back what waited); 0: no bursts")
    p.add_argument("--burst-size", type=int, default=64)
    p.add_argument("--trim-at-print", action="store_true",
                   help="malloc_trim before each line, so it shows what the allocator cannot give back")
    p.add_argument("--malloc-info", default="", help="write glibc's malloc_info XML here at the end")
    args = p.parse_args()
    # Before any thread starts, as the worker does.
    memory.configure(args.arena_max, args.mmap_threshold, args.numpy_huge_pages)

    import torch

    from worker.model.settings import EngineSettings
    from worker.engine.engine import LLMEngine
    from worker.model.pull import ensure_default_model

    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineSettings(model=str(ensure_default_model()), device="cpu"))

    def trim_every_minute() -> None:
        while True:
            time.sleep(60)
            memory.trim()

    threading.Thread(target=trim_every_minute, daemon=True).start()
    # The worker steps its engine on a thread of its own, whose glibc arena and per-thread kernel caches are not
    # the main thread's, so this run does too.
    stepping = threading.Thread(target=run, args=(engine, args), name="engine")
    stepping.start()
    stepping.join()
    if args.malloc_info:  # before close: the heap as the run left it
        libc = ctypes.CDLL("libc.so.6")
        libc.fopen.restype = ctypes.c_void_p
        stream = ctypes.c_void_p(libc.fopen(args.malloc_info.encode(), b"w"))
        libc.malloc_info(0, stream)
        libc.fclose(stream)
    engine.close()


def own_arena() -> int | None:
    """The start of the calling thread's glibc arena (a heap aligned to its 64 MiB maximum), from where a small
    malloc of its lands; None on the main arena, which grows as the process's [heap]."""
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    probe = libc.malloc(64)
    libc.free(ctypes.c_void_p(probe))
    start = probe - probe % GLIBC_HEAP_ALIGN
    return start if any(begin == start for begin, _, _, _ in memory.mappings() or []) else None


def arena_resident(start: int | None) -> int:
    """Resident bytes of the arena starting at `start` (every mapping inside its 64 MiB range)."""
    if start is None:
        return 0
    return sum(rss for begin, _, rss, _ in memory.mappings() or [] if start <= begin < start + GLIBC_HEAP_ALIGN)


def run(engine, args: argparse.Namespace) -> None:
    """The run itself, on the thread that steps the engine, prepared as the worker's engine thread is."""
    engine.prepare_thread()
    arena = own_arena()
    sent = finals = schemas = in_flight = 0
    start = time.perf_counter()
    print(f"load average {open('/proc/loadavg').read().split()[:3]}", flush=True)
    burst_left, next_burst = 0, args.burst_every or None
    while finals < args.requests:
        if next_burst is not None and finals >= next_burst:
            burst_left, next_burst = args.burst_size, next_burst + args.burst_every
        while in_flight < (args.burst_size if burst_left else args.in_flight) and sent < args.requests:
            kind, requests = engine_requests(sent, args.max_new_tokens)
            sent += 1
            burst_left = max(0, burst_left - 1)
            schemas += kind == "schema"
            for request in requests:
                engine.add_request(request)
                in_flight += 1
        for output in engine.step():
            if output.finished:
                in_flight -= 1
                finals += 1
                if finals % args.every == 0:
                    if args.trim_at_print:
                        memory.trim()
                    heap = memory.native_heap()
                    print(f"{time.perf_counter() - start:6.0f} s  finals {finals:5d}  schemas {schemas:5d}  "
                          f"rss {memory.resident_bytes() / 2**20:7.1f} MiB  in use {heap.in_use_bytes / 2**20:6.1f}"
                          f"  free {heap.free_bytes / 2**20:6.1f}  anonymous "
                          f"{memory.resident_parts()['anon'] / 2**20:7.1f}  this thread's arena "
                          f"{arena_resident(arena) / 2**10:6.0f} KB", flush=True)
    print(f"{finals / (time.perf_counter() - start):.2f} finals/s; load average "
          f"{open('/proc/loadavg').read().split()[:3]}", flush=True)


if __name__ == "__main__":
    main()

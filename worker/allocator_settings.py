"""How a worker process's allocators behave (WORKER_MALLOC_*, WORKER_NUMPY_*): set once at its edge, before any
thread that would make an arena (worker/process.py), and read by worker/memory.py, which says why each exists.
Not the worker's logic: no part of the transport or the engine reads them. Every field carries a docstring:
docs/configuration.md is generated from them (`llm-worker config --markdown`)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class AllocatorSettings(BaseSettings):
    """glibc malloc's arenas, mmap threshold, thread cache and trimming, and numpy's allocator."""

    model_config = SettingsConfigDict(env_prefix="WORKER_", extra="ignore", use_attribute_docstrings=True)

    malloc_arena_max: int = Field(128, ge=0)
    """glibc malloc arenas the worker process may use, set at start (0: glibc's default, 8 per core). More than
    the threads a worker runs (about 15: the event loop, the engine, torch's and llguidance's pools, the
    grammar compile threads, the metrics server), so that no thread shares another's arena: glibc binds a
    thread to an arena at its first malloc and, past the cap, hands out the arenas in use in turn. With 8, a
    grammar compile thread shared the engine thread's arena, and the grammars it built, kept for minutes in the
    cache, pinned pages between the engine's per-step temporaries (docs/memory.md). An arena only holds what
    its threads allocate, and the free pages of each go back to the kernel every WORKER_MALLOC_TRIM_INTERVAL_S.
    """
    malloc_mmap_threshold_bytes: int = Field(4 * 1024**2, ge=0)
    """Blocks of this size and more get pages of their own, handed back to the kernel when freed (glibc's
    M_MMAP_THRESHOLD, set at start); 0: glibc's default, which rises to the size of every large block freed,
    so that a burst's multi-megabyte temporaries stay in the arenas as free heap. 4 MiB reaches the float32
    logits of steps with 22 rows and more (SmolLM2's vocabulary). It keeps a burst's largest temporaries out of
    the arenas. The cost is page faults on those steps: 10 % of throughput with
    120 requests at once on the CPU (17 % at 128 KiB); 0 and WORKER_MALLOC_ARENA_MAX=2 give it back
    (docs/memory.md)."""
    numpy_huge_pages: bool = False
    """Let numpy ask for transparent huge pages for its arrays of 4 MiB and more (its own default). Off: the
    advice stays on the address range after the array is freed, and where that range lies in a malloc arena
    the kernel keeps a whole 2 MiB page resident around any live block in it, a step in the resident size
    that `malloc_trim` cannot undo (docs/memory.md). Arrays that large are a step's temporaries on the CPU,
    faulted in 4 KiB pages without it."""
    malloc_tcache_count: int = Field(0, ge=-1)
    """Freed small blocks glibc keeps per size in each thread's cache (tcache; the tunable
    glibc.malloc.tcache_count), set when `serve` starts by running itself again with it in GLIBC_TUNABLES, unless
    that names it already; -1: glibc's default, 7. Off (0): the blocks a rebalance's burst freed in the part of
    the engine thread's arena it widened stay in that cache, each pinning a page `malloc_trim` cannot return:
    the soak's rebalance step was +840 KB with it, +4 KB without, at the same finals a second (docs/memory.md)."""
    numpy_buffer_cache: bool = False
    """Let numpy keep freed data buffers of under 1 KiB for reuse on the engine's thread (its own default). Off:
    numpy keeps seven of each size for good, and a burst's batch-sized arrays bring sizes the steady load never
    makes, carved from the arena while the burst has it widened: a step in the resident size that `malloc_trim`
    cannot undo (docs/memory.md). glibc's per-thread cache reuses small blocks as fast."""
    malloc_trim_interval_s: float = Field(60.0, ge=0)
    """How often free heap pages are handed back to the kernel (glibc malloc_trim, on a thread of its own: a
    trim walks every free hole, tens of milliseconds on a fragmented heap); 0 never."""

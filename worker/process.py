"""What a worker process sets up first, at its edge, before it runs anything of the worker: glibc's per-thread
cache of freed blocks (set by running the process again: glibc reads it only at start), the arena cap, the mmap
threshold and numpy's allocator (worker/memory.py says why each). None of it is the worker's logic, and all
of it must come before the threads that would each make an arena, so the CLI runs `prepare_serve` before it
imports `serve`, and an engine process runs `configure_allocator` before it builds its engine.
"""

from __future__ import annotations

from worker import memory
from worker.allocator_settings import AllocatorSettings


def configure_allocator(settings: AllocatorSettings) -> None:
    memory.configure(settings.malloc_arena_max, settings.malloc_mmap_threshold_bytes, settings.numpy_huge_pages,
                     settings.numpy_buffer_cache)


def prepare_serve() -> None:
    """`llm-worker serve`'s process, from the allocator settings of its environment (the command line sets none
    of these)."""
    settings = AllocatorSettings()
    memory.restart_with_tcache_count(settings.malloc_tcache_count)  # returns where there is nothing to change
    configure_allocator(settings)

"""The process's memory: how glibc's allocator is set up, what it holds, and the Python heap (docs/memory.md).

Why the allocator needs settings: glibc malloc binds each thread to an arena at its first malloc (a new one
while fewer than the cap exist, else the arenas in use in turn), and memory freed into an arena stays there
for that arena's reuse. A worker allocates from about 15 threads: the event loop, the engine
thread, torch's and llguidance's pools, the grammar compile threads (which live as long as the worker), the
metrics server's. A compiled grammar is built on a compile thread and kept for minutes in the engine's cache;
when a compile thread shared the engine thread's arena (8 arenas for 15 threads), the grammars pinned pages
between the engine's per-step temporaries, and the soak grew by megabytes. So the worker sets the cap above
the threads it runs (`WORKER_MALLOC_ARENA_MAX`, 128: an arena each), fixes the mmap threshold
(`WORKER_MALLOC_MMAP_THRESHOLD_BYTES`, 4 MiB: a burst's largest temporaries get pages of their own), and hands
free pages back to the kernel now and then (`malloc_trim`, every `WORKER_MALLOC_TRIM_INTERVAL_S`). It also
stops numpy's huge-page advice, which pins whole 2 MiB pages in the arenas (`numpy_huge_pages`),
numpy's cache of small freed buffers on the threads that step the engine (`numpy_buffer_cache`), and
glibc's own per-thread cache of freed small blocks, which `malloc_trim` cannot reach
(`restart_with_tcache_count`: glibc reads that setting only at start, so the process runs itself again).

Pure ctypes on the C library the process already has: on a libc without these calls (musl, macOS) every
function here answers None or False and changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

M_ARENA_MAX = -8
"""mallopt's parameter number for the arena cap (glibc malloc.h)."""
M_MMAP_THRESHOLD = -3
"""mallopt's parameter number for the size from which a block gets pages of its own (glibc malloc.h)."""


class _Mallinfo2(ctypes.Structure):
    # glibc >= 2.33: every field a size_t (the older mallinfo's ints wrap past 2 GiB).
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


@dataclass(frozen=True, slots=True)
class NativeHeap:
    """What glibc malloc holds, over every arena."""

    in_use_bytes: int
    """Allocated and not freed: small blocks in the arenas plus blocks mmapped on their own."""
    free_bytes: int
    """Freed into the arenas and kept there (reused by later allocations; `trim` returns whole pages of it)."""


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "mallopt"):  # not glibc
        return None
    return libc


def limit_arenas(max_arenas: int) -> bool:
    """Cap glibc's malloc arenas at `max_arenas` (arenas made before the call stay): call it before threads
    start. 0 leaves glibc's default. True when the cap was set."""
    libc = _libc()
    if libc is None or max_arenas <= 0:
        return False
    return bool(libc.mallopt(M_ARENA_MAX, max_arenas))


def fix_mmap_threshold(threshold_bytes: int) -> bool:
    """Blocks of `threshold_bytes` and more get pages of their own, returned to the kernel when freed; 0 leaves
    glibc's default. Why fix it: glibc's threshold starts at 128 KiB and rises to the size of each mmapped block
    freed (up to 32 MiB), so once torch frees a step's multi-megabyte logits, every later block up to that size
    is carved from the arenas, between long-lived ones; the holes they leave are kept as free heap that
    `malloc_trim` cannot return while a live block shares their pages. Setting it also stops the rise. True
    when it was set."""
    libc = _libc()
    if libc is None or threshold_bytes <= 0:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold_bytes))


NUMPY_HUGE_PAGES_ENV = "NUMPY_MADVISE_HUGEPAGE"
"""numpy reads it when it is imported: 0 stops its huge-page advice (numpy/__init__.py, hugepage_setup)."""


def numpy_huge_pages(enabled: bool) -> None:
    """Whether numpy advises the kernel to back its arrays of 4 MiB and more with transparent huge pages
    (madvise MADV_HUGEPAGE), in this process and in the processes it starts later.

    Why a worker turns it off: the advice marks the pages of the address range, not of the array, and stays on
    the range after the array is freed. An array carved from an arena's free heap (after a burst of large steps
    left a free chunk that large) marks part of that arena for good. The kernel then backs it with whole 2 MiB
    pages (a first touch of an empty 2 MiB range faults in all of it; khugepaged collapses a range with any page
    in use into one), resident around any live block, and `malloc_trim` cannot hand them back:
    a 2 MB step in the resident size after a burst, there until a later burst frees the whole range. Arrays
    that get pages of their own are unmapped when freed, and the advice goes with them."""
    os.environ[NUMPY_HUGE_PAGES_ENV] = "1" if enabled else "0"
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):  # numpy 2, numpy 1; imported already
        switch = getattr(sys.modules.get(name), "_set_madvise_hugepage", None)
        if switch is not None:
            switch(enabled)
            return


GLIBC_TUNABLES_ENV = "GLIBC_TUNABLES"
TCACHE_COUNT_TUNABLE = "glibc.malloc.tcache_count"


def tunables_with_tcache_count(current: str | None, count: int) -> str | None:
    """The GLIBC_TUNABLES value that also sets glibc's per-thread cache to `count` blocks a size; None where
    there is nothing to change: `count` below 0 (glibc's default, 7), or `current` names the tunable already
    (an operator's choice stands)."""
    if count < 0:
        return None
    parts = [part for part in (current or "").split(":") if part]
    if any(part.split("=", 1)[0] == TCACHE_COUNT_TUNABLE for part in parts):
        return None
    return ":".join([*parts, f"{TCACHE_COUNT_TUNABLE}={count}"])


def restart_with_tcache_count(count: int) -> None:
    """Run this process again from the start (same pid, same arguments) with glibc's per-thread cache of freed
    small blocks (tcache) set to `count` blocks a size, unless it is set already; glibc reads its tunables
    only when a process starts. Call it first thing: whatever the process did before is lost.

    Why a worker turns the cache off: each thread keeps up to seven freed blocks of every size class to
    1 KiB for its own next malloc of that class, and `malloc_trim` does not touch them. After a rebalance's
    burst the engine thread's cache holds blocks freed in the part of its arena the burst widened, and a
    class the steady load rarely allocates keeps them there for good, each pinning a page: 27 of the 74 pages
    a burst left in the engine alone held nothing else, and a 30-minute soak's rebalance step went from
    +840 KB to +4 KB without the cache (docs/memory.md). Small blocks then come from glibc's fast bins of
    the thread's own arena, behind its uncontended lock."""
    if _libc() is None:
        return
    value = tunables_with_tcache_count(os.environ.get(GLIBC_TUNABLES_ENV), count)
    if value is None:
        return
    os.environ[GLIBC_TUNABLES_ENV] = value
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.execv(sys.executable, sys.orig_argv)


class _DataMemAllocator(ctypes.Structure):
    # numpy's PyDataMemAllocator (ndarraytypes.h): free takes the block's size as a third argument.
    _fields_ = [(name, ctypes.c_void_p) for name in ("ctx", "malloc", "calloc", "realloc", "free")]


class _DataMemHandler(ctypes.Structure):
    # numpy's PyDataMem_Handler, version 1.
    _fields_ = [("name", ctypes.c_char * 127), ("version", ctypes.c_uint8), ("allocator", _DataMemAllocator)]


class _PyMemAllocatorEx(ctypes.Structure):
    # CPython's PyMemAllocatorEx: the same calls as numpy's, free without the size.
    _fields_ = [(name, ctypes.c_void_p) for name in ("ctx", "malloc", "calloc", "realloc", "free")]


NUMPY_UNCACHED_HANDLER = "llm_worker_uncached"
"""The name numpy reports (numpy's `get_handler_name`) for arrays allocated while its buffer cache is off."""
_PYMEM_DOMAIN_RAW = 0
_ARRAY_API_SET_HANDLER = 304
"""PyDataMem_SetHandler's slot in numpy's C API table (__multiarray_api.h, numpy >= 1.22)."""
_MEM_HANDLER_CAPSULE_NAME = b"mem_handler"


@functools.cache
def _numpy_uncached_handler() -> tuple[object, ctypes.Structure, Callable[[object], object]] | None:
    """A numpy data handler (NEP 49) that calls CPython's raw allocator, malloc, for every buffer: the capsule
    numpy takes, the struct it points to (kept alive with it) and numpy's PyDataMem_SetHandler. None without
    numpy >= 1.22 or glibc."""
    if _libc() is None:
        return None
    try:
        import numpy._core._multiarray_umath as umath  # numpy 2
    except ImportError:
        try:
            import numpy.core._multiarray_umath as umath  # numpy 1
        except ImportError:
            return None
    api_capsule = getattr(umath, "_ARRAY_API", None)
    if api_capsule is None:
        return None
    api = ctypes.PyDLL(None)  # CPython's C API with the GIL held, its functions' types set here only
    api.PyCapsule_GetName.restype = ctypes.c_char_p
    api.PyCapsule_GetName.argtypes = [ctypes.py_object]
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_New.restype = ctypes.py_object
    api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    table = api.PyCapsule_GetPointer(api_capsule, api.PyCapsule_GetName(api_capsule))
    raw = _PyMemAllocatorEx()
    api.PyMem_GetAllocator(_PYMEM_DOMAIN_RAW, ctypes.byref(raw))
    # numpy passes free a third argument (the size); CPython's raw free takes two, and the C calling
    # conventions let a callee ignore trailing arguments.
    handler = _DataMemHandler(NUMPY_UNCACHED_HANDLER.encode(), 1,
                              _DataMemAllocator(raw.ctx, raw.malloc, raw.calloc, raw.realloc, raw.free))
    capsule = api.PyCapsule_New(ctypes.addressof(handler), _MEM_HANDLER_CAPSULE_NAME, None)
    set_handler = ctypes.cast(ctypes.c_void_p.from_address(table + _ARRAY_API_SET_HANDLER * ctypes.sizeof(
        ctypes.c_void_p)).value, ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.py_object))
    return (capsule, handler, set_handler)


def numpy_buffer_cache(enabled: bool) -> bool:
    """Whether numpy keeps freed data buffers of under 1 KiB for reuse (its default) in the calling thread's
    context; True when the choice was applied. numpy's handler is a context variable, so each thread that
    makes arrays sets it for itself (`prepare_thread`).

    Why a worker turns it off on the engine's thread: numpy keeps up to seven freed buffers of each size under
    1 KiB, for good, in a table of its own. A step's small arrays (a row's token ids, positions, a few
    floats per request) are sized by the batch, so a rebalance's burst, the batch at 64 rows, brings sizes the
    steady load never makes: each size's seven buffers were carved from the arena while the burst had it
    widened and stay there, spread over its pages, a step in the resident size that `malloc_trim` cannot
    return (140 KB of them over the engine thread's arena after one burst). Without the cache every buffer goes
    back to malloc when freed, and glibc's own per-thread cache (tcache) reuses small blocks just as fast."""
    if enabled:
        return False  # numpy's default, which a thread has until it sets another handler
    built = _numpy_uncached_handler()
    if built is None:
        return False
    capsule, _handler, set_handler = built
    set_handler(capsule)
    return True


_numpy_cache_choice: bool | None = None
"""What `configure` chose for numpy's buffer cache, which each thread applies for itself (`prepare_thread`)."""


def configure(arena_max: int, mmap_threshold_bytes: int, huge_pages: bool, numpy_cache: bool = True) -> None:
    """The allocator as a worker sets it up (the settings WORKER_MALLOC_ARENA_MAX,
    WORKER_MALLOC_MMAP_THRESHOLD_BYTES, WORKER_NUMPY_HUGE_PAGES, WORKER_NUMPY_BUFFER_CACHE): call it before
    threads start, in each process that runs an engine, since mallopt's settings belong to the process that
    makes the call. numpy's buffer cache is a per-thread choice: the calling thread's now, each engine thread's
    when it calls `prepare_thread`."""
    limit_arenas(arena_max)
    fix_mmap_threshold(mmap_threshold_bytes)
    numpy_huge_pages(huge_pages)
    global _numpy_cache_choice
    _numpy_cache_choice = numpy_cache
    prepare_thread()


def prepare_thread() -> None:
    """Apply to the calling thread what `configure` chose per thread (numpy's buffer cache); nothing in a
    process that never called `configure`."""
    if _numpy_cache_choice is not None:
        numpy_buffer_cache(_numpy_cache_choice)


def trim_every(interval_s: float) -> threading.Thread | None:
    """A daemon thread that calls `trim` every `interval_s` seconds for the life of the process (for a process
    with no event loop of its own, such as the engine's); None for 0."""
    if interval_s <= 0:
        return None

    def run() -> None:
        while True:
            time.sleep(interval_s)
            trim()

    thread = threading.Thread(target=run, name="malloc-trim", daemon=True)
    thread.start()
    return thread


def trim() -> bool:
    """Return the free pages of every arena to the kernel (glibc's malloc_trim); True when any was."""
    libc = _libc()
    if libc is None or not hasattr(libc, "malloc_trim"):
        return False
    return bool(libc.malloc_trim(0))


def freeze_startup_objects() -> None:
    """Move everything built so far (model, tokenizer tables, modules) out of the garbage collector's sight, as
    vLLM's engine does after start-up: otherwise each full collection walks those objects again, a pause of
    about a millisecond in whichever engine step it lands (the host-path benchmark's scheduler update at 256
    running: 1.12 ms a step on average with such pauses, 0.40 ms without).

    The collection after the freeze matters as much. CPython starts a full collection only once the objects
    promoted since the last one pass a quarter of those that survived it, and the count it keeps is the one
    before the freeze: with a million start-up objects frozen, the first full collection would wait for about
    250,000 promoted objects, and the garbage cycles among them (a request's state, a rebalance's) would stay
    allocated until then. A full collection now, over the few objects left in the generations, sets that count
    to what is actually there."""
    gc.collect()
    gc.freeze()
    gc.collect()


def native_heap() -> NativeHeap | None:
    """glibc's own account of its heap (mallinfo2); None where it has none."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return NativeHeap(in_use_bytes=info.uordblks + info.hblkhd, free_bytes=info.fordblks)


def python_allocated_blocks() -> int:
    """Python objects' memory blocks allocated now (sys.getallocatedblocks: a counter, no walk of the heap)."""
    return sys.getallocatedblocks()


def resident_parts(pid: int | None = None) -> dict[str, int] | None:
    """A process's resident set by kind, bytes: "anon" (its heaps and mappings of no file: what a leak grows),
    "file" (pages of the libraries and files it maps, faulted in as code paths first run; the kernel may
    drop them) and "shmem"; None where /proc has no answer."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as status:
            fields = dict(line.split(":", 1) for line in status if line.startswith("Rss"))
        return {name.removeprefix("Rss").lower(): int(value.split()[0]) * 1024 for name, value in fields.items()}
    except (OSError, ValueError):
        return None


def mappings(pid: int | None = None) -> list[tuple[int, int, int, str]] | None:
    """A process's memory mappings from /proc/<pid>/smaps: (start address, size, resident, name) in bytes,
    name "" for an anonymous mapping; None where /proc has no answer. Reads every mapping's page counts (a few
    milliseconds for a worker's thousand): for a benchmark's occasional look at which mapping grew, not for
    every scrape."""
    out: list[tuple[int, int, int, str]] = []
    try:
        with open(f"/proc/{pid or 'self'}/smaps") as smaps:
            for line in smaps:
                head, _, rest = line.partition(" ")
                if "-" in head and not head.endswith(":"):
                    start, end = (int(x, 16) for x in head.split("-"))
                    fields = rest.split(None, 4)  # perms, offset, device, inode, then the name if any
                    name = fields[4].strip() if len(fields) > 4 else ""
                    out.append((start, end - start, 0, name))
                elif head == "Rss:" and out:
                    start, size, _, name = out[-1]
                    out[-1] = (start, size, int(rest.split()[0]) * 1024, name)
    except (OSError, ValueError, IndexError):
        return None
    return out


def resident_bytes(pid: int | None = None) -> int | None:
    """Resident set size of a process (this one by default), from /proc; None where /proc has no answer."""
    try:
        with open(f"/proc/{pid or 'self'}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None

"""worker/memory.py on this machine's glibc: the allocator's account follows what is allocated and freed,
trimming hands free pages back, and the arena cap is accepted."""

from __future__ import annotations

import ctypes
import os

import pytest

from worker import memory

pytestmark = pytest.mark.skipif(memory.native_heap() is None, reason="needs glibc >= 2.33 (mallinfo2)")

MB = 2**20


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as mode:
            return mode.read()
    except OSError:
        return "[never]"


def test_the_native_heap_counts_a_block_while_it_is_held_and_not_after():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before = memory.native_heap().in_use_bytes
    block = libc.malloc(64 * MB)
    try:
        assert memory.native_heap().in_use_bytes - before >= 64 * MB
    finally:
        libc.free(block)
    assert memory.native_heap().in_use_bytes - before < 8 * MB


def test_trim_gives_freed_small_blocks_back_to_the_kernel():
    # Many small blocks live in the arena (not mmapped one by one): freeing them leaves free memory in the arena
    # that only a trim returns.
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(4096) for _ in range(20_000)]  # ~80 MB in 4 KB blocks
    for block in blocks[:-1]:  # the last one pins the top of the heap, so free() alone cannot shrink it
        libc.free(block)
    try:
        held = memory.native_heap().free_bytes
        assert held >= 60 * MB
        rss_before = memory.resident_bytes()
        assert memory.trim()
        assert memory.resident_bytes() < rss_before - 40 * MB
    finally:
        libc.free(blocks[-1])


def test_the_arena_cap_is_accepted_and_zero_leaves_the_default():
    assert memory.limit_arenas(0) is False
    assert memory.limit_arenas(8) is True


_AS_SERVE_DOES = """
from worker import memory
from worker.allocator_settings import AllocatorSettings
memory.limit_arenas(AllocatorSettings().malloc_arena_max)  # as serve() does, before any thread
"""

_AS_THE_ENGINE_PROCESS_DOES = """
import threading
from worker.model.settings import EngineSettings
from worker.allocator_settings import AllocatorSettings
from worker.serve import build_engine_process
build_engine_process(AllocatorSettings(malloc_trim_interval_s=0.05), "instant", EngineSettings(max_num_seqs=2), 0.0)
assert any(t.name == "malloc-trim" and t.is_alive() for t in threading.enumerate())
import os
assert os.environ["NUMPY_MADVISE_HUGEPAGE"] == "0"
"""

_ARENAS_OF_THREADS = """
import ctypes, sys, threading
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def arena():
    # A thread's first malloc binds it to an arena; a non-main arena's heaps are 64 MiB-aligned, and the main
    # arena's lie in the program's brk heap, far from them.
    block = libc.malloc(64)
    libc.free(block)
    return block & ~(64 * 2**20 - 1)

count = int(sys.argv[1])
arenas, all_in = [arena()], threading.Barrier(count + 1)

def run():
    arenas.append(arena())
    all_in.wait()  # alive until all have allocated: a thread that ends hands its arena to the next one

threads = [threading.Thread(target=run) for _ in range(count)]
for t in threads:
    t.start()
all_in.wait()
print(len(set(arenas)))
"""


def test_each_thread_of_a_worker_gets_an_arena_of_its_own_at_the_default_cap():
    # A worker runs about 15 threads on 2 cores (the event loop, the engine, torch's and llguidance's pools, the
    # grammar compile threads, the metrics server), more with more cores. Past the cap glibc hands out the
    # arenas in use in turn, and a grammar compile thread that shared the engine thread's arena left grammars
    # between the engine's per-step temporaries: 40 threads and the main one, each in an arena of its own.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _AS_SERVE_DOES + _ARENAS_OF_THREADS, "40"], capture_output=True,
                         text=True, check=True, timeout=60)
    assert int(out.stdout) == 41


@pytest.mark.slow
def test_an_engine_process_sets_up_its_own_allocator_as_the_worker_does():
    # mallopt's settings belong to the process that calls it: an engine in a process of its own
    # (WORKER_ENGINE_PROCESS) allocates the engine's native memory, so it needs them too, and a trim of its own.
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _AS_THE_ENGINE_PROCESS_DOES + _ARENAS_OF_THREADS, "40"],
                         capture_output=True, text=True, check=True, timeout=60)
    assert int(out.stdout) == 41


def test_resident_size_and_python_blocks_are_read():
    assert memory.resident_bytes() > 10 * MB
    assert memory.resident_bytes(999_999_999) is None
    before = memory.python_allocated_blocks()
    kept = [object() for _ in range(10_000)]
    assert memory.python_allocated_blocks() - before >= 9_000
    del kept


def test_resident_parts_tell_heap_pages_from_file_pages():
    before = memory.resident_parts()
    held = bytearray(64 * MB)  # zero pages until written
    held[::4096] = b"x" * len(held[::4096])
    after = memory.resident_parts()
    assert after["anon"] - before["anon"] >= 60 * MB
    assert abs(after["file"] - before["file"]) < 8 * MB
    assert memory.resident_parts(999_999_999) is None
    del held


_HOLES = """
import ctypes, sys
from worker import memory
if sys.argv[1] == "fixed":
    assert memory.fix_mmap_threshold(128 * 1024)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(8 << 20))  # a step's logits, freed: glibc's own threshold rises to 8 MB
pairs = [(libc.malloc(1 << 20), libc.malloc(64 << 10)) for _ in range(40)]  # 1 MB temporaries between live blocks
for big, _ in pairs:
    libc.free(big)
memory.trim()
print(memory.native_heap().free_bytes)
"""


@pytest.mark.parametrize("mode", ["dynamic", "fixed"])
def test_a_fixed_mmap_threshold_keeps_freed_temporaries_out_of_the_heap(mode):
    """Megabyte temporaries freed between small live blocks: with glibc's rising threshold they are carved from
    the arena and stay there as free heap; with the threshold fixed they have pages of their own, returned
    when freed."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HOLES, mode], capture_output=True, text=True, check=True)
    kept = int(out.stdout.split()[-1])
    assert (kept > 30 * MB) == (mode == "dynamic"), kept


@pytest.mark.slow
def test_the_workers_tokenizer_keeps_no_word_cache(smollm2_path):
    """Prompts that each carry a new word (an id, a number): the tokenizer as transformers loads it keeps
    every such word until its cache holds 10,000 (native memory, held for good); the worker's keeps none."""
    from transformers import AutoTokenizer

    from worker.model.config import load_tokenizer

    growth, tokens = {}, {}
    for name, tokenizer in (("default", AutoTokenizer.from_pretrained(smollm2_path)),
                            ("worker", load_tokenizer(smollm2_path))):
        tokenizer.encode("warm up the tokenizer's own buffers")
        before = memory.native_heap().in_use_bytes
        tokens[name] = [tokenizer.encode(f"Write one short sentence about the sea, reference Q{i}x{i * 7}.")
                        for i in range(3000)]
        growth[name] = (memory.native_heap().in_use_bytes - before) / 2**20
    assert tokens["worker"] == tokens["default"]  # the same tokens, only not remembered
    assert growth["worker"] < 0.1, growth
    assert growth["default"] > 0.4, growth


_ADVISED = """
import sys
from worker import memory
memory.fix_mmap_threshold(64 << 20)  # the array is carved from the heap, as one is from a burst's free chunk
if sys.argv[1] == "off":
    memory.numpy_huge_pages(False)
import numpy as np
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
array = np.ones(8 << 20, dtype=np.uint8)
start = array.ctypes.data + 4096  # numpy advises the whole pages inside the array
live = libc.malloc(16 << 20)  # a live block above it (too large for any hole): the heap cannot shrink over it
del array
memory.trim()
advised = False
with open("/proc/self/smaps") as smaps:
    for line in smaps:
        head = line.split(" ", 1)[0]
        if "-" in head and not head.endswith(":"):
            low, high = (int(x, 16) for x in head.split("-"))
            inside = low <= start < high
        elif head == "VmFlags:" and inside:
            advised = " hg" in line
print(advised)
"""


@pytest.mark.skipif("[never]" in _thp_mode(), reason="the kernel has no transparent huge pages")
@pytest.mark.parametrize("mode", ["numpy's default", "off"])
def test_a_freed_numpy_array_leaves_its_heap_range_advised_for_huge_pages_unless_turned_off(mode):
    """numpy advises huge pages for arrays of 4 MiB and more; the advice is on the address range and outlives
    the array, so a heap range it once lay in stays marked, and the kernel keeps whole 2 MiB pages there. The
    worker turns the advice off (WORKER_NUMPY_HUGE_PAGES)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ADVISED, "off" if mode == "off" else "on"], capture_output=True,
                         text=True, check=True, timeout=60)
    assert out.stdout.split()[-1] == ("False" if mode == "off" else "True")


_SMALL_BUFFERS_KEPT = """
import sys, threading
from worker import memory
import numpy as np

def churn():
    if sys.argv[1] == "off":
        assert memory.numpy_buffer_cache(False)
    before = memory.native_heap().in_use_bytes
    for _ in range(3):
        # numpy keeps up to seven freed buffers of each size under 1 KiB: seven live at once of every size a
        # batch of 1 to 127 int64 rows takes, then all freed.
        arrays = [np.zeros(rows, dtype=np.int64) for rows in range(1, 128) for _ in range(7)]
        del arrays
    kept.append(memory.native_heap().in_use_bytes - before)

kept = []
thread = threading.Thread(target=churn)  # numpy's handler is per thread, as the engine's is
thread.start()
thread.join()
print(kept[0])
"""


@pytest.mark.parametrize("mode", ["numpy's default", "off"])
def test_numpy_keeps_no_freed_small_buffers_on_a_thread_that_turned_its_cache_off(mode):
    """numpy's default handler keeps freed data buffers of under 1 KiB, seven of each size, for good: a burst's
    batch-sized arrays leave theirs spread over the engine thread's arena (docs/memory.md). With the cache off
    (WORKER_NUMPY_BUFFER_CACHE) every buffer goes back to malloc."""
    import subprocess
    import sys

    # glibc's own per-thread cache of freed small blocks (tcache, which counts as in use) left out of the count
    env = dict(os.environ, GLIBC_TUNABLES="glibc.malloc.tcache_count=0")
    out = subprocess.run([sys.executable, "-c", _SMALL_BUFFERS_KEPT, "off" if mode == "off" else "on"],
                         capture_output=True, text=True, check=True, timeout=60, env=env)
    kept = int(out.stdout.split()[-1])
    if mode == "off":
        assert kept < 32 * 1024, kept
    else:
        assert kept > 7 * 100 * 512, kept  # seven of each size, 8 to 1,016 bytes (about 450 KB)


_ENGINE_THREAD_HANDLER = """
import asyncio, threading
from worker import memory
from worker.engine.instant import InstantEngine
from worker.transport.requests.engine_thread import EngineThread
import numpy as np

memory.configure(0, 0, False, numpy_cache=False)  # as serve() does, the allocator's caps left alone
seen = []

class Recording(InstantEngine):
    def prepare_thread(self):
        seen.append((threading.current_thread().name, np._core.multiarray.get_handler_name()))

async def main():
    thread = EngineThread(Recording(max_num_seqs=2, step_time_s=0.0), asyncio.get_running_loop(), asyncio.Queue())
    thread.start()
    await asyncio.sleep(0.2)
    thread.stop()

asyncio.run(main())
print(seen, np._core.multiarray.get_handler_name())
"""


def test_the_engine_thread_and_the_configuring_thread_make_arrays_without_numpys_cache():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _ENGINE_THREAD_HANDLER], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.split("\n")[0] == (f"[('engine', '{memory.NUMPY_UNCACHED_HANDLER}')] "
                                         f"{memory.NUMPY_UNCACHED_HANDLER}"), out.stdout + out.stderr


def test_the_tcache_tunable_is_added_unless_glibcs_default_is_asked_or_an_operator_set_it():
    assert memory.tunables_with_tcache_count(None, 0) == "glibc.malloc.tcache_count=0"
    assert memory.tunables_with_tcache_count("glibc.malloc.trim_threshold=0", 0) == (
        "glibc.malloc.trim_threshold=0:glibc.malloc.tcache_count=0")
    assert memory.tunables_with_tcache_count("glibc.malloc.tcache_count=3", 0) is None
    assert memory.tunables_with_tcache_count(None, -1) is None


_FREED_SMALL_BLOCKS_HELD = """
import ctypes, os, sys, threading
from worker import memory
memory.restart_with_tcache_count(int(sys.argv[1]))  # runs this script again once, the tunable set
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def churn():
    before = memory.native_heap().in_use_bytes
    blocks = [libc.malloc(size) for size in range(16, 1024, 16) for _ in range(7)]
    for block in blocks:
        libc.free(block)
    held.append(memory.native_heap().in_use_bytes - before)

held = []
thread = threading.Thread(target=churn)
thread.start()
thread.join()
print(os.environ.get("GLIBC_TUNABLES"), os.getpid(), held[0])
"""


@pytest.mark.parametrize("count", [-1, 0])
def test_a_restart_with_the_tcache_off_keeps_no_freed_small_blocks_for_the_thread(count):
    """glibc's per-thread cache keeps seven freed blocks of each small size for the thread's next malloc of it,
    out of `malloc_trim`'s reach; glibc reads its tunables only at start, so the worker runs itself again with
    the cache off (WORKER_MALLOC_TCACHE_COUNT), same pid."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    proc = subprocess.Popen([sys.executable, "-c", _FREED_SMALL_BLOCKS_HELD, str(count)], stdout=subprocess.PIPE,
                            text=True, env=env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    tunables, pid, held = out.split()
    assert int(pid) == proc.pid
    if count == 0:
        assert tunables == "glibc.malloc.tcache_count=0"
        assert int(held) < 16 * 1024, held
    else:
        assert tunables == "None"
        assert int(held) > 7 * 60 * 256, held  # seven of each class, 16 to 1,008 bytes (about 230 KB)


@pytest.mark.slow  # a few seconds: the CLI imports pydantic and the worker before the broker check
def test_llm_worker_serve_runs_with_the_tcache_off_from_its_first_thread(tmp_path):
    """The CLI sets the worker's process up before it imports `serve` (worker/process.py): the process that
    then serves has glibc's tunable in its environment, same pid, whatever it goes on to do (here it waits
    for a broker that is not there)."""
    import socket
    import subprocess
    import sys
    import time
    from pathlib import Path

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("WORKER_")}
    proc = subprocess.Popen([sys.executable, "-m", "worker.cli", "serve", "--engine", "instant", "--bootstrap",
                             f"127.0.0.1:{port}"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=tmp_path)
    try:
        environ = b""
        deadline = time.monotonic() + 30
        while b"GLIBC_TUNABLES" not in environ and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
            environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert b"GLIBC_TUNABLES=glibc.malloc.tcache_count=0" in environ.split(b"\0")
    finally:
        proc.kill()
        proc.wait()

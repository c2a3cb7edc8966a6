"""Native heap growth by library, over time, from a heaptrack recording of a worker (docs/memory.md).

tracemalloc sees Python's allocations; glibc's `mallinfo2` sees every native one but not who made it.
heaptrack (a Debian package) records each malloc and free with its call stack. This reads its recording
(`heaptrack.*.zst`, a text stream) and prints, at each of the given times, the bytes that are live then and
were not live at the first time, summed by the library that asked for them (the first frame outside libc,
the C++ runtime and heaptrack; Python's own allocations count as `python`), and the call stacks that grew
most. A leak shows as a library whose column keeps rising; a bounded cache rises and then levels, and what
is in flight (a step's tensors, a grammar being compiled) comes and goes between columns.

    .venv/bin/python -m benchmarks.bench_soak --minutes 16 --rate 4 --kind mix --no-rebalance \
        --warmup-minutes 4 --worker-wrapper "heaptrack -o /tmp/worker-heap" --label heaptrack
    .venv/bin/python -m benchmarks.probes.heaptrack_growth /tmp/worker-heap.zst --from 330 --every 120 --to 930

Times are seconds since the worker's process started. Under heaptrack the worker runs about half as fast,
and heaptrack's own bookkeeping lives in glibc's heap, so the soak's glibc figures are not the worker's then.
Frees are matched to allocations by (size, stack), which is what heaptrack's format records; so the figures
are exact per stack, not per block.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
from dataclasses import dataclass, field

RUNTIME = {"libc.so.6", "libheaptrack_preload.so", "ld-linux-x86-64.so.2", "libstdc++.so.6"}
"""Libraries that allocate for others: the owner is the first frame outside them."""


@dataclass
class Recording:
    strings: list[str | None] = field(default_factory=lambda: [None])
    ips: list[list[int] | None] = field(default_factory=lambda: [None])
    """instruction pointer index -> [module string, function string, file string, line, ...]"""
    traces: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])
    """trace index -> (instruction pointer index, parent trace index)"""
    infos: list[tuple[int, int]] = field(default_factory=list)
    """allocation info index -> (size, trace index)"""
    snapshots: list[tuple[float, collections.Counter]] = field(default_factory=list)
    """(time, allocation info index -> live blocks gained since the first time)"""
    ended_at: float = 0.0

    def module(self, ip: int) -> str:
        name = self.strings[self.ips[ip][0]] or "?"
        return name.rsplit("/", 1)[-1]

    def owner(self, trace: int) -> str:
        while trace:
            ip, parent = self.traces[trace]
            module = self.module(ip)
            if module not in RUNTIME:
                return "python" if module.startswith("libpython") else module
            trace = parent
        return "?"

    def frames(self, trace: int, depth: int) -> list[str]:
        out = []
        while trace and len(out) < depth:
            ip, parent = self.traces[trace]
            fields = self.ips[ip]
            function = self.strings[fields[1]] if len(fields) > 1 else "?"
            out.append(f"{(function or '?')[:100]} [{self.module(ip)}]")
            trace = parent
        return out


def read(path: str, times: list[float]) -> Recording:
    """One pass over the recording, keeping a copy of the net counts at each time after the first."""
    rec = Recording()
    net: collections.Counter = collections.Counter()
    started, pending = False, list(times)
    with subprocess.Popen(["zstdcat", path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                          bufsize=1 << 20) as proc:
        for line in proc.stdout:
            kind = line[:1]
            if kind == b"+":
                if started:
                    net[int(line[2:], 16)] += 1
            elif kind == b"-":
                if started:
                    net[int(line[2:], 16)] -= 1
            elif kind == b"c":
                rec.ended_at = int(line[2:], 16) / 1000.0
                while pending and rec.ended_at >= pending[0]:
                    if started:
                        rec.snapshots.append((pending[0], collections.Counter(net)))
                    started = True
                    pending.pop(0)
                if not pending:
                    proc.kill()
                    break
            elif kind == b"a":
                size, trace = line[2:].split()
                rec.infos.append((int(size, 16), int(trace, 16)))
            elif kind == b"t":
                ip, parent = line[2:].split()
                rec.traces.append((int(ip, 16), int(parent, 16)))
            elif kind == b"i":
                rec.ips.append([int(x, 16) for x in line[2:].split()[1:]])
            elif kind == b"s":
                rec.strings.append(line[2:].decode(errors="replace").rstrip("\n").split(" ", 1)[1])
    return rec


def report(rec: Recording, top_modules: int, top_stacks: int, depth: int) -> None:
    if not rec.snapshots:
        sys.exit(f"the recording ends at {rec.ended_at:.0f} s, before the second time")
    owners: dict[int, str] = {}
    columns = []
    for _, net in rec.snapshots:
        by_module: collections.Counter = collections.Counter()
        for info, blocks in net.items():
            size, trace = rec.infos[info]
            if trace not in owners:
                owners[trace] = rec.owner(trace)
            by_module[owners[trace]] += blocks * size
        columns.append(by_module)
    largest: collections.Counter = collections.Counter()
    for by_module in columns:
        for module, grown in by_module.items():
            largest[module] = max(largest[module], abs(grown))
    print("KB live beyond the first time, by library")
    print("library".ljust(44) + "".join(f"{t:>10.0f}s" for t, _ in rec.snapshots))
    for module, _ in largest.most_common(top_modules):
        print(module[:44].ljust(44) + "".join(f"{c[module] / 1e3:11.1f}" for c in columns))
    print("all".ljust(44) + "".join(f"{sum(c.values()) / 1e3:11.1f}" for c in columns))
    by_trace: collections.Counter = collections.Counter()
    for info, blocks in rec.snapshots[-1][1].items():
        size, trace = rec.infos[info]
        by_trace[trace] += blocks * size
    print(f"\nthe stacks that grew most by {rec.snapshots[-1][0]:.0f} s")
    for trace, grown in by_trace.most_common(top_stacks):
        print(f"\n{grown / 1e3:10.1f} KB")
        for frame in rec.frames(trace, depth):
            print("    " + frame)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recording", help="heaptrack's output, *.zst")
    p.add_argument("--from", dest="start", type=float, required=True, help="seconds since the process started")
    p.add_argument("--every", type=float, required=True)
    p.add_argument("--to", type=float, required=True)
    p.add_argument("--modules", type=int, default=12)
    p.add_argument("--stacks", type=int, default=5)
    p.add_argument("--depth", type=int, default=12)
    args = p.parse_args()
    times, t = [], args.start
    while t <= args.to + 1e-9:
        times.append(t)
        t += args.every
    rec = read(args.recording, times)
    print(f"read to {rec.ended_at:.0f} s of the process")
    report(rec, args.modules, args.stacks, args.depth)


if __name__ == "__main__":
    main()

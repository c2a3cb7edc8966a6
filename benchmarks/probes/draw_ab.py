"""The CPU draw alone (worker/model/sampler_numpy.py), before against after, in one process.

`host_path_ab` times whole engine steps in two source trees, one subprocess after the other; on this project's
shared 2-core VM its rounds differ by up to 2x even for an unchanged tree, which swamps a change of a tenth
of a millisecond. This loads both trees' sampler_numpy side by side and alternates single draws at [R, V]
(temperature 0.8, with top-k 50 and top-p 0.9 or, with `--sampling t0.8`, without; 3 x standard normal
logits), so both versions share every moment of the machine; it checks that both draw the same tokens and
prints the median and 10th percentile of each.

    git worktree add /tmp/before <commit>
    .venv/bin/python -m benchmarks.probes.draw_ab --before /tmp/before [--sampling t0.8]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parents[2]


def _load(tree: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, tree / "worker" / "model" / "sampler_numpy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="source tree of the earlier version")
    parser.add_argument("--after", default=str(HERE), help="source tree of the later version (default: this one)")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--draws", type=int, default=800, help="draws of each version, alternated")
    parser.add_argument("--sampling", choices=["t0.8-k50-p0.9", "t0.8"], default="t0.8-k50-p0.9")
    parser.add_argument("--out", default=None, help="write the figures as JSON to this file")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((args.rows, args.vocab)) * 3).astype(np.float32)
    temperature = np.full(args.rows, 0.8, np.float32)
    cut = args.sampling != "t0.8"
    top_k = np.full(args.rows, 50 if cut else 0, np.int64)
    top_p = np.full(args.rows, 0.9 if cut else 1.0)
    u = rng.random(args.rows)
    draws = {}
    for name in ("before", "after"):
        module = _load(Path(getattr(args, name)).resolve(), f"sampler_numpy_{name}")
        draws[name] = (lambda m=module, s=module.Scratch():
                       m.draw(logits, temperature, top_k, top_p, u, (256, 4096), s))
    if not np.array_equal(draws["before"](), draws["after"]()):
        raise SystemExit("the two versions draw different tokens")
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {name: [] for name in draws}
    for _ in range(args.draws):
        for name, draw in draws.items():
            start = time.perf_counter()
            draw()
            times[name].append(time.perf_counter() - start)
    record = {"rows": args.rows, "vocab": args.vocab, "draws": args.draws, "sampling": args.sampling,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpu_count": os.cpu_count(),
              "trees": {"before": args.before, "after": args.after}, "ms": {}}
    for name, values in times.items():
        median, p10 = 1e3 * float(np.median(values)), 1e3 * float(np.percentile(values, 10))
        record["ms"][name] = {"median": median, "p10": p10}
        print(f"{name:>6}: median {median:.3f} ms, p10 {p10:.3f} ms")
    ratio = record["ms"]["after"]["median"] / record["ms"]["before"]["median"]
    print(f"after / before: median {ratio:.2f}, p10 {record['ms']['after']['p10'] / record['ms']['before']['p10']:.2f}"
          f" (load {load_before[0]:.2f} -> {record['loadavg_after'][0]:.2f})")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

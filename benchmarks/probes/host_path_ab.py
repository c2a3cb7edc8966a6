"""Host work per step, before against after: `bench_host_path` in two source trees, alternately, several rounds.

On a shared VM the machine's speed drifts by 2x within minutes, so one run of each tree compares two moments of
the machine, not two versions of the code. Alternating the trees round after round and comparing medians (and
each round's pair) puts both versions through the same moments.

    git worktree add /tmp/before <commit>
    .venv/bin/python -m benchmarks.probes.host_path_ab --before /tmp/before --rounds 6 --label epyc-ab

Each round runs `python -m benchmarks.probes.bench_host_path --runs N --vocabs V --samplings S` once in each tree (its
own code, this venv's packages), before first. Writes <label>.json (every round's ms per step) beside the
host-path results and prints per sampling: the median and the minimum over rounds of each tree, their ratio
(after / before), and each round's after / before.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.probes.bench_host_path import RESULTS, SAMPLINGS

HERE = Path(__file__).resolve().parents[2]


def run_once(tree: Path, running: int, vocab: int, sampling: str, steps: int) -> float:
    """ms per step (median over `steps`) of bench_host_path in `tree`."""
    with tempfile.TemporaryDirectory() as out:
        env = dict(os.environ, PYTHONPATH=str(tree))
        subprocess.run([sys.executable, "-m", "benchmarks.probes.bench_host_path", "--runs", str(running), "--vocabs",
                        str(vocab), "--samplings", sampling, "--steps", str(steps), "--label", "ab", "--out", out],
                       cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
        point = json.loads((Path(out) / "ab.json").read_text())["points"][0]
        return point["ms_per_step_median"]


def _commit(tree: Path) -> str | None:
    done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tree, capture_output=True, text=True)
    return done.stdout.strip() or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="source tree of the earlier version")
    parser.add_argument("--after", default=str(HERE), help="source tree of the later version (default: this one)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--samplings", default=",".join(SAMPLINGS))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--label", default="ab")
    parser.add_argument("--out", default=None, help=f"results folder (default {RESULTS}/<date>-host-path)")
    args = parser.parse_args()

    trees = {"before": Path(args.before).resolve(), "after": Path(args.after).resolve()}
    load_before = os.getloadavg()
    times: dict[str, dict[str, list[float]]] = {s: {"before": [], "after": []} for s in args.samplings.split(",")}
    for sampling, by_tree in times.items():
        for _ in range(args.rounds):
            for name, tree in trees.items():
                by_tree[name].append(run_once(tree, args.running, args.vocab, sampling, args.steps))
        before, after = by_tree["before"], by_tree["after"]
        print(f"{sampling:>14}: before median {statistics.median(before):.2f} min {min(before):.2f} ms | "
              f"after median {statistics.median(after):.2f} min {min(after):.2f} ms | after / before: medians "
              f"{statistics.median(after) / statistics.median(before):.2f}, minima {min(after) / min(before):.2f}, "
              f"rounds {[round(a / b, 2) for b, a in zip(before, after)]}", flush=True)
    out = Path(args.out) if args.out else RESULTS / f"{datetime.date.today().isoformat()}-host-path"
    out.mkdir(parents=True, exist_ok=True)
    record = {"label": args.label, "trees": {k: str(v) for k, v in trees.items()},
              "commits": {k: _commit(v) for k, v in trees.items()}, "running": args.running,
              "vocab": args.vocab, "steps": args.steps, "rounds": args.rounds, "ms_per_step_medians": times,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg(), "cpu_count": os.cpu_count()}
    (out / f"{args.label}.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {out / (args.label + '.json')}")


if __name__ == "__main__":
    main()

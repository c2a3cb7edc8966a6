"""Where a benchmark run's files go.

The tracked run folder, benchmarks/results/<run>/, holds what a reader needs: report.md, the plots and
summary.json (the run's aggregates, at most SUMMARY_MAX_BYTES). Everything per request (each request's
timings, status samples, traces, worker logs, profiles) goes to the git-ignored benchmarks/results/raw/<run>/,
with the full results.json the summary was cut from. So a clone carries each run's figures and not the
megabytes behind them, and the run that made them can still be re-rendered on the machine that ran it.

A run folder outside benchmarks/results/ (a test's temporary folder, a GPU machine's $OUT) keeps its raw
data in its own raw/ subfolder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO / "benchmarks" / "results"
RAW_DIR = RESULTS_DIR / "raw"
SUMMARY_NAME = "summary.json"
RAW_RESULTS_NAME = "results.json"
SUMMARY_MAX_BYTES = 200_000
"""A tracked summary.json above this is a sign that per-request data leaked into it (tests/test_results_size.py
holds the tree to it)."""


def raw_path(out_dir: Path) -> Path:
    """benchmarks/results/<run>/ -> benchmarks/results/raw/<run>/; elsewhere <out_dir>/raw/."""
    out = Path(out_dir).resolve()
    try:
        return RAW_DIR / out.relative_to(RESULTS_DIR.resolve())
    except ValueError:
        return out / "raw"


def raw_dir(out_dir: Path) -> Path:
    """raw_path(out_dir), created."""
    path = raw_path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_results(out_dir: Path, results: dict, summary: dict, **dump_args) -> Path:
    """The full results into raw_dir(out_dir)/results.json and the summary into out_dir/summary.json.
    Returns the summary's path. A summary over SUMMARY_MAX_BYTES is written anyway (the run is done) with a
    warning: it should not be committed as it is."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (raw_dir(out_dir) / RAW_RESULTS_NAME).write_text(json.dumps(results, **dump_args))
    path = out_dir / SUMMARY_NAME
    path.write_text(json.dumps(summary, **dump_args))
    if path.stat().st_size > SUMMARY_MAX_BYTES:
        print(f"warning: {path} is {path.stat().st_size:,} bytes (over {SUMMARY_MAX_BYTES:,}): per-request data "
              "belongs in the raw results, not the summary", file=sys.stderr)
    return path


def read_results(out_dir: Path) -> dict:
    """The fullest results of a run folder: raw/<run>/results.json where this machine has it, else the
    folder's summary.json, else (a folder written before the split) its own results.json."""
    out_dir = Path(out_dir)
    raw = raw_path(out_dir)
    for path in (raw / RAW_RESULTS_NAME, out_dir / SUMMARY_NAME, out_dir / RAW_RESULTS_NAME):
        if path.exists():
            return json.loads(path.read_text())
    raise FileNotFoundError(f"no results in {out_dir} (nor {raw})")

"""benchmarks/results/ holds each run's report, plots and summary, not its raw data: every clone carries the
folder, so it stays under RESULTS_MAX_BYTES and each tracked JSON under SUMMARY_MAX_BYTES (per-request data
goes to the git-ignored benchmarks/results/raw/, benchmarks/lib/results_store.py). Sizes are read from git's
index, so what counts is what a commit would hold, not what lies in the working tree."""

import shutil
import subprocess
from pathlib import Path

import pytest

from benchmarks.lib.results_store import SUMMARY_MAX_BYTES

REPO = Path(__file__).resolve().parents[1]
RESULTS_MAX_BYTES = 10_000_000


def tracked_sizes(folder: str) -> dict[str, int]:
    """Path -> blob size of every file git tracks under folder (the index: staged changes count)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    listing = subprocess.run(["git", "ls-files", "-s", "-z", "--", folder], cwd=REPO, check=True,
                             capture_output=True).stdout.decode()
    entries = [line.split("\t", 1) for line in listing.split("\0") if line]
    blobs = [meta.split()[1] for meta, _ in entries]
    sizes = subprocess.run(["git", "cat-file", "--batch-check=%(objectsize)"], cwd=REPO, check=True,
                           input="\n".join(blobs).encode(), capture_output=True).stdout.decode().split()
    return {path: int(size) for (_, path), size in zip(entries, sizes, strict=True)}


def test_tracked_results_stay_small() -> None:
    sizes = tracked_sizes("benchmarks/results")
    total = sum(sizes.values())
    largest = sorted(sizes.items(), key=lambda kv: -kv[1])[:5]
    assert total <= RESULTS_MAX_BYTES, f"benchmarks/results/ holds {total:,} bytes in git; largest: {largest}"
    too_big = {p: s for p, s in sizes.items() if p.endswith((".json", ".jsonl")) and s > SUMMARY_MAX_BYTES}
    assert not too_big, f"tracked JSON over {SUMMARY_MAX_BYTES:,} bytes (raw data belongs in raw/): {too_big}"
    assert not [p for p in sizes if p.startswith("benchmarks/results/raw/")], "raw/ is git-ignored"


def test_the_size_check_reads_git_sizes() -> None:
    """Not vacuous: it sees the files tracked there, and for those unchanged in the working tree it reads
    their sizes on disk."""
    sizes = tracked_sizes("benchmarks/results")
    assert any(p.endswith("report.md") for p in sizes), "no tracked run reports"
    changed = set(subprocess.run(["git", "diff", "--name-only", "--", "benchmarks/results"], cwd=REPO, check=True,
                                 capture_output=True, text=True).stdout.split())
    unchanged = [p for p in sizes if p not in changed and (REPO / p).exists()]
    assert unchanged and all((REPO / p).stat().st_size == sizes[p] for p in unchanged)

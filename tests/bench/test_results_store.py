"""A run's summary goes to its tracked folder, everything else to the git-ignored raw folder beside it."""

import json
from pathlib import Path

from benchmarks.lib import results_store
from benchmarks.lib.results_store import RAW_DIR, RESULTS_DIR, raw_path, read_results, write_results


def test_a_run_under_results_keeps_its_raw_data_under_raw() -> None:
    assert raw_path(RESULTS_DIR / "2030-01-01-overload-control") == RAW_DIR / "2030-01-01-overload-control"
    assert raw_path(RESULTS_DIR / "a" / "b") == RAW_DIR / "a" / "b"


def test_a_run_elsewhere_keeps_its_raw_data_in_its_own_raw_folder(tmp_path: Path) -> None:
    assert raw_path(tmp_path / "run") == (tmp_path / "run" / "raw").resolve()


def test_write_splits_summary_and_raw_and_read_prefers_raw(tmp_path: Path) -> None:
    out = tmp_path / "run"
    full = {"figure": 1.5, "requests": [{"id": i} for i in range(100)]}
    summary = {"figure": 1.5}
    path = write_results(out, full, summary, indent=1)
    assert path == out / "summary.json" and json.loads(path.read_text()) == summary
    assert json.loads((out / "raw" / "results.json").read_text()) == full
    assert read_results(out) == full
    (out / "raw" / "results.json").unlink()  # a clone: only the tracked summary
    assert read_results(out) == summary


def test_an_oversized_summary_is_written_with_a_warning(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(results_store, "SUMMARY_MAX_BYTES", 10)
    write_results(tmp_path, {"x": "y" * 100}, {"x": "y" * 100})
    assert (tmp_path / "summary.json").exists()
    assert "over 10" in capsys.readouterr().err


def test_the_raw_folder_is_ignored_by_git() -> None:
    ignore = (RESULTS_DIR.parents[1] / ".gitignore").read_text().split()
    assert "/benchmarks/results/raw/" in ignore

"""The README's settings table is generated from the settings classes; this keeps the two in sync."""

from pathlib import Path

from worker.config_cli import TABLE_BEGIN, TABLE_END, settings_table

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_settings_table_matches_the_code() -> None:
    text = README.read_text()
    start, end = text.index(TABLE_BEGIN), text.index(TABLE_END) + len(TABLE_END)
    assert text[start:end] == settings_table(), "run: llm-worker config --write-readme"


def test_readme_names_the_test_command_that_ci_runs() -> None:
    ci = (README.parent / ".ci" / "run").read_text()
    assert "make test" in ci and "make test " in README.read_text()

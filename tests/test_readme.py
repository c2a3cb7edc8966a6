"""The README and docs/ stay true to the code: the settings table is generated from the settings classes,
every file and `Class.method` the text names exists, every relative link leads somewhere, and the README
names the test command CI runs."""

import pytest

import ast
import re
from pathlib import Path

from worker.config_cli import TABLE_BEGIN, TABLE_DOC, TABLE_END, settings_table

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
CODE_FOLDERS = ("worker", "schemas", "kernels", "llm_client", "producer_examples", "gateway", "benchmarks", "tests",
                "deploy")
PENDING_PAGES = {"docs/structured-output.md", "docs/memory.md"}
"""Pages the README and docs/ link to that the work on structured output and on memory is writing; a link to
one of them may lead nowhere until it lands (every other link must resolve)."""


def documents() -> dict[Path, str]:
    return {path: path.read_text() for path in [README, *DOCS]}


def test_docs_exist_and_readme_is_short() -> None:
    assert DOCS, "docs/ holds the depth"
    assert len(README.read_text().splitlines()) <= 250


def test_settings_table_matches_the_code() -> None:
    text = (ROOT / TABLE_DOC).read_text()
    start, end = text.index(TABLE_BEGIN), text.index(TABLE_END) + len(TABLE_END)
    assert text[start:end] == settings_table(), "run: llm-worker config --write-docs"


def test_readme_names_the_test_command_that_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make test " in README.read_text()


def class_members() -> dict[str, set[str]]:
    """Class name -> the names it defines or inherits from another class of ours (methods, properties, fields),
    for every class in the code folders. Read from the source, not imported: the check finds a class wherever
    its module lives (packages split, modules move) and runs no module's import-time code."""
    defined: dict[str, set[str]] = {}
    bases: dict[str, list[str]] = {}
    for folder in CODE_FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ClassDef):
                    continue
                names = defined.setdefault(node.name, set())
                bases.setdefault(node.name, []).extend(b.id for b in node.bases if isinstance(b, ast.Name))
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        names.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        names.update(t.id for t in item.targets if isinstance(t, ast.Name))
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        names.update(t.attr for t in ast.walk(item) if isinstance(t, ast.Attribute)
                                     and isinstance(t.value, ast.Name) and t.value.id == "self")

    def members(name: str, seen: frozenset = frozenset()) -> set[str]:
        out = set(defined.get(name, ()))
        for base in bases.get(name, ()):
            if base not in seen:
                out |= members(base, seen | {name})
        return out

    return {name: members(name) for name in defined}


FILE_NAME = re.compile(r"`([\w./-]+\.(?:py|sh))`")
CLASS_MEMBER = re.compile(r"`([A-Z][a-z]\w*)\.(_?[a-z]\w*)(?:\(\))?`")


@pytest.mark.slow
def test_every_file_and_class_member_named_exists() -> None:
    """Every `file.py` (or `.sh`) the README or docs/ names exists: a full path as written, a bare name anywhere
    in the code folders. Every `Class.method` is defined on a class of that name in the code folders."""
    sources = [p.relative_to(ROOT).as_posix() for top in CODE_FOLDERS for p in (ROOT / top).rglob("*")
               if p.suffix in (".py", ".sh")]
    classes = class_members()
    missing = []
    for path, text in documents().items():
        for name in sorted(set(FILE_NAME.findall(text))):
            if not any(src == name or src.endswith("/" + name) for src in sources):
                missing.append(f"{path.name}: {name}")
        for cls, member in sorted(set(CLASS_MEMBER.findall(text))):
            if member not in classes.get(cls, ()):
                missing.append(f"{path.name}: {cls}.{member}")
    assert not missing, missing


@pytest.mark.slow
def test_the_name_check_can_fail() -> None:
    classes = class_members()
    assert "fetch_once" in classes["Intake"] and "no_such_method" not in classes["Intake"]
    assert CLASS_MEMBER.findall("`Intake.fetch_once` and `README.md`") == [("Intake", "fetch_once")]


def test_every_relative_link_leads_somewhere() -> None:
    broken = []
    for path, text in documents().items():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (path.parent / target).resolve()
            if not resolved.exists() and resolved.relative_to(ROOT).as_posix() not in PENDING_PAGES:
                broken.append(f"{path.name}: {target}")
    assert not broken, broken


def test_the_kcat_listener_filter_streams_each_line_as_it_comes() -> None:
    """The README's kcat example pipes kcat into a filter; a filter that buffers its input (mawk's awk does)
    would hold the stream back until kcat exits. Feed the README's own filter one line at a time, its output
    on a terminal as in a shell, and require each answer before the next line is written."""
    import os
    import pty
    import select
    import subprocess
    import time

    text = README.read_text()
    start = text.index("kcat -C -b localhost:9092 -t llm.results")
    pipeline = text[start:text.index("&\n", start)].replace("\\\n", " ")
    filter_cmd = pipeline.split("|", 1)[1].strip()
    assert "req-42" in filter_cmd
    master, slave = pty.openpty()
    proc = subprocess.Popen(["sh", "-c", filter_cmd], stdin=subprocess.PIPE, stdout=slave, stderr=slave)
    os.close(slave)
    try:
        for n in range(3):
            proc.stdin.write(f'other-1\t{{"n":{n},"skip":true}}\nreq-42\t{{"n":{n}}}\n'.encode())
            proc.stdin.flush()
            seen, deadline = b"", time.monotonic() + 5
            while f'{{"n":{n}}}'.encode() not in seen and time.monotonic() < deadline:
                if select.select([master], [], [], 0.1)[0]:
                    seen += os.read(master, 4096)
            assert f'{{"n":{n}}}'.encode() in seen, f"line {n} held back by the filter: {seen!r}"
            assert b"skip" not in seen
    finally:
        proc.stdin.close()
        proc.wait(5)
        os.close(master)

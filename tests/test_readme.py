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


def test_the_architecture_section_names_files_and_methods_that_exist() -> None:
    """The path of one request in the README stays true when code moves: every `file.py` it names exists, and
    every `Class.method` it names is defined in worker/transport/."""
    import importlib
    import pkgutil
    import re

    import worker.transport

    text = README.read_text()
    section = text[text.index("## Architecture"):text.index("## Using the worker")]
    root = README.parent
    sources = [p.relative_to(root).as_posix()
               for top in ("worker", "schemas", "kernels", "tests") for p in (root / top).rglob("*.py")]
    for name in set(re.findall(r"`([\w/]+\.py)`", section)):
        assert any(path == name or path.endswith("/" + name) for path in sources), name
    classes = {}
    for info in pkgutil.iter_modules(worker.transport.__path__):
        module = importlib.import_module(f"worker.transport.{info.name}")
        classes.update({k: v for k, v in vars(module).items() if isinstance(v, type)})
    for cls, method in set(re.findall(r"`([A-Z]\w+)\.(\w+)`", section)):
        assert hasattr(classes[cls], method), f"{cls}.{method}"


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

"""Layers import one way: transport -> engine -> model runner -> kernels, and the engine's planning is pure.

Read from the source with `ast` (every import statement, lazy ones inside functions included), so it runs in
milliseconds and names the file and line that breaks a rule. tests/engine/test_purity.py checks the pure
modules again by importing them in a fresh interpreter.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "triton", "aiokafka", "transformers", "numpy", "llguidance")
PURE_MODULES = (
    "worker.engine.api",
    "worker.engine.request",
    "worker.engine.block_pool",
    "worker.engine.policies",
    "worker.engine.scheduler",
    "worker.engine.scheduler_output",
    "worker.engine.batch_builder",
    "worker.model.step_batch",
    "worker.tools.grammar",
    "worker.tools.parse",
    "worker.tools.render",
)
"""Importing these, and whatever of ours they import in turn, pulls in nothing in HEAVY."""
TORCH_OWNER = "worker.engine.engine"
"""The one engine module that touches torch (it calls the model runner and the sampler)."""


@dataclass(frozen=True, slots=True)
class Import:
    module: str
    """Full dotted name; `from a import b` yields a, and a.b too when that is one of our modules."""
    line: int


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def source_files() -> dict[str, Path]:
    return {module_name(p): p for top in ("worker", "kernels", "gateway") for p in sorted((ROOT / top).rglob("*.py"))}


FILES = source_files()


def _nodes(tree: ast.AST, top_level_only: bool) -> Iterator[ast.AST]:
    for node in ast.iter_child_nodes(tree):
        yield node
        if not (top_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))):
            yield from _nodes(node, top_level_only)


def imports(name: str, top_level_only: bool = False) -> Iterator[Import]:
    """Every import statement of module `name`; with top_level_only, only those that importing it runs (not
    the ones inside functions)."""
    path = FILES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in _nodes(ast.parse(path.read_text(), str(path)), top_level_only):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base == "__future__":
                continue
            yield Import(base, node.lineno)
            for alias in node.names:
                if f"{base}.{alias.name}" in FILES:
                    yield Import(f"{base}.{alias.name}", node.lineno)


def is_under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(modules: list[str], forbidden: tuple[str, ...], top_level_only: bool = False) -> list[str]:
    return [
        f"{FILES[name].relative_to(ROOT)}:{imp.line} imports {imp.module}"
        for name in modules
        for imp in imports(name, top_level_only)
        if any(is_under(imp.module, prefix) for prefix in forbidden)
    ]


def modules_under(prefix: str) -> list[str]:
    return [name for name in FILES if is_under(name, prefix)]


def test_the_source_tree_is_found():
    assert len(modules_under("worker.engine")) > 5 and len(modules_under("kernels")) > 3
    missing = [name for name in (*PURE_MODULES, TORCH_OWNER) if name not in FILES]
    assert not missing, f"renamed or removed: update this test ({missing})"


def test_model_never_imports_the_engine_or_the_transport():
    assert violations(modules_under("worker.model"), ("worker.engine", "worker.transport")) == []


def test_kernels_never_import_the_worker():
    assert violations(modules_under("kernels"), ("worker",)) == []


def test_the_gateway_is_a_client_it_never_imports_the_worker_inside():
    # Settings and the wire records are shared with every client; the engine, the model and the transport are not.
    assert violations(modules_under("gateway"), ("worker.engine", "worker.model", "worker.transport", "kernels",
                                                 "torch", "transformers")) == []
    assert violations(modules_under("worker"), ("gateway",)) == []


def test_engine_never_imports_the_transport():
    assert violations(modules_under("worker.engine"), ("worker.transport",)) == []


# The transport's rooms, and what each may import of the others: the load policy is pure, the Kafka plumbing
# knows no policy and no request, the request path uses both; worker.py (and its status reporter) wire them.
TRANSPORT_TOP = ("worker.transport.worker", "worker.transport.status_report")


@pytest.mark.parametrize("room, forbidden", [
    ("worker.transport.load", ("worker.transport.kafka", "worker.transport.requests", *TRANSPORT_TOP, "aiokafka")),
    ("worker.transport.kafka", ("worker.transport.load", "worker.transport.requests", *TRANSPORT_TOP)),
    ("worker.transport.requests", TRANSPORT_TOP),
])
def test_transport_rooms_import_one_way(room: str, forbidden: tuple[str, ...]):
    assert len(modules_under(room)) >= 5, f"{room}: moved or emptied; update this test"
    assert violations(modules_under(room), forbidden) == []


def test_the_transport_keeps_few_modules_outside_its_rooms():
    loose = {m for m in modules_under("worker.transport") if m.count(".") == 2}
    rooms = {"worker.transport.kafka", "worker.transport.load", "worker.transport.requests"}
    assert loose - rooms == {"worker.transport.loop_watchdog", "worker.transport.memory_metrics",
                             "worker.transport.metrics", *TRANSPORT_TOP}, loose


def closure(name: str) -> list[str]:
    """Every module of ours that importing `name` runs besides itself (parent packages included)."""
    seen: list[str] = []
    todo = [name]
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.append(current)
        parents = [".".join(current.split(".")[:i]) for i in range(1, current.count(".") + 1)]
        todo += [m for m in parents if m in FILES]
        todo += [imp.module for imp in imports(current, top_level_only=True) if imp.module in FILES]
    return seen[1:]


def heavy_imports(names: list[str]) -> list[str]:
    """The modules' own imports, lazy ones included (a call would run them), and what importing them runs."""
    return violations(names, HEAVY) + violations(sorted({m for n in names for m in closure(n)}), HEAVY, True)


@pytest.mark.parametrize("name", PURE_MODULES)
def test_pure_modules_import_nothing_heavy(name: str):
    assert heavy_imports([name]) == []


def test_only_engine_py_touches_torch_in_the_engine():
    assert heavy_imports([name for name in modules_under("worker.engine") if name != TORCH_OWNER]) == []


def test_transport_speaks_to_the_engine_only_through_its_api():
    transport = modules_under("worker.transport")
    engine_imports = [
        f"{FILES[name].relative_to(ROOT)}:{imp.line} imports {imp.module}"
        for name in transport
        for imp in imports(name)
        # `from worker.engine import api` names the package too; its submodule is what is checked.
        if is_under(imp.module, "worker.engine") and imp.module != "worker.engine"
        and not is_under(imp.module, "worker.engine.api")
    ]
    assert engine_imports == []
    assert violations(transport, ("worker.model", "kernels", "torch", "llguidance")) == []


@pytest.mark.slow
def test_the_worker_never_names_its_clients():
    """No import of the client side from worker/, and no module name of it in a string either (an importlib
    call is an import all the same): client commands reach `llm-worker` through the `llm_worker.commands`
    entry points that pyproject.toml declares."""
    clients = ("llm_client", "producer_examples", "gateway")
    found = violations(modules_under("worker"), clients)
    for name, path in source_files().items():
        if not is_under(name, "worker"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            # A dotted module path ("gateway.cli"), or the client package's own name; a folder called "gateway"
            # (the gateway's data directory) is no import.
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                    node.value in ("llm_client", "producer_examples")
                    or any(node.value.startswith(c + ".") for c in clients)):
                found.append(f"{name}: {node.value!r}")
    assert found == []


def test_every_client_command_is_registered_as_an_entry_point():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    commands = project["project"]["entry-points"]["llm_worker.commands"]
    for name, module in commands.items():
        path = ROOT / (module.replace(".", "/") + ".py")
        source = path.read_text()
        assert "def configure_parser(" in source and "def run(" in source and "\nHELP = " in source, name


def test_the_client_package_imports_without_the_workers_engine():
    """`import llm_client` (and the gateway built on it) in a fresh interpreter loads no torch, transformers or
    engine module: a producer installs the client, not a model runtime."""
    import subprocess
    import sys

    probe = ("import sys, llm_client, gateway.app; "
             "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'triton') "
             "or m.startswith(('worker.engine', 'worker.model', 'worker.transport', 'kernels'))); print(bad)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

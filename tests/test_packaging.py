"""What pyproject.toml declares against what the code imports: every third-party import of the gateway is
declared by the base dependencies or the `gateway` extra, every one of the client package and the worker's
Kafka side by the base; the Python the code needs is the one declared."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = {"worker", "gateway", "llm_client", "producer_examples", "schemas", "kernels", "benchmarks", "tests"}


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=;!~]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _declared(*extras: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {_name(r) for r in project["dependencies"]}
    for extra in extras:
        names |= {_name(r) for r in project["optional-dependencies"][extra]}
    return names


def _imports(folder: str) -> set[str]:
    """Top-level modules imported anywhere in a folder (lazy imports inside functions too)."""
    found = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return found - OURS - set(sys.stdlib_module_names)


def _distributions(modules: set[str]) -> dict[str, set[str]]:
    by_module = importlib.metadata.packages_distributions()
    return {m: {d.lower().replace("_", "-") for d in by_module.get(m, [m])} for m in modules}


def _undeclared(folder: str, *extras: str) -> dict[str, set[str]]:
    declared = _declared(*extras)
    # A dependency's own dependencies count as declared only when it is pinned for them here: none are.
    return {m: ds for m, ds in _distributions(_imports(folder)).items() if not ds & declared}


def test_the_gateway_declares_what_it_imports():
    assert _undeclared("gateway", "gateway") == {}


def test_the_client_package_needs_only_the_base():
    assert _undeclared("llm_client") == {}


def test_the_declared_python_is_the_one_the_code_needs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["requires-python"] == ">=3.11"  # asyncio.timeout, Task.uncancel
    assert sys.version_info >= (3, 11)

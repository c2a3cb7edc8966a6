"""Parts of a check run one after another under one time budget, each under its own limit (a SIGALRM timer:
the main thread only), and their results in one JSON file rewritten after every part, so a part that fails or
runs out of time keeps what it measured and leaves the others' results (benchmarks/gpu_engine_check.py)."""

from __future__ import annotations

import json
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


class PartTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expire(signum, frame):
        raise PartTimeout(f"over its {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Report:
    """The results file, rewritten after every part; each part's dict is filled as it goes, so a part cut short
    keeps what it measured. `ok`: every part ran to its end and every check passed."""

    def __init__(self, out: Path, budget_s: float, json_name: str = "results.json", env: dict | None = None) -> None:
        self.out = out
        self.path = out / json_name
        self.deadline = time.monotonic() + budget_s
        self.data: dict = {"env": env or {}, "parts": {}, "checks": {}}
        out.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, limit_s: float, body: Callable[[dict], object]) -> object:
        result: dict = {}
        self.data["parts"][name] = result
        left = self.deadline - time.monotonic() - 2.0
        if left < 3.0:
            result["status"] = "skipped: the budget is spent"
            self.write()
            return None
        limit = min(limit_s, left)
        started = time.perf_counter()
        value = None
        try:
            with time_limit(limit):
                value = body(result)
            result["status"] = "ok"
        except PartTimeout as exc:
            result["status"] = f"timeout ({exc})"
        except Exception as exc:  # noqa: BLE001 (a part's failure is a result; the other parts still run)
            result["status"] = f"error: {type(exc).__name__}: {exc}"
            result["traceback"] = traceback.format_exc()[-4000:]
        result["seconds"] = round(time.perf_counter() - started, 2)
        print(f"[{name}] {result['status']} in {result['seconds']} s", flush=True)
        self.write()
        return value

    def check(self, name: str, passed: bool, detail: object = None) -> None:
        self.data["checks"][name] = {"passed": bool(passed), "detail": detail}
        print(f"  check {name}: {'PASS' if passed else 'FAIL'} {detail if detail is not None else ''}", flush=True)

    @property
    def ok(self) -> bool:
        parts_ok = all(p.get("status") == "ok" for p in self.data["parts"].values())
        return parts_ok and all(c["passed"] for c in self.data["checks"].values())

    def write(self) -> None:
        self.data["ok"] = self.ok
        self.path.write_text(json.dumps(self.data, indent=1, default=str))

"""The GPU check's Python part (benchmarks/gpu_engine_check.py) runs on the CPU in its --smoke mode without an
error, so it meets a lent GPU with nothing but GPU questions left; and its random-model builder makes folders
that our runner, the sampler's detokenizer and transformers all load."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu_engine_check import compare, failed_systems, main, tiny_shape
from benchmarks.lib.random_model import build_random_model, hf_tensor_shapes
from worker.model.config import parse_config


@pytest.mark.slow  # 3-4 s: in the full suite, not the fast subset
def test_smoke_mode_runs_every_part_and_every_check(tmp_path: Path) -> None:
    assert main(["--smoke", "--out", str(tmp_path), "--models", "tiny-2-layers"]) == 0
    data = json.loads((tmp_path / "results.json").read_text())
    parts = data["parts"]
    assert set(parts) == {"build", "tiny-2-layers/load", "tiny-2-layers/graphs", "tiny-2-layers/steps",
                          "tiny-2-layers/systems", "tiny-2-layers/fp8-load", "tiny-2-layers/fp8-steps"}
    assert all(p["status"] == "ok" for p in parts.values()), {k: p["status"] for k, p in parts.items()}
    assert data["ok"] and data["checks"] and all(c["passed"] for c in data["checks"].values())
    assert parts["tiny-2-layers/load"]["graph_mode"] == "eager"  # nothing to capture on the CPU
    assert len(parts["tiny-2-layers/graphs"]["buckets_hit"]) >= 2
    kinds = {row["kind"] for row in parts["tiny-2-layers/steps"]["summary"]}
    assert {"prefill", "decode-bucketed", "decode-off"} <= kinds
    assert parts["tiny-2-layers/fp8-load"]["quantization"] == "fp8"
    assert {"prefill", "decode-bucketed"} <= {row["kind"] for row in parts["tiny-2-layers/fp8-steps"]["summary"]}
    runs = parts["tiny-2-layers/systems"]["runs"]
    assert set(runs) == {"continuous", "static", "continuous-eager", "sim-h200", "hf-cb"}
    assert all(m["num_completed"] == m["num_requests"] for m in runs.values())


def test_compare_reports_where_tokens_diverge() -> None:
    same = compare({"a": [1, 2], "b": [3]}, {"a": [1, 2], "b": [3]})
    assert same["equal"] and same["tokens_before_first_divergence"] == 3
    diff = compare({"a": [1, 2, 3], "b": [3]}, {"a": [1, 5, 3], "b": [3]})
    assert not diff["equal"] and diff["first_divergence"] == {"a": 1} and diff["tokens_before_first_divergence"] == 2


def test_a_system_that_leaves_requests_unanswered_fails_the_systems_part() -> None:
    ok = {"num_completed": 4, "num_requests": 4}
    assert failed_systems({"continuous": ok}) == {}
    failed = failed_systems({"continuous": ok, "hf-cb": {"num_completed": 0, "num_requests": 4},
                             "static": {"error": "RuntimeError: boom"}})
    assert failed == {"hf-cb": "completed 0 of 4 requests", "static": "RuntimeError: boom"}


@pytest.mark.slow  # ~3-4 s: in the full suite, not the fast subset
def test_random_model_loads_in_transformers_with_a_tokenizer_of_its_vocabulary(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = {**tiny_shape(1), "vocab_size": 600, "eos_token_id": [2, 5], "tie_word_embeddings": False}
    folder = build_random_model(tmp_path, shape, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) == 600 and tokenizer.eos_token_id == 2 and set(tokenizer.added_tokens_decoder) == {1, 2, 5}
    assert tokenizer.decode(tokenizer("hello world")["input_ids"]) == "hello world"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    names = set(model.state_dict())
    assert set(hf_tensor_shapes(parse_config(shape))) <= names  # every tensor the loader expects, by HF's names


@pytest.mark.slow  # ~15 s: in the full suite, not the fast subset
def test_gpu_check_script_rehearses_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/gpu_check.sh itself (interpreter search, parts, summary, exit status) with GPU_CHECK_SMOKE=1, as
    benchmarks/gpu_rehearsal.sh runs it in the GPU machine's versions: a shell error meets the GPU here first."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "GPU_CHECK_SMOKE": "1", "PYTHON": sys.executable, "OUT": str(tmp_path),
           "WHEELS_DIR": str(tmp_path / "no-wheels")}
    done = subprocess.run(["bash", str(root / "benchmarks" / "gpu_check.sh")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "engine check exit 0, kernel tests exit -, kernel benchmark exit -" in summary
    assert "no GPU (rehearsal)" in (tmp_path / "env.txt").read_text()
    data = json.loads((tmp_path / "engine_check.json").read_text())
    assert (data["ok"] and data["plan"]["smoke"]
            and {"tiny-2-layers/systems", "tiny-3-layers/systems"} <= set(data["parts"]))

"""LoRA adapters served from PEFT's files: greedy tokens and log-probs of several adapters and the base in one
batch equal transformers + PEFT's; loading, eviction and reloading under ENGINE_MAX_LORAS; adapters that cannot be
served refused with the file and the reason while the rest is served."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.model.batch import tiny_settings
from tests.model.lora_adapters import ATTENTION, greedy, make_adapter, reference_model
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import LLMEngine
from worker.model.lora import LoraAdapter, LoraStep, GroupLora

MAX_NEW = 8
ADAPTERS = {"alpha": dict(seed=1, rank=8), "beta": dict(seed=2, rank=4, targets=ATTENTION, use_rslora=True),
            "gamma": dict(seed=3, rank=16, targets=["gate_proj", "up_proj", "down_proj"], alpha=8.0)}


@pytest.fixture(scope="module")
def adapters_dir(tiny_model_path, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("adapters")
    for name, options in ADAPTERS.items():
        make_adapter(tiny_model_path, folder / name, **options)
    return folder


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    generator = torch.Generator().manual_seed(5)
    shared = torch.randint(3, 49152, (13,), generator=generator).tolist()
    return {"shared": shared, **{f"own{i}": torch.randint(3, 49152, (5 + 3 * i,), generator=generator).tolist()
                                 for i in range(4)}}


@pytest.fixture(scope="module")
def expected(tiny_model_path, adapters_dir, prompts) -> dict[tuple[str | None, str], tuple[list[int], list[float]]]:
    out = {}
    for model in (None, *ADAPTERS):
        ref = reference_model(tiny_model_path, None if model is None else adapters_dir / model)
        for key, prompt in prompts.items():
            out[model, key] = greedy(ref, prompt, MAX_NEW)
    return out


def request(request_id: str, model: str | None, prompt: list[int]) -> EngineRequest:
    return EngineRequest(request_id, prompt_token_ids=prompt, model=model,
                         sampling=SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=True))


def record_step_adapters(engine: LLMEngine) -> list[set]:
    """The set of models (None: the base) each step's forward ran, recorded at the runner's input."""
    steps: list[set] = []
    input_from = engine.runner.input_from

    def recording(step, arrays):
        steps.append(set(step.adapters) if step.adapters else {None})
        return input_from(step, arrays)

    engine.runner.input_from = recording
    return steps




@pytest.mark.slow  # transformers + PEFT's reference for 4 models x 5 prompts: a few seconds
def test_three_adapters_and_base_in_one_batch_match_peft(tiny_model_path, adapters_dir, prompts, expected):
    engine = LLMEngine(tiny_settings(model=str(tiny_model_path), adapters_dir=str(adapters_dir), max_loras=4,
                                     max_num_seqs=16, max_num_batched_tokens=256))
    steps = record_step_adapters(engine)
    logprobs: dict[str, list[float]] = {}
    for round_ in range(2):  # the second round finds the shared prompt's blocks in each model's own cache
        cases = {f"{round_}-{model}-{key}": (model, key) for model in (None, *ADAPTERS) for key in prompts
                 if key == "shared" or round_ == 0}
        reqs = [request(rid, model, prompts[key]) for rid, (model, key) in cases.items()]
        pending = [out for r in reqs for out in engine.add_request(r)]
        assert not pending, pending
        for _ in range(200):
            for out in engine.step():
                logprobs.setdefault(out.request_id, []).extend(lp.logprob for lp in out.new_logprobs or ())
                assert out.finish_reason in (None, "length"), out
                if out.new_token_ids:
                    logprobs.setdefault("tokens:" + out.request_id, []).extend(out.new_token_ids)
            if not engine.has_unfinished():
                break
        for rid, (model, key) in cases.items():
            tokens, ref_logprobs = expected[model, key]
            assert logprobs["tokens:" + rid] == tokens, (rid, model, key)
            torch.testing.assert_close(torch.tensor(logprobs[rid]), torch.tensor(ref_logprobs), atol=1e-4, rtol=1e-5)
    assert {None, *ADAPTERS} in steps, "the base and the three adapters were meant to decode in one step"
    assert engine.scheduler.pool.hit_rate > 0, "the second round was meant to hit the prefix cache"
    # The adapters change the output, each its own way, so matching PEFT says something.
    outputs = {tuple(expected[model, "shared"][0]) for model in (None, *ADAPTERS)}
    assert len(outputs) == 4
    engine.scheduler.check_invariants()


def test_segments_of_interleaved_rows_equal_each_row_alone():
    """Rows of one adapter that are not adjacent (an index segment) and adjacent (a slice) get x A^T B^T, the base
    rows nothing; a group's targets land in their own columns."""
    generator = torch.Generator().manual_seed(0)

    def adapter(name: str, rank: int) -> LoraAdapter:
        a = torch.randn(2 * rank, 6, generator=generator)  # two targets' A stacked
        b1, b2 = torch.randn(3, rank, generator=generator), torch.randn(4, rank, generator=generator)
        group = GroupLora(a, [(0, rank, 0, b1), (rank, rank, 5, b2)])
        return LoraAdapter(name, Path(name), rank, 1.0, [{"qkv": group}], name)

    first, second = adapter("a", 2), adapter("b", 3)
    per_request = [first, None, second, first, first]
    num_new = [2, 1, 3, 1, 2]
    x = torch.randn(sum(num_new) + 2, 6, generator=generator)  # two padding rows, as row buckets add
    base = torch.randn(x.shape[0], 9, generator=generator)
    step = LoraStep.build(per_request, torch.tensor(num_new).numpy(), torch.device("cpu"))
    assert sorted(type(rows).__name__ for _, rows in step.segments) == ["Tensor", "slice"]
    out = step.layer(0).add("qkv", x, base.clone())
    expected = base.clone()
    row = 0
    for which, n in zip(per_request, num_new):
        for _ in range(n):
            if which is not None:
                g = which.layers[0]["qkv"]
                s = x[row] @ g.a.t()
                for column, r, offset, b in g.parts:
                    expected[row, offset : offset + b.shape[0]] += s[column : column + r] @ b.t()
            row += 1
    torch.testing.assert_close(out, expected)
    assert LoraStep.build([None, None], torch.tensor([1, 2]).numpy(), torch.device("cpu")) is None

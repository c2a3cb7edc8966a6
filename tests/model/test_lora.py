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
from worker.model.lora import GroupLora, LoraAdapter, LoraStack, LoraStep

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

    parts_of: dict[str, list] = {}

    def adapter(name: str, rank: int) -> LoraAdapter:
        a = torch.randn(2 * rank, 6, generator=generator)  # two targets' A stacked
        b1, b2 = torch.randn(3, rank, generator=generator), torch.randn(4, rank, generator=generator)
        # Targets in columns 0:3 and 5:9 of the fused output, none in 3:5: the expand spans 0:9, zero there.
        b = torch.zeros(2 * rank, 9)
        b[:rank, 0:3], b[rank:, 5:9] = b1.t(), b2.t()
        parts_of[name] = [(0, rank, 0, b1), (rank, rank, 5, b2)]
        return LoraAdapter(name, Path(name), rank, 1.0, [{"qkv": GroupLora(a, b, 0, 9)}], name)

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
                for column, r, offset, b in parts_of[which.name]:
                    expected[row, offset : offset + b.shape[0]] += s[column : column + r] @ b.t()
            row += 1
    torch.testing.assert_close(out, expected)
    # The same step over the adapters stacked (how a step mixing adapters runs), with a third adapter loaded
    # that no row uses and one of a wider rank: the same sums.
    unused = adapter("c", 4)
    stack = LoraStack([second, unused, first], num_layers=1)
    stacked = LoraStep.build(per_request, torch.tensor(num_new).numpy(), torch.device("cpu"), stack)
    assert stacked.stacked is not None and stacked.stacked.width == 5  # the first adapter's rows: 2 + 1 + 2 tokens
    torch.testing.assert_close(stacked.layer(0).add("qkv", x, base.clone()), expected)
    # One adapter in the step: its segment alone, not the stack.
    alone = LoraStep.build([first, None], torch.tensor([2, 1]).numpy(), torch.device("cpu"), stack)
    assert alone.stacked is None
    assert LoraStep.build([None, None], torch.tensor([1, 2]).numpy(), torch.device("cpu")) is None


def run(engine: LLMEngine, cases: dict[str, tuple[str | None, str]], prompts) -> dict:
    return engine.generate([request(rid, model, prompts[key]) for rid, (model, key) in cases.items()])


@pytest.mark.slow  # shares the PEFT reference with the test above
def test_two_resident_of_three_evicts_the_least_recently_used_and_reloads(tiny_model_path, adapters_dir, prompts,
                                                                          expected):
    engine = LLMEngine(tiny_settings(model=str(tiny_model_path), adapters_dir=str(adapters_dir), max_loras=2,
                                     max_num_seqs=16, max_num_batched_tokens=256))
    loras = engine.runner.loras
    steps = record_step_adapters(engine)
    # One adapter a wave: two used in the same steps would tie for least recently used.
    for wave, models in enumerate([("alpha",), ("beta",), ("gamma",), ("alpha",)]):
        cases = {f"{wave}-{model}": (model, "own1") for model in models}
        done = run(engine, cases, prompts)
        for rid, (model, key) in cases.items():
            assert done[rid].token_ids == expected[model, key][0], rid
    # gamma evicted alpha (the least recently used), then alpha evicted beta: four loads, two evictions.
    assert list(loras.loaded) == ["gamma", "alpha"]
    assert (loras.num_loads, loras.num_evictions) == (4, 2)

    # All three at once: two run, the third waits until one of them has no running request left.
    cases = {f"all-{model}": (model, key) for model in ADAPTERS for key in ("shared", "own2")}
    done = run(engine, cases, prompts)
    for rid, (model, key) in cases.items():
        assert done[rid].token_ids == expected[model, key][0], rid
    assert max(len(step - {None}) for step in steps) == 2
    assert len(loras.loaded) == 2


@pytest.mark.slow  # makes its adapters with PEFT (the module fixture)
def test_adapters_that_cannot_be_served_are_refused_and_the_rest_is_served(tiny_model_path, adapters_dir, prompts,
                                                                            tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "adapters"
    shutil.copytree(adapters_dir / "alpha", folder / "alpha")
    shutil.copytree(adapters_dir / "gamma", folder / "big")  # rank 16, over the limit of 8 below
    shutil.copytree(adapters_dir / "alpha", folder / "misfit")
    tensors = load_file(folder / "misfit" / "adapter_model.safetensors")
    name = next(n for n in tensors if "layers.1.self_attn.k_proj.lora_B" in n)
    tensors[name] = torch.zeros(48, 8)  # the base's k_proj has 128 outputs
    save_file(tensors, folder / "misfit" / "adapter_model.safetensors")
    shutil.copytree(adapters_dir / "alpha", folder / "corrupt")
    weights = folder / "corrupt" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (folder / "badjson").mkdir()
    (folder / "badjson" / "adapter_config.json").write_text("{not json")

    engine = LLMEngine(tiny_settings(model=str(tiny_model_path), adapters_dir=str(folder), max_loras=4,
                                     max_lora_rank=8))
    reasons = {"big": ("big/adapter_config.json", "rank 16 is over this worker's limit of 8"),
               "misfit": ("misfit/adapter_model.safetensors", "layer 1 k_proj: lora_A (8, 64) and lora_B (48, 8)"),
               "corrupt": ("corrupt/adapter_model.safetensors", "corrupt or unreadable"),
               "badjson": ("badjson/adapter_config.json", "unreadable"),
               "nowhere": ("unknown adapter 'nowhere'", "")}
    for model, (file, why) in reasons.items():
        [final] = engine.add_request(request(f"bad-{model}", model, prompts["own0"]))
        assert (final.finished, final.finish_reason, final.error_code) == (True, "error", "invalid_request"), final
        assert file in final.error_message and why in final.error_message, final.error_message
    # Asked again, a refused adapter is refused from memory (its files unchanged), not read again.
    [again] = engine.add_request(request("bad-big-again", "big", prompts["own0"]))
    assert again.error_message == engine.add_request(request("bad-big-3", "big", prompts["own0"]))[0].error_message
    assert list(engine.runner.loras.loaded) == []
    done = run(engine, {"good": ("alpha", "own0"), "base": (None, "own0")}, prompts)
    assert {rid: c.finish_reason for rid, c in done.items()} == {"good": "length", "base": "length"}
    assert done["good"].token_ids != done["base"].token_ids
    assert engine.stats().adapters == ("alpha", "badjson", "big", "corrupt", "misfit")
    assert engine.stats().loaded_adapters == ("alpha",)


def test_an_eviction_spares_the_adapters_waiting_requests_name(tiny_model_path, tmp_path):
    """With every slot taken, a new adapter evicts the least recently used one that no waiting request names
    (one that does would load again as soon as its request runs); an adapter named at arrival loads then only
    where a slot is free, and an unknown one is refused at once."""
    import json

    from safetensors.torch import save_file

    from worker.model.config import load_config
    from worker.model.lora import AdapterError, AdapterRegistry, projection_shapes

    config = load_config(tiny_model_path)
    out_size, in_size = projection_shapes(config)["q_proj"]
    for k, name in enumerate(("a", "b", "c", "d")):
        (tmp_path / name).mkdir()
        generator = torch.Generator().manual_seed(k)
        prefix = "base_model.model.model.layers.0.self_attn.q_proj"
        save_file({f"{prefix}.lora_A.weight": torch.randn(2, in_size, generator=generator),
                   f"{prefix}.lora_B.weight": torch.randn(out_size, 2, generator=generator)},
                  tmp_path / name / "adapter_model.safetensors")
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2,
                                                                          "lora_alpha": 2}))
    loras = AdapterRegistry(tmp_path, config, max_loaded=2, max_rank=8, device=torch.device("cpu"),
                            dtype=torch.float32)
    loras.get("a")
    loras.get("b")
    assert loras.get("c", evict=False) is None and list(loras.loaded) == ["a", "b"]  # no slot: nothing moves
    with pytest.raises(AdapterError, match="unknown adapter 'zz'"):
        loras.get("zz", evict=False)
    loras.get("c", in_use=(), wanted={"a"})  # "a" is the least recently used, but a waiting request names it
    assert list(loras.loaded) == ["a", "c"]
    loras.get("d", in_use={"c"}, wanted={"a", "c"})  # every candidate is wanted: the least recently used goes
    assert list(loras.loaded) == ["c", "d"] and (loras.num_loads, loras.num_evictions) == (4, 2)


@pytest.mark.slow  # shares the PEFT reference with the tests above
@pytest.mark.parametrize("resident_first_steps", [0, 8])
def test_a_backlog_goes_to_the_loaded_adapters_first(tiny_model_path, adapters_dir, prompts, expected,
                                                     resident_first_steps):
    engine = LLMEngine(tiny_settings(model=str(tiny_model_path), adapters_dir=str(adapters_dir), max_loras=2,
                                     max_num_seqs=2, max_num_batched_tokens=256,
                                     lora_resident_first_steps=resident_first_steps))
    loras = engine.runner.loras
    run(engine, {"warm-alpha": ("alpha", "own1"), "warm-beta": ("beta", "own1")}, prompts)
    assert (sorted(loras.loaded), loras.num_loads) == (["alpha", "beta"], 2)
    # gamma first in the queue, then requests of the two loaded adapters, two seats.
    cases = {"0-gamma": ("gamma", "own1")} | {f"{i}-{model}": (model, "own2")
                                              for i in range(1, 7) for model in ("alpha", "beta")[i % 2:][:1]}
    done = run(engine, cases, prompts)
    for rid, (model, key) in cases.items():
        assert done[rid].token_ids == expected[model, key][0], rid
    if resident_first_steps:
        # alpha's and beta's requests went first; gamma then evicted one of them, once.
        assert loras.num_loads == 3
        finished = sorted(done, key=lambda rid: done[rid].last.finish_time)
        assert finished.index("0-gamma") >= 4, finished
    else:
        # gamma evicted one at once, and that one came back for the requests behind it.
        assert loras.num_loads >= 4

"""kernels.lora.add_lora against kernels.reference.ref_lora and against the torch path the model runs on a CPU
(worker/model/lora.py, adapters stacked), on random weights: rows of several adapters interleaved with the base's,
ranks padded within the stack, and an output that is a column range of a wider fused projection."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.lora import add_lora
from kernels.reference import ref_lora


def case(device: str, dtype: torch.dtype, num_rows: int = 11, in_size: int = 96, rank: int = 24, width: int = 200,
         num_slots: int = 3, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_size, generator=gen).to(dtype).to(device)
    a = (torch.randn(num_slots, in_size, rank, generator=gen) * 0.1).to(dtype).to(device)
    b = (torch.randn(num_slots, rank, width, generator=gen) * 0.1).to(dtype).to(device)
    a[1, :, rank // 2:] = 0  # a slot of a smaller rank, zero-padded as the stack pads it
    b[1, rank // 2:] = 0
    slots = torch.tensor([(i * 7) % (num_slots + 1) - 1 for i in range(num_rows)], dtype=torch.int64, device=device)
    fused = torch.randn(num_rows, width + 70, generator=gen).to(dtype).to(device)  # the projection's whole output
    return x, slots, a, b, fused


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_add_lora_matches_the_reference_on_a_column_range(device: str, dtype: torch.dtype, tolerance: float):
    x, slots, a, b, fused = case(device, dtype)
    assert set(slots.tolist()) == {-1, 0, 1, 2}
    expected = fused.clone()
    ref_lora(x, slots, a, b, expected[:, 30:230])
    got = fused.clone()
    add_lora(x, slots, a, b, got[:, 30:230])
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    base_rows = slots < 0
    assert torch.equal(got[base_rows], fused[base_rows])  # the base's rows are not touched
    assert torch.equal(got[:, :30], fused[:, :30]) and torch.equal(got[:, 230:], fused[:, 230:])


def test_a_step_mixing_adapters_adds_the_same_through_the_kernel_as_through_torch(device: str):
    """worker/model/lora.py's stacked step, torch path (gather, batched matmuls, scatter) against the kernel path
    the Triton backend takes, on the same stack: the same sums, also with padding rows after the tokens (row
    buckets) that belong to no request."""
    from pathlib import Path

    from worker.model.lora import GroupLora, LoraAdapter, LoraStack, LoraStep

    gen = torch.Generator().manual_seed(3)
    adapters = []
    for k, rank in enumerate((4, 8, 6)):
        a = torch.randn(rank, 40, generator=gen).to(device)
        b = torch.zeros(rank, 50)
        b[:, 5 + k: 45 + k] = torch.randn(rank, 40, generator=gen)
        adapters.append(LoraAdapter(f"ad{k}", Path(f"ad{k}"), rank, 1.0,
                                    [{"o": GroupLora(a, b.to(device), 0, 50)}], f"ad{k}"))
    stack = LoraStack(adapters, num_layers=1)
    per_request = [adapters[2], None, adapters[0], adapters[2], adapters[1]]
    num_new = np.array([2, 3, 1, 1, 2])
    x = torch.randn(int(num_new.sum()) + 3, 40, generator=gen).to(device)  # three padding rows
    out = torch.randn(x.shape[0], 60, generator=gen).to(device)  # the group's columns 0:50 of a wider output
    by_torch = LoraStep.build(per_request, num_new, torch.device(device), stack)
    by_kernel = LoraStep.build(per_request, num_new, torch.device(device), stack, use_kernel=True)
    assert by_kernel.stacked.use_kernel and not by_torch.stacked.use_kernel
    expected = by_torch.layer(0).add("o", x, out.clone())
    got = by_kernel.layer(0).add("o", x, out.clone())
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[num_new.sum():], out[num_new.sum():])  # padding rows untouched
    assert torch.equal(got[2:5], out[2:5])  # the base request's rows too


def test_add_lora_refuses_shapes_that_do_not_chain(device: str):
    x, slots, a, b, fused = case(device, torch.float32)
    with pytest.raises(ValueError, match="do not chain"):
        add_lora(x, slots, a, b[:, :, :-1], fused[:, :200])
    with pytest.raises(ValueError, match="slots has"):
        add_lora(x, slots[:-1], a, b, fused[:, :200])

"""Benchmark the Triton attention kernels against a vectorized torch path on the same CUDA device.

Decode is memory-bound: the figure of merit is achieved bandwidth (K/V bytes read + q/out bytes) as a
fraction of the device's peak. Prefill is compute-bound: causal attention TFLOP/s. The torch baseline
gathers each request's K/V out of the paged cache with one index op and runs scaled_dot_product_attention
on the padded batch (what a framework without paged kernels does); `TorchAttention` (the worker's CPU
backend) is timed beside `TritonAttention` end to end (K/V write included) where it imports.

    python benchmarks/bench_kernels.py [--peak-gbps 4800] [--json path] [--quick]

Needs CUDA; on a machine without it, says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# HBM peak in GB/s by device-name substring; first match wins. PCIe/NVL H100 variants have other peaks.
PEAK_GBPS = [("H200", 4800.0), ("H100 PCIe", None), ("H100 NVL", None), ("H100", 3350.0), ("A100 80GB", 2000.0),
             ("A100-SXM4-80GB", 2000.0)]


@dataclass
class Row:
    case: str
    impl: str
    ms: float
    gbps: float | None = None
    peak_fraction: float | None = None
    tflops: float | None = None
    note: str = ""


@dataclass
class Paged:
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, M] int32, shuffled block ids
    seq_lens: torch.Tensor  # [B] int32
    slots: torch.Tensor  # [B, L] int64 flat slots of every context position (L = max seq_len)


def make_paged(batch: int, seq_len: int, num_kv_heads: int, head_dim: int, block_size: int, dtype,
               device: str = "cuda") -> Paged:
    blocks_per_req = -(-seq_len // block_size)
    num_blocks = batch * blocks_per_req
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    block_tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_req).int()
    pos = torch.arange(seq_len, device=device)
    slots = block_tables.long()[:, pos // block_size] * block_size + pos % block_size  # [B, L]
    return Paged(torch.randn(shape, device=device, dtype=dtype), torch.randn(shape, device=device, dtype=dtype),
                 block_tables, torch.full((batch,), seq_len, dtype=torch.int32, device=device), slots)


def gather_kv(p: Paged) -> tuple[torch.Tensor, torch.Tensor]:
    # [B, Hkv, L, D] contiguous copies of each request's context, as SDPA wants them
    num_kv_heads, head_dim = p.k_cache.shape[2:]
    k = p.k_cache.view(-1, num_kv_heads, head_dim)[p.slots].transpose(1, 2)
    v = p.v_cache.view(-1, num_kv_heads, head_dim)[p.slots].transpose(1, 2)
    return k, v


def torch_decode(q: torch.Tensor, p: Paged, scale: float) -> torch.Tensor:
    k, v = gather_kv(p)  # equal lengths: no mask needed
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, scale=scale, enable_gqa=True).squeeze(2)


def torch_prefill(q: torch.Tensor, p: Paged, q_len: int, scale: float) -> torch.Tensor:
    # q: [B * q_len, Hq, D], each request's q_len newest positions; equal lengths batch into one SDPA call
    batch, seq_len = p.slots.shape
    k, v = gather_kv(p)
    qb = q.view(batch, q_len, *q.shape[1:]).transpose(1, 2)  # [B, Hq, q_len, D]
    pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= pos[:, None]  # [q_len, L]
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape)


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def decode_rows(name, batch, seq_len, peak, heads=(32, 8), head_dim=128, block_size=16) -> list[Row]:
    from kernels.paged_decode import choose_num_splits, paged_decode_attention

    num_q_heads, num_kv_heads = heads
    p = make_paged(batch, seq_len, num_kv_heads, head_dim, block_size, torch.bfloat16)
    q = torch.randn(batch, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    scale = head_dim**-0.5
    nbytes = 2 * p.slots.numel() * num_kv_heads * head_dim * 2 + 2 * q.numel() * 2 + p.block_tables.numel() * 4
    splits = choose_num_splits(batch * num_kv_heads, seq_len, torch.cuda.get_device_properties(0).multi_processor_count)
    ref = torch_decode(q, p, scale)
    rows = []
    impls = [(f"triton auto ({splits} splits)", lambda: paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables,
                                                                              p.seq_lens, scale)),
             ("triton 1 split", lambda: paged_decode_attention(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens,
                                                               scale, num_splits=1)),
             ("torch gather+SDPA", lambda: torch_decode(q, p, scale))]
    for impl, fn in impls:
        err = (fn().float() - ref.float()).abs().max().item()
        ms = bench(fn)
        gbps = nbytes / ms / 1e6
        rows.append(Row(name, impl, ms, gbps, gbps / peak if peak else None, note=f"max|diff| vs torch {err:.2e}"))
    return rows


def prefill_rows(name, batch, q_len, seq_len, heads=(32, 8), head_dim=128, block_size=16) -> list[Row]:
    from kernels.ragged_prefill import ragged_prefill_attention

    num_q_heads, num_kv_heads = heads
    p = make_paged(batch, seq_len, num_kv_heads, head_dim, block_size, torch.bfloat16)
    q = torch.randn(batch * q_len, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda")
    scale = head_dim**-0.5
    # causal: query i of a request sees (seq_len - q_len + i + 1) keys; QK^T and PV are 2 flops per MAC each
    keys_seen = sum(seq_len - q_len + i + 1 for i in range(q_len))
    flops = 4 * batch * num_q_heads * head_dim * keys_seen
    ref = torch_prefill(q, p, q_len, scale)
    rows = []
    impls = [("triton ragged", lambda: ragged_prefill_attention(q, p.k_cache, p.v_cache, qsl, p.seq_lens,
                                                                p.block_tables, scale, q_len)),
             ("torch gather+SDPA", lambda: torch_prefill(q, p, q_len, scale))]
    for impl, fn in impls:
        err = (fn().float() - ref.float()).abs().max().item()
        ms = bench(fn)
        rows.append(Row(name, impl, ms, tflops=flops / ms / 1e9, note=f"max|diff| vs torch {err:.2e}"))
    return rows


def backend_rows(name, batch, seq_len, heads=(32, 8), head_dim=128, block_size=16) -> list[Row]:
    """Both attention backends end to end for one decode step (K/V write + attention), as the model calls them."""
    from worker.model.input import AttentionMetadata
    from worker.model.triton_attention import TritonAttention

    backends = [TritonAttention()]
    try:
        from worker.model.torch_attention import TorchAttention

        backends.append(TorchAttention())
    except ImportError as exc:
        print(f"TorchAttention not importable, skipped: {exc}", file=sys.stderr)
    num_q_heads, num_kv_heads = heads
    p = make_paged(batch, seq_len, num_kv_heads, head_dim, block_size, torch.bfloat16)
    q = torch.randn(batch, num_q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    meta = AttentionMetadata(
        slot_mapping=p.slots[:, -1].contiguous(), query_start_loc=torch.arange(batch + 1, dtype=torch.int32,
                                                                                 device="cuda"),
        seq_lens=p.seq_lens, block_tables=p.block_tables, max_query_len=1, max_seq_len=seq_len,
    )
    return [Row(name, f"{b.name} backend", bench(lambda b=b: b.forward(q, k, k, p.k_cache, p.v_cache, meta,
                                                                       head_dim**-0.5))) for b in backends]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-gbps", type=float, help="device HBM peak, GB/s (default: known-device table)")
    out_dir = Path(os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--json", type=Path, default=out_dir / "bench_kernels.json")
    parser.add_argument("--quick", action="store_true", help="fewer cases (a smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU: torch.cuda.is_available() is False here. Nothing measured.",
              file=sys.stderr)
        return 2
    os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels only
    name = torch.cuda.get_device_name(0)
    peak = args.peak_gbps or next((gbps for key, gbps in PEAK_GBPS if key in name), None)
    print(f"device: {name}; HBM peak: {f'{peak:.0f} GB/s' if peak else 'unknown (pass --peak-gbps)'}")
    torch.manual_seed(0)

    rows = decode_rows("decode B=64 L=2048 Hq=32 Hkv=8 D=128 bf16", 64, 2048, peak)
    rows += decode_rows("decode B=4 L=32768 Hq=32 Hkv=8 D=128 bf16", 4, 32768, peak)
    rows += prefill_rows("prefill B=4 q=2048 fresh Hq=32 Hkv=8 D=128 bf16", 4, 2048, 2048)
    if not args.quick:
        rows += decode_rows("decode B=256 L=1024 Hq=9 Hkv=3 D=64 bf16 (SmolLM2)", 256, 1024, peak, (9, 3), 64)
        rows += prefill_rows("prefill B=4 q=512 after 1536 cached Hq=32 Hkv=8 D=128 bf16", 4, 512, 2048)
        rows += backend_rows("backend decode step B=64 L=2048 Hq=32 Hkv=8 D=128 bf16", 64, 2048)

    header = f"{'case':<58} {'impl':<26} {'ms':>9} {'GB/s':>8} {'of peak':>8} {'TFLOP/s':>8}  note"
    print(header)
    print("-" * len(header))
    for r in rows:
        gbps = f"{r.gbps:8.0f}" if r.gbps else f"{'':>8}"
        frac = f"{r.peak_fraction:8.1%}" if r.peak_fraction else f"{'':>8}"
        tfl = f"{r.tflops:8.1f}" if r.tflops else f"{'':>8}"
        print(f"{r.case:<58} {r.impl:<26} {r.ms:9.4f} {gbps} {frac} {tfl}  {r.note}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"device": name, "peak_gbps": peak, "rows": [asdict(r) for r in rows]}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

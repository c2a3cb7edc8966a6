"""Argument checks shared by the kernel wrappers.

A Triton kernel handed a wrong shape, dtype or stride reads or writes the wrong memory without a word, so
every wrapper checks its inputs on the host first and raises ValueError with a message naming the argument.
The checks read only shapes, dtypes, strides and devices: none of them synchronizes with the GPU.
"""

from __future__ import annotations

import torch

ATTENTION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {layout} ({ndim} dims), got shape {tuple(t.shape)}")


def check_dtype(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise ValueError(f"{name} dtype must be one of {[str(d) for d in allowed]}, got {t.dtype}")


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    # Kernels vectorize loads along the head dim; other strides are passed through as arguments.
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have stride 1 in its last dim, got strides {t.stride()}")


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        listed = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listed}")


def check_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Both caches [num_blocks, block_size, Hkv, D], same shape and dtype, contiguous (the fixed layout that
    the flat slot id block_id * block_size + offset indexes). Returns (num_blocks, block_size, Hkv, D)."""
    layout = "[num_blocks, block_size, Hkv, D]"
    check_ndim("k_cache", k_cache, 4, layout)
    check_ndim("v_cache", v_cache, 4, layout)
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache shapes differ: {tuple(k_cache.shape)} vs {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    check_dtype("k_cache", k_cache, ATTENTION_DTYPES)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {cache.stride()}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if num_blocks == 0 or block_size == 0 or num_kv_heads == 0 or head_dim == 0:
        raise ValueError(f"KV cache dims must be non-zero, got shape {tuple(k_cache.shape)}")
    return num_blocks, block_size, num_kv_heads, head_dim


def check_index_tensor(name: str, t: torch.Tensor, ndim: int, layout: str, dtype: torch.dtype) -> None:
    check_ndim(name, t, ndim, layout)
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_query_heads(q_name: str, num_q_heads: int, num_kv_heads: int) -> int:
    """Returns the GQA group size Hq // Hkv."""
    if num_q_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"{q_name} heads ({num_q_heads}) must be a non-zero multiple of the cache's KV heads ({num_kv_heads})"
        )
    return num_q_heads // num_kv_heads


def check_query_and_cache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: str
) -> tuple[int, int, int, int]:
    """Checks the attention query against the paged cache; returns (block_size, Hkv, D, group size Hq // Hkv)."""
    _, block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    check_ndim("q", q, 3, layout)
    check_dtype("q", q, ATTENTION_DTYPES)
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the KV cache dtype {k_cache.dtype}")
    if q.shape[2] != head_dim:
        raise ValueError(f"q head dim {q.shape[2]} differs from the KV cache head dim {head_dim}")
    check_last_dim_contiguous("q", q)
    group_size = check_query_heads("q", q.shape[1], num_kv_heads)
    return block_size, num_kv_heads, head_dim, group_size


def check_scale(scale: float) -> float:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
        raise ValueError(f"scale must be a positive float, got {scale!r}")
    return float(scale)


def window_arg(window: int | None) -> int:
    """A sliding window as the kernels take it (their HAS_WINDOW says whether it is read): a positive int."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    return window


def softcap_arg(softcap: float | None) -> float:
    """A soft cap as the kernels take it (in base-2 units, like their scores; HAS_SOFTCAP says whether it is
    read): softcap * log2(e)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    return float(softcap) * 1.4426950408889634

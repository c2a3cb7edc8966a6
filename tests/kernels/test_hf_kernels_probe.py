"""Our top-level `kernels` package shares its import name with Hugging Face's `kernels`; transformers probes
that name (accepting versions 0.18.2 to < 0.19 of whatever distribution provides it) and would route model
layers to it if the probe said yes. Our project version (0.3.0) keeps the probe False."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import kernels


def test_transformers_does_not_take_our_kernels_package_for_hugging_faces() -> None:
    is_kernels_available = pytest.importorskip("transformers.utils.import_utils").is_kernels_available

    # The probe does find a `kernels` package, and it is this repository's (not Hugging Face's)...
    spec = importlib.util.find_spec("kernels")
    assert spec is not None and Path(spec.origin).resolve() == Path(kernels.__file__).resolve()
    # ...so only the version check keeps it from being taken for Hugging Face's.
    is_kernels_available.cache_clear()
    assert is_kernels_available() is False

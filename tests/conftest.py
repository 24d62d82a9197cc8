"""What the `gpu` and `nvcc` markers need, checked in one place.

`@pytest.mark.gpu`: the test runs kernels on a CUDA GPU; it is skipped when torch is missing or
sees no GPU. `@pytest.mark.nvcc`: the test runs the CUDA toolkit's compiler (found as
`specgen.compile.find_nvcc` finds it: $CUDA_HOME/bin, PATH, /usr/local/cuda); it is skipped when
there is none. A module marks all its tests with `pytestmark = pytest.mark.gpu`.

Each check runs once per session, before any test has changed the environment (some tests hide
nvcc or pretend a GPU is there with monkeypatch), and only when a collected test carries the marker.
"""

from __future__ import annotations

import functools

import pytest


@functools.cache
def gpu_missing() -> str | None:
    """Why GPU tests cannot run here, or None when they can."""
    try:
        import torch
    except ImportError:
        return "needs a CUDA GPU: torch is not installed"
    if not torch.cuda.is_available():
        return "needs a CUDA GPU: torch.cuda.is_available() is False"
    return None


@functools.cache
def nvcc_missing() -> str | None:
    """Why tests that run nvcc cannot run here, or None when they can."""
    from specgen.compile import find_nvcc

    try:
        find_nvcc()
    except FileNotFoundError as err:
        return f"needs nvcc: {err}"
    return None


_CHECKS = {"gpu": gpu_missing, "nvcc": nvcc_missing}


@pytest.fixture(autouse=True)
def _small_batch_tile(request, monkeypatch):
    """The small-batch rules (`pipeline.small_batch_config`, off unless SPECGEN_SMALL_BATCH=1, and
    the depthwise box of one tile a thread, `pipeline.small_batch_settings`, on unless
    SMALL_BATCH_SPREAD is false) are on for the tests marked `small_batch` (the rules' own) and off
    for every other test, whatever the environment says: each engine's tests run the engine's
    own plan at the small batches they use."""
    from specgen import pipeline

    marked = request.node.get_closest_marker("small_batch") is not None
    monkeypatch.setenv("SPECGEN_SMALL_BATCH", "1" if marked else "0")
    monkeypatch.setattr(pipeline, "SMALL_BATCH_SPREAD", marked)


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker, missing in _CHECKS.items():
            if item.get_closest_marker(marker) is not None and (reason := missing()) is not None:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def fp32_reference():
    """PyTorch's references in full fp32 (TF32 off) for the test, the switches restored after.
    GPU modules take it with `pytest.mark.usefixtures("fp32_reference")`."""
    from gpu_helpers import tf32_allowed

    with tf32_allowed(False):
        yield

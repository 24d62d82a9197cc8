"""The weights derived from a layer's tensors (widened to float32, permuted for the implicit
GEMM, laid out for TMA) are kept per tensor and remade when the tensor changes: after an in-place
update (its version counter) and after `w.data = ...` (same object and version, new storage)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specgen import tmarun, torchop  # noqa: E402


def test_kept_derived_weights_follow_new_storage():
    """Kept until the tensor changes; after `w.data = ...` the old ones would be stale (a layer whose
    weight storage was replaced computed with the old weights)."""
    w = torch.nn.Parameter(torch.randn(4, 3, 3, 3))
    first = tmarun.derived(w, "test:negated", lambda v: -v)
    assert tmarun.derived(w, "test:negated", lambda v: -v) is first
    w.data = torch.randn(4, 3, 3, 3)
    assert torch.equal(tmarun.derived(w, "test:negated", lambda v: -v), -w.detach())
    layout = (3, 9, 4, 16)  # (c_in, taps, padded c_in, padded taps)
    permuted = torchop.gemm_weight(w, layout)
    w.data = torch.randn(4, 3, 3, 3)
    again = torchop.gemm_weight(w, layout)
    assert torch.equal(again[:, :9, :3], w.detach().reshape(4, 3, 9).transpose(1, 2)) and not torch.equal(again, permuted)


def test_a_view_made_per_call_is_kept_per_the_tensor_it_views():
    """An imported Linear's weight reaches the op as a fresh view every training call ([C_out, C_in]
    seen as [C_out, C_in, 1, 1]): its derived tensor is made once, not per view object, and made
    again after the weight changes in place; another view of other extents gets its own."""
    w = torch.nn.Parameter(torch.randn(8, 4))
    made = []

    def negated(v):
        made.append(tuple(v.shape))
        return -v

    first = tmarun.derived(w.view(8, 4, 1, 1), "test:view", negated)
    assert tmarun.derived(w.view(8, 4, 1, 1), "test:view", negated) is first and made == [(8, 4, 1, 1)]
    other = tmarun.derived(w.view(4, 8, 1, 1), "test:view", negated)
    assert other.shape == (4, 8, 1, 1) and len(made) == 2
    with torch.no_grad():
        w.add_(1.0)
    again = tmarun.derived(w.view(8, 4, 1, 1), "test:view", negated)
    assert len(made) == 3 and torch.equal(again, -w.detach().view(8, 4, 1, 1))

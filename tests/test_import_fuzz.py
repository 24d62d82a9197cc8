"""Fuzz the importer with random small conv nets (`random_models`): `explain` and `from_module`
never raise on a model that runs, and the rewritten model computes the original whichever chains
a timing would keep as PyTorch (the choices drawn too). Without a GPU each fused layer runs its
spec's PyTorch reference, so this checks what the importer reads from the graph: every op's
meaning, its arguments and the rewiring around the chains, joins and pools; and the imported model
traces whole under torch.compile."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from random_models import force_choices, outputs, random_nets  # noqa: E402
from specgen.importer import explain, from_module  # noqa: E402

FUZZ = settings(max_examples=200, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(net=random_nets(max_steps=10), mask=st.lists(st.sampled_from([True, True, False]), min_size=8, max_size=8),
       training=st.sampled_from([False, False, False, True]),
       standalone=st.one_of(st.none(), st.lists(st.booleans(), min_size=6, max_size=6)))
def test_a_random_net_imports_and_computes_itself(net, mask, training, standalone):
    """In eval mode, or in training mode (batch norms as their batch-statistic stage); the joins'
    and pools' choices drawn too, or left undecided (no GPU: all run by their kernels)."""
    model, x = net
    model.train(training)
    with torch.no_grad():
        try:
            want = copy.deepcopy(model)(x)
        except ValueError:  # (a batch norm in training mode over one value per channel: PyTorch refuses)
            assume(False)
    report = explain(model, x)  # (never raises on a model that runs)
    assert len(report.specs) == len(report.choices) or not report.choices, str(report)

    with pytest.MonkeyPatch.context() as mp:
        force_choices(mp, lambda i: mask[i % len(mask)], None if standalone is None else lambda i: standalone[i % 6])
        with torch.no_grad():
            fused = from_module(copy.deepcopy(model), x)
            got = fused(x)
    for g, w in zip(outputs(got), outputs(want), strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, model.describe()
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m: f"{m}\n{model.describe()}\n{report}")


@settings(max_examples=40, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(net=random_nets(max_steps=8))
def test_a_random_net_s_import_traces_whole_under_torch_compile(net):
    """torch.compile(fullgraph=True) of the imported model: every fused layer, join and pool is a
    custom op the trace takes whole (aot_eager: the graph as traced, run on the CPU)."""
    model, x = net
    with torch.no_grad():
        try:
            want = model(x)
        except ValueError:
            assume(False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: False)
        with torch.no_grad():
            fused = from_module(copy.deepcopy(model), x)
            assume(hasattr(fused, "specgen_report") and fused.specgen_report.specs)
            torch._dynamo.reset()
            got = torch.compile(fused, fullgraph=True, backend="aot_eager")(x)
    for g, w in zip(outputs(got), outputs(want), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=lambda m: f"{m}\n{model.describe()}")

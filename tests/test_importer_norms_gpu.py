"""The statistic stages through from_module on the GPU (marker `gpu`): the public KernelBench problems
that import whole, at batch 1 and 3, in eval and in training mode, against a float64 copy of the
model at the spec's precision bar (fp32: the `fp32_reference` fixture turns TF32 off, so chains are
fp32); a training-mode batch norm's running statistics after a few training steps against PyTorch's;
and from_module's timing, which must leave them as they were."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402

import import_models as im  # noqa: E402
import kernelbench_problems as kb  # noqa: E402
from specgen.importer import from_module  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402

from gpu_helpers import FP32_ATOL, FP32_RTOL, assert_fp32  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]

MODES = {False: "eval", True: "train"}


def _layers(module: nn.Module) -> list[FusedLayer]:
    return [m for m in module.modules() if isinstance(m, FusedLayer)]


def _double(values):
    return [v.double() if isinstance(v, torch.Tensor) else v for v in values]


def _assert_buffers_close(what: str, model: nn.Module, reference: nn.Module) -> None:
    """Running statistics within the fp32 bar of the reference's (float64 or fp32); batch counts equal."""
    mine, theirs = dict(model.named_buffers()), dict(reference.named_buffers())
    assert mine.keys() == theirs.keys(), what
    for name, want in theirs.items():
        got = mine[name]
        if got.dtype == torch.int64:
            assert torch.equal(got, want), f"{what}: {name} {got.item()} != {want.item()}"
        else:
            torch.testing.assert_close(got.double(), want.double(), rtol=FP32_RTOL, atol=FP32_ATOL, msg=f"{what}: {name}")


def _cases():
    for path in kb.problems():
        for training, names in ((False, kb.FUSED), (True, kb.FUSED_TRAIN)):
            if path.stem in names:
                for batch in (1, 3):
                    yield pytest.param(path, training, batch, id=f"{path.stem}-{MODES[training]}-batch{batch}")


@pytest.mark.parametrize("path, training, batch", list(_cases()))
def test_kernelbench_problems_fused_whole_match_float64(path, training, batch):
    """Each problem that imports into one spec, fused (every chain as its kernel), against the model
    in float64 and in fp32; in training mode the running statistics it updated too."""
    model, inputs = kb.load(path, training=training, batch=batch)
    model = kb.randomize_batch_norms(model).cuda()
    inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in inputs]
    ref64 = copy.deepcopy(model).double()
    ref32 = copy.deepcopy(model)
    fused = from_module(model, *inputs, keep_slower=True)
    report = fused.specgen_report
    assert len(report.specs) == 1 and not report.fallbacks, str(report)
    (layer,) = _layers(fused)
    assert layer.key and layer.spec.precision == "fp32", layer.spec.precision
    what = f"{path.stem} at batch {batch} ({MODES[training]})"
    with torch.no_grad():
        got = fused(*inputs)
        torch.cuda.synchronize()
        want64 = ref64(*_double(inputs))
        want32 = ref32(*inputs)
    assert_fp32(what, got, want64, want32)
    if training:
        _assert_buffers_close(what, model, ref64)


def _training_steps(model: nn.Module, steps: int, batch: int, shape: tuple, seed: int = 0) -> None:
    """`steps` SGD steps of a squared-output loss on fresh random inputs."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randn((batch, *shape), device="cuda", generator=gen)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize("kw", [{}, {"momentum": None}, {"affine": False}], ids=["default", "cumulative", "no-affine"])
def test_running_statistics_after_training_steps_equal_pytorchs(kw):
    """A few training steps of the fused model and of the plain one: the same running statistics and
    batch count (the fused model's are the model's own buffers), then the same eval-mode output."""
    torch.manual_seed(0)
    model = kb.randomize_batch_norms(im.BatchNormTraining(**kw)).cuda().train()
    plain = copy.deepcopy(model)
    shape = im.IMG[1:]
    fused = from_module(model, torch.randn(im.IMG, device="cuda"), keep_slower=True)
    (layer,) = _layers(fused)
    assert layer.key and layer.bn_running_mean is model.bn.running_mean
    _training_steps(fused, 3, 5, shape)
    _training_steps(plain, 3, 5, shape)
    _assert_buffers_close("after 3 steps", model, plain)
    assert int(model.bn.num_batches_tracked) == 3
    fused.eval(), plain.eval()
    x = torch.randn((3, *shape), device="cuda")
    with torch.no_grad():
        got = fused(x)
        want32 = plain(x)
        want64 = copy.deepcopy(plain).double()(x.double())
    assert_fp32("eval after training", got, want64, want32)


@pytest.mark.parametrize("path", [pytest.param(p, id=p.stem) for p in kb.problems()
                                  if p.stem in kb.FUSED_TRAIN and "BatchNorm" in p.stem])
def test_kernelbench_running_statistics_after_training_steps(path):
    """The KernelBench batch norms, trained a few steps at batch 3 fused and as PyTorch (fp32)."""
    model, inputs = kb.load(path, training=True, batch=3)
    model = kb.randomize_batch_norms(model).cuda()
    plain = copy.deepcopy(model)
    shape = tuple(inputs[0].shape[1:])
    fused = from_module(model, inputs[0].cuda(), keep_slower=True)
    _training_steps(fused, 3, 3, shape)
    _training_steps(plain, 3, 3, shape)
    _assert_buffers_close(path.stem, model, plain)


def test_timing_leaves_running_statistics_as_they_were():
    """from_module times each chain and the whole model (dozens of training-mode forwards): the
    model's buffers come out as they went in."""
    model = kb.randomize_batch_norms(im.BatchNormTraining()).cuda().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    from_module(model, torch.randn((8, *im.IMG[1:]), device="cuda"))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before if not torch.equal(before[k], after[k])]

"""The concatenation kernel on the GPU (marker `gpu`; skipped without CUDA): exact against
PyTorch's upsample and cat for each dtype, output layout and source layout, 1-D to 3-D, odd
extents and channel counts, batches 1 and 3, on memory poisoned first, each call twice (the
second by the recorded launch, on new values); under CUDA-graph capture;
and a UNet imported whole, its decoder's joins written channels-last for the convs after them."""

from __future__ import annotations

import copy
import itertools

import pytest

torch = pytest.importorskip("torch")

from example_models import example_models  # noqa: E402
from specgen import from_module  # noqa: E402
from specgen.concat import ConcatLayer, ConcatPlan, Source, reference  # noqa: E402

from gpu_helpers import assert_model_bar, tf32_allowed  # noqa: E402


pytestmark = [pytest.mark.gpu]

# name -> (sources as (channels, size, factors), output size)
SHAPES = {
    "unet_2d": ([(40, (7, 9), (2, 2)), (24, (14, 18), (1, 1))], (14, 18)),
    "three_2d": ([(3, (5, 5), (3, 1)), (33, (15, 5), (1, 1)), (1, (3, 5), (5, 1))], (15, 5)),
    "up_3d": ([(9, (2, 3, 4), (2, 2, 2)), (5, (4, 6, 8), (1, 1, 1))], (4, 6, 8)),
    "conv1d": ([(6, (11,), (3,)), (35, (33,), (1,))], (33,)),
    # odd channel counts and offsets beside even ones, an odd factor along an even width
    "mixed": ([(5, (6, 8), (1, 1)), (6, (3, 4), (2, 2)), (4, (6, 8), (1, 1)), (3, (6, 2), (1, 4))], (6, 8)),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CL = {4: torch.channels_last, 5: torch.channels_last_3d}


def _values(shapes, batch, dtype, layouts, gen):
    out = []
    for (c, size, _), cl in zip(shapes, layouts):
        t = torch.randn((batch, c, *size), generator=gen, device="cuda").to(dtype)
        out.append(t.contiguous(memory_format=_CL[t.dim()]) if cl else t)
    return out


def _poison_allocator(nbytes: int) -> None:
    """Hand the caching allocator a freed block of NaNs, so an output it allocates next that the
    kernel does not fill shows it."""
    torch.full((nbytes // 2 + 64,), float("nan"), device="cuda", dtype=torch.float16)


CASES = [(name, dtype, cl, tile) for name in SHAPES for dtype in DTYPES
         for cl in ([False, True] if name != "conv1d" else [False]) for tile in (32, 64)]


@pytest.mark.parametrize("name, dtype, channels_last, tile", CASES)
def test_the_kernel_is_pytorch_s_upsample_and_cat_exactly(name, dtype, channels_last, tile):
    shapes, size = SHAPES[name]
    plan = ConcatPlan(tuple(Source(c, s, f) for c, s, f in shapes), size, dtype, channels_last, tile)
    layer = ConcatLayer(plan)
    gen = torch.Generator(device="cuda").manual_seed(len(CASES))
    nd = len(size)
    layout_choices = [(False,) * len(shapes)] + ([] if nd == 1 else [(True,) * len(shapes), (True,) + (False,) * (len(shapes) - 1)])
    for batch, layouts, _ in itertools.product((1, 3), layout_choices, range(2)):  # (the second call alike: replayed)
        values = _values(shapes, batch, DTYPES[dtype], layouts, gen)
        want = reference(values, [f for _, _, f in shapes])
        _poison_allocator(want.numel() * want.element_size())
        with torch.no_grad():
            got = layer(*values)
        torch.cuda.synchronize()
        fmt = _CL[want.dim()] if channels_last else torch.contiguous_format
        assert got.is_contiguous(memory_format=fmt) and got.dtype == want.dtype
        assert torch.equal(got, want), (batch, layouts, (got != want).sum().item())


def test_a_strided_source_is_made_contiguous_first_and_autograd_runs_pytorch_s():
    plan = ConcatPlan((Source(8, (4, 4), (2, 2)), Source(4, (8, 8), (1, 1))), (8, 8), "float32", True)
    layer = ConcatLayer(plan)
    a = torch.randn(2, 16, 4, 4, device="cuda")[:, ::2]  # (every other channel: neither layout)
    b = torch.randn(2, 4, 8, 8, device="cuda")
    with torch.no_grad():
        assert torch.equal(layer(a, b), reference([a, b], [(2, 2), (1, 1)]))
    a = a.clone().requires_grad_()
    layer(a, b).sum().backward()
    assert torch.equal(a.grad, torch.full_like(a, 4.0))  # (each value read by a 2 x 2 block)


def test_it_replays_from_a_cuda_graph():
    plan = ConcatPlan((Source(16, (6, 6), (2, 2)), Source(8, (12, 12), (1, 1))), (12, 12), "bfloat16", True)
    layer = ConcatLayer(plan)
    a = torch.randn(3, 16, 6, 6, device="cuda").bfloat16()
    b = torch.randn(3, 8, 12, 12, device="cuda").bfloat16()
    with torch.no_grad():
        layer(a, b)  # (warm: argument arrays made)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            out = layer(a, b)
        torch.cuda.current_stream().wait_stream(stream)
        a.copy_(torch.randn_like(a))
        b.copy_(torch.randn_like(b))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, reference([a, b], [(2, 2), (1, 1)]))


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_a_unet_imported_whole_joins_its_decoder_and_matches(precision):
    models = example_models()

    torch.manual_seed(0)
    model = models.UNet.make().cuda().eval()
    x = models.UNet.example_input(2, device="cuda", seed=1)
    if precision == "bf16":
        model, x = model.bfloat16(), x.bfloat16()
    fused = from_module(copy.deepcopy(model), x, keep_slower=True, cuda_graph=False,
                        precision=None if precision == "bf16" else precision)
    joins = [m for m in fused.modules() if isinstance(m, ConcatLayer)]
    assert len(joins) == 3, str(fused.specgen_report)
    # fp32 mode's convs read two operand planes (a layout pass either way): the joins write NC(D)HW;
    # in the other modes the decoder's convs (on the TMA engine) read channels-last in place
    layouts = [j.plan.channels_last for j in joins]
    assert not any(layouts) if precision == "fp32" else all(layouts), layouts
    with torch.no_grad():
        got = fused(x)
        assert got.is_contiguous()
        ref64 = copy.deepcopy(model).double()(x.double())
        with tf32_allowed(precision == "tf32"):
            ref = model(x)
    if precision == "bf16":
        from gpu_helpers import rel_l2

        assert rel_l2(got.float(), ref64) <= 2 * max(rel_l2(ref.float(), ref64), 2.0**-8)
    else:
        assert_model_bar(got, ref64, ref, precision)


def test_torch_compile_of_an_imported_unet_traces_its_joins_whole():
    models = example_models()

    torch.manual_seed(0)
    model = models.UNet.make().cuda().eval().bfloat16()
    x = models.UNet.example_input(2, small=True, device="cuda", seed=3).bfloat16()
    fused = from_module(copy.deepcopy(model), x, keep_slower=True, cuda_graph=False)
    assert len([m for m in fused.modules() if isinstance(m, ConcatLayer)]) == 3
    with torch.no_grad():
        want = fused(x)
        got = torch.compile(fused, fullgraph=True)(x)
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)

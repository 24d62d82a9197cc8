"""A bf16 / fp16 layer on the FFMA engine reads its input and writes its output in their own 16-bit
type (plan io_ctype): loads widen exactly, the arithmetic is fp32, each output is rounded once as it
is stored. No widening pass before the kernel and no rounding copy after it. Rendering and nvcc;
the numbers are test_sixteen_bit_ffma_gpu.py's."""
from __future__ import annotations

import re

import pytest
from sixteen_bit_specs import CTYPE, FFMA_16, spec

from specgen import pipeline
from specgen.plan import build_plan
from specgen.render import render_plan

PRECISIONS = ["bf16", "fp16"]


def _x_reads(src: str) -> list[str]:
    """Every read of the input in the level functions: the loads from a `row` pointer."""
    return re.findall(r"(\w+(?:<[^>]*>)?\((?:reinterpret_cast<[^>]*>\()?row \+ [^;]*?)\)", src)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", list(FFMA_16))
def test_the_ffma_engine_reads_and_writes_a_16_bit_layer_in_its_own_type(name, precision):
    plan = build_plan(spec(name, precision))
    ctype = CTYPE[precision]
    assert plan["engine"] == "ffma" and plan["io_ctype"] == ctype
    src = render_plan(plan)
    assert f"const {ctype}* __restrict__ x," in src and f"    {ctype}* __restrict__ out," in src
    reads = _x_reads(src)
    assert reads and all(r.startswith(("load_x(", "load_x2(", "load_x4(")) for r in reads), reads
    # every store of a value into out rounds it: to_out, or the packed store_out2 / store_out4
    stores = re.findall(r"(?:out_n\[[^;]*|dst\[[^;]*|store_out\d\([^;]*);", src)
    assert stores and all("to_out(" in s or s.startswith("store_out") for s in stores), stores


@pytest.mark.parametrize("name, loads, stores", [("grouped_vec", "load_x4(row + iw0 + o)", "store_out2(dst + i"),
                                                 ("depthwise", "load_x4(row + lo + o)", "store_out4(dst + i"),
                                                 ("dw_maxpool", "load_x(row + iw0 + o)", "] = to_out(v[j][i]);")])
def test_vector_loads_and_stores_move_16_bit_values(name, loads, stores):
    src = render_plan(build_plan(spec(name, "bf16")))
    assert loads in src and stores in src


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
def test_a_float_layer_keeps_its_direct_loads_and_stores(precision):
    plan = build_plan(spec("grouped_vec", precision))
    assert plan["engine"] == "ffma" and plan["io_ctype"] == "float"
    src = render_plan(plan)
    assert "load_x" not in src and "to_out" not in src and "store_out" not in src
    assert "__ldg(reinterpret_cast<const float4*>(row + iw0 + o))" in src


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_pool_splits_pool_kernel_reads_the_bodys_16_bit_output(precision):
    plan = build_plan(spec("pool_split", precision))
    body, rest = plan.parts[0].plan, plan.parts[1].plan
    assert body.engine == "tma" and rest.engine == "ffma" and rest.io_ctype == CTYPE[precision]
    assert rest.levels[1]["row_span"]["vec"] == 2
    assert "load_x2(row + lo + o)" in render_plan(rest)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_layout_pass_of_a_16_bit_ffma_layer_keeps_the_16_bit_type(precision):
    """A channels-last input is only transposed for a kernel that reads 16 bits (no widening)."""
    ctype = CTYPE[precision]
    src = render_plan(build_plan(spec("depthwise", precision)))
    layout = src[src.index("_from_cl("):]
    assert f"const {ctype}* __restrict__ in," in layout and f"    {ctype}* __restrict__ out," in layout


@pytest.mark.nvcc
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", ["depthwise", "grouped_vec", "dw_maxpool", "dw_channel_sum", "transposed_few"])
def test_16_bit_ffma_kernels_compile_without_spills(name, precision, arch):
    sp = pipeline.specialize(spec(name, precision), arch)
    assert sp.build.spill_bytes == 0, f"{sp.build.spill_bytes} bytes spilled"


@pytest.mark.nvcc
@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_launch_steps_through_16_bit_samples(precision):
    """The launch plan advances x and out by their 16-bit samples (a batch larger than one grid
    is launched in slices, each starting `stride` bytes further per sample)."""
    from specgen import torchop

    sp = pipeline.specialize(spec("depthwise", precision), "sm_90")
    lp = torchop._launch_plan(sp)
    assert lp.native_16
    assert lp.strides[0] == 2 * sp.plan["in_per_sample"] and lp.strides[-1] == 2 * sp.plan["out_per_sample"]
    wide = pipeline.specialize(spec("depthwise", "fp32"), "sm_90")
    assert not torchop._launch_plan(wide).native_16 and torchop._launch_plan(wide).strides[0] == 4 * wide.plan["in_per_sample"]


def test_show_plan_says_how_the_ffma_engine_reads_its_rows_and_its_16_bit_tensors():
    from specgen.plan import describe

    text = describe(build_plan(spec("depthwise", "bf16")))
    assert "conv rows in 4-wide loads from 3 position(s) before the first tap" in text
    assert "x and out read and written as bf16" in text
    assert "read and written as" not in describe(build_plan(spec("depthwise", "fp32")))

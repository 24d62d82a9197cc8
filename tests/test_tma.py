"""Hopper's TMA/wgmma engine without a GPU: engine choice, tiling arithmetic, the tensor-map
geometry, rendering, nvcc resources (no spills) and the weight layout the launch prepares."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
import torch

from specgen import pipeline, splitk, tma
from specgen import tail
from specgen.plan import PlanError, build_plan, describe
from specgen.render import render_plan
from specgen.spec import validate
from specgen.target import BUILTIN

HOPPER, AMPERE = BUILTIN["sm_90"], BUILTIN["sm_80"]


def spec_of(cin=64, cout=128, size=(14, 14), kernel=3, padding=1, epilogue=("relu",), **extra):
    conv = {"out_channels": cout, "kernel": kernel, "padding": padding, **extra.pop("conv", {})}
    data = {"name": "t", "input": {"channels": cin, "size": list(size)}, "conv": conv, "epilogue": list(epilogue), **extra}
    return validate(data)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
def test_hopper_takes_the_tma_engine_for_deep_layers(precision):
    plan = build_plan(spec_of(precision=precision), target=HOPPER)
    assert plan["engine"] == "tma" and plan["threads"] == 384
    tp = plan["tma"]
    assert tp.split == (precision == "fp32") and tp.elem_bytes == (4 if precision in ("fp32", "tf32") else 2)
    assert tp.kb_total == 9 * tp.cb and tp.k_iters * tp.kb_per_stage == tp.kb_total
    assert tp.n_tiles == -(-128 // tp.bn) and tp.smem_bytes <= HOPPER.smem_per_block
    assert "Hopper" in describe(plan)
    assert build_plan(spec_of(precision=precision), target=AMPERE)["engine"] != "tma"  # no wgmma there


@pytest.mark.parametrize("data,why", [
    ({"epilogue": ["relu", {"max_pool": {"kernel": 2}}]}, "a pool follows the conv"),
    ({"epilogue": ["relu", {"sum": {"dims": [2, 3]}}]}, "the epilogue reduces over positions"),
    ({"cout": 300, "epilogue": ["relu", {"sum": {"dims": [1]}}]}, "more than 256 channels"),
    ({"conv": {"groups": 4}}, "the conv has groups"),
    # (stride 1 runs as a plain conv; a strided one runs its stride phases, but not these)
    ({"conv": {"transposed": True, "stride": 2, "dilation": 2}, "padding": 0}, "the transposed conv has a dilation"),
    ({"conv": {"transposed": True, "stride": 3}, "kernel": 2, "padding": 0}, "a stride phase of the transposed conv meets no tap"),
])
def test_asking_for_tma_where_it_cannot_run_says_why(data, why):
    spec = spec_of(tile={"engine": "tma"}, **data)
    with pytest.raises(PlanError, match=why):
        build_plan(spec, target=HOPPER)
    with pytest.raises(PlanError, match="no wgmma/TMA"):
        build_plan(spec_of(tile={"engine": "tma"}), target=AMPERE)


def test_few_multiply_adds_per_input_byte_stay_on_the_implicit_gemm():
    """The layout pass reads and writes the whole input: a 1x1 conv to few channels does not pay for it."""
    narrow = spec_of(cin=256, cout=64, kernel=1, padding=0, size=(56, 56), precision="tf32")
    wide = spec_of(cin=64, cout=256, kernel=1, padding=0, size=(56, 56), precision="tf32")
    assert tma.intensity(narrow) == 32 and tma.intensity(wide) == 128
    assert build_plan(narrow, target=HOPPER)["engine"] == "igemm"
    assert build_plan(wide, target=HOPPER)["engine"] == "tma"
    assert build_plan(wide.model_copy(update={"precision": "fp32"}), target=HOPPER)["engine"] == "igemm"  # two planes
    assert build_plan(narrow.model_copy(update={"precision": "bf16"}), target=HOPPER)["engine"] == "tma"  # no 16-bit igemm


def test_a_1x1_conv_pays_for_the_layout_pass_only_from_256_output_channels():
    """A stride-1 1x1 conv to 128 channels (64 multiply-adds per input byte) stays on the implicit
    GEMM in tf32; a 3x3 conv at the same intensity takes the TMA engine as before."""
    pointwise = spec_of(cin=512, cout=128, kernel=1, padding=0, size=(28, 28), precision="tf32")
    spatial = spec_of(cin=512, cout=16, kernel=[3, 3], padding=1, size=(28, 28), precision="tf32")
    strided = spec_of(cin=256, cout=512, kernel=1, padding=0, size=(56, 56), precision="tf32", conv={"stride": 2})
    assert tma.intensity(pointwise) == 64 and tma.intensity(spatial) == 72 and tma.intensity(strided) == 64
    assert build_plan(pointwise, target=HOPPER)["engine"] == "igemm"
    assert build_plan(spatial, target=HOPPER)["engine"] == "tma"
    assert build_plan(strided, target=HOPPER)["engine"] == "tma"
    assert build_plan(pointwise.model_copy(update={"precision": "bf16"}), target=HOPPER)["engine"] == "tma"


def test_a_narrow_input_widened_by_a_1x1_conv_takes_the_tma_engine():
    """Fewer than 32 input channels widened at least 4x (MobileNetV2's expansions) pay for the
    layout pass of their small input in tf32; narrowing, 32 channels, or fp32 keep the implicit GEMM."""
    def engine(cin, cout, precision="tf32", size=(56, 56)):
        return build_plan(spec_of(cin=cin, cout=cout, kernel=1, padding=0, size=size, precision=precision),
                          target=HOPPER)["engine"]

    assert tma.intensity(spec_of(cin=16, cout=96, kernel=1, padding=0, precision="tf32")) < tma.MIN_INTENSITY_POINTWISE["tf32"]
    assert engine(16, 96, size=(112, 112)) == "tma"
    assert engine(24, 144) == "tma"
    assert engine(16, 64) == "tma"  # exactly 4x
    assert engine(16, 48) == "igemm"  # 3x
    assert engine(32, 192) == "igemm"  # a whole K chunk of channels
    assert engine(32, 16, size=(112, 112)) == "igemm"
    assert engine(16, 96, "fp32") == "igemm"  # fp32's pass writes two planes: not measured here


@pytest.mark.parametrize("cin,precision,cip,bkc,row", [
    (64, "tf32", 64, 32, 128), (48, "tf32", 48, 16, 64), (40, "tf32", 40, 8, 32), (3, "tf32", 8, 8, 32),
    (64, "bf16", 64, 64, 128), (48, "bf16", 48, 16, 32), (3, "fp16", 16, 16, 32), (256, "fp32", 256, 32, 128),
])
def test_channels_pad_to_whole_swizzled_rows(cin, precision, cip, bkc, row):
    tp = build_plan(spec_of(cin=cin, precision=precision, tile={"engine": "tma"}), target=HOPPER)["tma"]
    assert (tp.cip, tp.bkc, tp.row_bytes) == (cip, bkc, row)
    assert tp.swizzle_desc == {128: 1, 64: 2, 32: 3}[row] and tp.swizzle_tma == {128: 3, 64: 2, 32: 1}[row]
    assert tp.a_bytes % (8 * row) == 0 and tp.b_bytes % (8 * row) == 0  # buffers keep the swizzle's 8-row repeat
    assert tp.stage_tx == (2 if tp.split else 1) * tp.kb_per_stage * (tp.bm + tp.bn) * row


def test_the_im2col_box_follows_the_conv():
    tp = build_plan(spec_of(kernel=[3, 5], padding=[1, 2], conv={"stride": [1, 2], "dilation": [2, 1]},
                            tile={"engine": "tma"}), target=HOPPER)["tma"]
    assert tp.rank == 4
    assert tp.lower == (-2, -1)  # W first: minus the padding
    assert tp.upper == (2 - 4, 1 - 4)  # padding - (kernel - 1) x dilation
    assert tp.elem_strides == (2, 1)


def test_3d_padding_beyond_the_box_limits_is_refused():
    spec = spec_of(size=(40, 40, 40), kernel=3, padding=20, tile={"engine": "tma"})
    with pytest.raises(PlanError, match="im2col box limits"):
        build_plan(spec, target=HOPPER)


def test_accumulators_bound_the_tile():
    for precision in ("fp32", "tf32"):
        for cfg in tma.configs(spec_of(cout=256, precision=precision), HOPPER):
            assert (cfg.bm // 128) * cfg.bn // 2 * (2 if precision == "fp32" else 1) <= tma.MAX_ACC
    with pytest.raises(PlanError, match="accumulator"):
        build_plan(spec_of(cout=256, precision="tf32"), None, HOPPER, tma.TmaConfig(256, 256, 2, 1))


def test_every_extent_is_a_literal_and_loops_have_constant_trip_counts():
    plan = build_plan(spec_of(cin=64, cout=96, size=(10, 12), precision="tf32"), target=HOPPER)
    text = render_plan(plan)
    for line in ("constexpr int C_IN = 64;", "constexpr int C_OUT = 96;", "constexpr int K_ITERS = ",
                 "constexpr int OUT_D = 1, OUT_H = 10, OUT_W = 12;", "constexpr int CIP = 64;"):
        assert line in text
    for var, start, bound in re.findall(r"for \(int (\w+) = ([^;]+); \1 < ([^;]+);", text):
        if var == "tile":  # (a block's walk over the batch's tiles: the batch is the one run-time value)
            assert bound == "tile_total" and "const int tile_total = (m_total + BM - 1) / BM * N_TILES;" in text
            continue
        assert re.fullmatch(r"[A-Z0-9_ ()*/+\-]+", bound), f"loop over {var} has a run-time bound: {bound}"
    assert f"wgmma.mma_async.sync.aligned.m64n{plan['tma'].bn}k8.f32.tf32.tf32" in text
    assert "cp.async.bulk.tensor.4d.shared::cluster.global.im2col" in text
    assert "setmaxnreg.dec" in text and "setmaxnreg.inc" in text


@pytest.mark.nvcc
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16", "fp16"])
@pytest.mark.parametrize("cin,cout,kernel,size", [
    (64, 64, 3, (20, 20)), (128, 256, 3, (15, 17)), (3, 24, 7, (33, 31)), (48, 40, 1, (9, 9)),
    (64, 128, 5, (300,)), (16, 32, 3, (6, 9, 10)), (512, 512, 3, (14, 14)),
])
def test_default_tiles_compile_without_spills(precision, cin, cout, kernel, size):
    spec = spec_of(cin=cin, cout=cout, kernel=kernel, size=size, padding=kernel // 2, precision=precision,
                   tile={"engine": "tma"})
    sp = pipeline.specialize(spec, "sm_90")
    assert sp.plan["engine"] == "tma" and sp.build.arch == "sm_90a"
    assert sp.build.spill_bytes == 0, f"{sp.build.spill_bytes} bytes spilled"


# ---- two blocks per SM, and the pipeline's depth ---------------------------------------------------------

@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp16"])
@pytest.mark.parametrize("cout", [16, 37, 64])
def test_up_to_64_channels_two_256_row_blocks_share_an_sm(cout, precision):
    """Measured 1.05-1.89x the one-block tiles (benchmarks/NOTES.md v24): 80 registers a thread at
    launch, the producer down to 40, the consumers up to 96; two blocks' shared memory fits an SM."""
    cin = 16 if precision == "tf32" else 8  # (a tf32 layer of 8 input channels computes in fp32: plan.exact_tf32)
    plan = build_plan(spec_of(cin=cin, cout=cout, size=(40, 40), precision=precision), target=HOPPER)
    tp = plan["tma"]
    assert tp.blocks_per_sm == 2 and tp.bm == 256 and tp.bn == -(-cout // 8) * 8 and plan["min_blocks"] == 2
    assert (tp.producer_regs, tp.consumer_regs) == (40, 96) and tp.acc_regs <= 64
    assert 2 * (tp.smem_bytes + tma.BLOCK_RESERVED_SMEM) <= HOPPER.smem_per_sm and 2 <= tp.stages <= tma.MAX_STAGES
    source = render_plan(plan)
    assert "__launch_bounds__(THREADS, 2)" in source and "setmaxnreg.inc.sync.aligned.u32 96" in source
    assert "two blocks per SM" in describe(plan)


@pytest.mark.parametrize("cout,precision", [(128, "tf32"), (64, "fp32"), (256, "bf16")])
def test_wider_tiles_and_3xtf32_keep_one_block_of_at_most_4_stages(cout, precision):
    tp = build_plan(spec_of(cin=64, cout=cout, size=(40, 40), precision=precision), target=HOPPER)["tma"]
    assert tp.blocks_per_sm == 1 and (tp.producer_regs, tp.consumer_regs) == (40, 232) and tp.stages <= tma.MAX_STAGES


def test_extra_inputs_and_the_spill_retry_keep_one_block():
    """A residual's extra input needs registers the two-block cap does not leave (16 bytes spilled);
    the pipeline's retry of a build that spilled (one block per SM, `plan.Settings`) gets one block."""
    from specgen.plan import Settings

    residual = spec_of(cin=16, cout=32, size=(20, 20), precision="tf32", epilogue=[{"add": {"input": "shortcut"}}, "relu"])
    assert build_plan(residual, target=HOPPER)["tma"].blocks_per_sm == 1
    plain = spec_of(cin=16, cout=32, size=(20, 20), precision="tf32")
    assert build_plan(plain, target=HOPPER)["tma"].blocks_per_sm == 2
    retry = build_plan(plain, target=HOPPER, settings=Settings(min_blocks=1))
    assert retry["tma"].blocks_per_sm == 1 and retry["min_blocks"] == 1


def test_a_two_block_tile_that_does_not_fit_is_refused():
    spec = spec_of(cin=64, cout=128, size=(20, 20), precision="tf32", tile={"engine": "tma"})
    with pytest.raises(PlanError, match="does not fit the registers of two blocks"):
        build_plan(spec, target=HOPPER, tma_config=tma.TmaConfig(128, 128, 2, 1, blocks_per_sm=2))
    assert all(c.bn <= 64 for c in tma.configs(spec, HOPPER) if c.blocks_per_sm == 2)


def test_tune_candidates_leave_out_two_block_tiles_without_two_stages():
    """bf16, 32 input channels: a stage of 3 K-blocks of a 256 x 64 tile (61 KB) fits two blocks of
    an SM only once; that candidate is left out (it used to raise while the list was built)."""
    spec = spec_of(cin=32, cout=64, size=(16, 16), precision="bf16")
    cands = tma.configs(spec, HOPPER)
    assert cands and all(c.stages >= 2 for c in cands)
    assert (256, 64, 3, 2) not in {(c.bm, c.bn, c.kb_per_stage, c.blocks_per_sm) for c in cands}
    assert (128, 64, 3, 2) in {(c.bm, c.bn, c.kb_per_stage, c.blocks_per_sm) for c in cands}  # half the rows: fits twice


# ---- a reduction over the channels, on the accumulators ------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("op", ["sum", "mean", "amax", "amin", "logsumexp"])
def test_a_reduction_over_the_channels_runs_in_the_epilogue(op, precision):
    """One block holds every channel (one N tile, no split K), so the reduction is taken on the
    accumulators and only the reduced output is written: the layer stays whole on tensor cores."""
    spec = spec_of(cin=16, cout=72, size=(20, 22), precision=precision,
                   epilogue=[{"mul": 2.0}, {op: {"dims": [1], "keepdim": op != "sum"}}, "tanh"])
    assert tma.channel_reduction(spec)
    plan = build_plan(spec, target=HOPPER)
    assert plan["engine"] == "tma", describe(plan)
    tp = plan["tma"]
    assert tp.channel_reduction and tp.n_tiles == 1 and tp.bn >= 72 and tp.split_k == 1
    assert plan["out_shape"] == ([20, 22] if op == "sum" else [1, 20, 22])
    assert "reduction over the channels" in describe(plan)
    source = render_plan(plan)
    assert source.count("__shfl_xor_sync") == 2 and "out[m] = " in source and "_reduce(" not in source
    # a deep layer at batch 1 would take split K; with the reduction it has none
    deep = spec_of(cin=512, cout=128, size=(7, 7), precision=precision, epilogue=[{op: {"dims": [1]}}])
    assert build_plan(deep, target=HOPPER)["tma"].split_k == 1


@pytest.mark.parametrize("data", [
    {"epilogue": [{"amax": {"dims": [1, 2]}}]},  # channels and a spatial dim
    {"epilogue": [{"amax": {"dims": [1]}}, {"sum": {"dims": [1]}}]},  # two reductions
    {"epilogue": [{"max_pool": {"kernel": 2}}, {"amax": {"dims": [1]}}]},  # a pool first
    {"cout": 300, "epilogue": [{"amin": {"dims": [1]}}], "precision": "tf32"},  # more than one block's channels
    {"cout": 200, "epilogue": [{"amin": {"dims": [1]}}], "precision": "fp32"},  # 3xTF32: no tile holds 200 channels
])
def test_other_reductions_over_the_channels_stay_off_the_tma_engine(data):
    assert build_plan(spec_of(**data), target=HOPPER)["engine"] != "tma"


@pytest.mark.nvcc
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_channel_reductions_compile_without_spills(precision):
    spec = spec_of(cin=16, cout=128 if precision == "fp32" else 256, size=(20, 22), precision=precision,
                   epilogue=[{"add": {"param": "shift"}}, {"logsumexp": {"dims": [1]}}, "relu"])
    sp = pipeline.specialize(spec, "sm_90")
    assert sp.plan["engine"] == "tma" and sp.plan["tma"].channel_reduction and sp.build.arch == "sm_90a"
    assert sp.build.spill_bytes == 0, f"{sp.build.spill_bytes} bytes spilled"


# ---- a softmax over the channels, on the accumulators -----------------------------------------------------

@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
def test_a_softmax_over_the_channels_runs_in_the_epilogue(op, precision):
    """One block holds every channel, so the row's max and sum of exponentials are taken on the
    accumulators (two shuffles each): one kernel writes the normalized values, where the tail
    engine would write the conv's output, read it for the statistics and again to normalize."""
    spec = spec_of(cin=16, cout=72, size=(20, 22), precision=precision,
                   epilogue=["relu", {op: 1}, {"mul": {"param": "w"}}, "tanh"])
    assert tma.channel_norm(spec) == 1 and not tma.channel_reduction(spec)
    plan = build_plan(spec, target=HOPPER)
    assert plan["engine"] == "tma", describe(plan)
    tp = plan["tma"]
    assert tp.channel_norm and not tp.channel_reduction and tp.n_tiles == 1 and tp.bn >= 72 and tp.split_k == 1
    assert [p["op"] for p in plan["pointwise"]] == ["relu"]
    assert [p["op"] for p in plan["channel_norm"]["pointwise"]] == ["mul", "tanh"]
    assert plan["out_shape"] == [72, 20, 22]
    assert "softmax over the channels taken on the accumulators" in describe(plan)
    source = render_plan(plan)
    assert source.count("__shfl_xor_sync") == 2 and "const float nb = " in source and "_reduce(" not in source
    assert ("logf(sum)" in source) == (op == "log_softmax")
    # a deep layer at batch 1 would take split K; with the softmax it has none
    deep = spec_of(cin=512, cout=128, size=(7, 7), precision=precision, epilogue=[{op: 1}])
    assert build_plan(deep, target=HOPPER)["tma"].split_k == 1


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_a_softmax_then_a_reduction_over_the_channels_is_one_kernel(precision):
    """KernelBench-style softmax(conv) * w, then its sum over the channels: both on the accumulators."""
    spec = spec_of(cin=32, cout=64, size=(16, 16), precision=precision,
                   epilogue=[{"softmax": {"dim": [-3]}}, {"mul": {"param": "w"}}, {"sum": {"dims": [1], "keepdim": True}},
                             {"add": 1.0}])
    assert tma.channel_norm(spec) == 0 and tma.channel_reduction(spec)
    plan = build_plan(spec, target=HOPPER)
    assert plan["engine"] == "tma" and plan["tma"].channel_norm and plan["tma"].channel_reduction
    assert plan["out_shape"] == [1, 16, 16]
    source = render_plan(plan)
    assert source.count("__shfl_xor_sync") == 4 and "out[m] = " in source


@pytest.mark.parametrize("rest", [
    [{"mean": {"dims": [2, 3]}}],  # a reduction over the positions
    [{"max_pool": {"kernel": 2}}, "sigmoid"],  # a pool
    [{"amax": {"dims": [1], "keepdim": True}}, {"mean": {"dims": [2, 3]}}],  # a reduction over the channels, then more
])
def test_what_follows_a_softmax_over_the_channels_reads_its_output(rest):
    """The TMA kernel writes the normalized values as T0; the rest runs over an identity conv, as
    after a pool split: no tail kernel."""
    spec = spec_of(cin=32, cout=64, size=(16, 16), precision="tf32", epilogue=["relu", {"softmax": 1}, *rest])
    plan = build_plan(spec, target=HOPPER)
    assert plan["engine"] == "sequence" and [p["role"] for p in plan["parts"]] == ["body", "rest"]
    body = plan["parts"][0]["plan"]
    assert body["engine"] == "tma" and body["tma"].channel_norm
    assert "softmax over the channels is taken in the TMA engine's epilogue" in plan["why"][0]
    assert plan["out_shape"] == list(spec.shapes()[-1].sizes)


@pytest.mark.parametrize("data", [
    {"epilogue": [{"softmax": 2}]},  # over a spatial dim
    {"epilogue": [{"softmax": [1, 2]}]},  # over the channels and a spatial dim
    {"epilogue": [{"max_pool": {"kernel": 2}}, {"softmax": 1}]},  # after a pool
    {"epilogue": [{"softmax": 1}, {"group_norm": 8}]},  # a further statistic stage
    {"epilogue": [{"group_norm": 8}, {"softmax": 1}]},  # after a statistic stage
    {"cout": 300, "epilogue": [{"softmax": 1}], "precision": "tf32"},  # more than one block's channels
    {"cout": 200, "epilogue": [{"softmax": 1}], "precision": "fp32"},  # 3xTF32: no tile holds 200 channels
    {"cin": 8, "epilogue": [{"softmax": 1}], "precision": "fp32"},  # fp32 with few input channels: not on the TMA engine
    {"epilogue": [{"softmax": 1}], "tile": {"engine": "igemm"}},  # another engine named
])
def test_other_softmaxes_run_as_a_sequence_with_a_tail_kernel(data):
    plan = build_plan(spec_of(**data), target=HOPPER)
    assert plan["engine"] == "sequence" and "tail" in [p["role"] for p in plan["parts"]]


def test_a_softmax_over_the_channels_runs_as_a_sequence_without_the_tma_engine():
    assert build_plan(spec_of(epilogue=[{"softmax": 1}], precision="tf32"), target=AMPERE)["engine"] == "sequence"


@pytest.mark.nvcc
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_channel_softmaxes_compile_without_spills(precision):
    spec = spec_of(cin=16, cout=128 if precision == "fp32" else 256, size=(20, 22), precision=precision,
                   epilogue=[{"add": {"param": "shift"}}, {"log_softmax": 1}, "gelu", {"mul": {"param": "w"}}])
    sp = pipeline.specialize(spec, "sm_90")
    assert sp.plan["engine"] == "tma" and sp.plan["tma"].channel_norm and sp.build.arch == "sm_90a"
    assert sp.build.spill_bytes == 0, f"{sp.build.spill_bytes} bytes spilled"
    # two blocks per SM (64 channels), with a reduction over the channels after the softmax
    small = spec_of(cin=32, cout=64, size=(20, 22), precision=precision,
                    epilogue=["relu", {"softmax": 1}, {"mul": {"param": "w"}}, {"sum": {"dims": [1]}}])
    sp = pipeline.specialize(small, "sm_90")
    assert sp.plan["tma"].channel_norm and sp.plan["tma"].channel_reduction
    assert sp.build.spill_bytes == 0, f"{sp.build.spill_bytes} bytes spilled"


def test_the_weights_are_laid_out_tap_major_with_the_channels_padded():
    """[C_OUT][TAPS x CIP]: element (co, tap x CIP + ci) is weight (co, ci, tap), zeros in the padding."""
    torch = pytest.importorskip("torch")
    from specgen import tmarun

    cin, cout, taps = 20, 12, 9
    tp = build_plan(spec_of(cin=cin, cout=cout, precision="tf32", tile={"engine": "tma"}), target=HOPPER)["tma"]
    w = torch.randn(cout, cin, 3, 3)
    laid = tmarun.weight_layout(w, tp, cin, taps)
    assert laid.shape == (cout, tp.k_total) and laid.is_contiguous() and tp.k_total == taps * tp.cip
    flat = w.reshape(cout, cin, taps)
    for tap in range(taps):
        for ci in range(tp.cip):
            want = flat[:, ci, tap] if ci < cin else torch.zeros(cout)
            torch.testing.assert_close(laid[:, tap * tp.cip + ci], want, rtol=0, atol=0)


def test_the_launch_prepares_the_weights_tap_major_padded_and_split():
    torch = pytest.importorskip("torch")
    from specgen import tmarun

    w = torch.randn(8, 3, 3, 3)
    hi, lo = tmarun.operand_planes(w.reshape(8, 3, 9).transpose(1, 2).reshape(8, -1), "fp32")
    torch.testing.assert_close(hi + lo, w.reshape(8, 3, 9).transpose(1, 2).reshape(8, -1), rtol=0, atol=0)
    assert ((hi.view(torch.int32) & 0x1FFF) == 0).all()  # hi has TF32's 10 mantissa bits
    assert (lo.abs() <= hi.abs() * 2.0**-11).all()
    assert tmarun.map_dtype("tf32", torch.float32) == "tfloat32" and tmarun.map_dtype("bf16", torch.bfloat16) == "bfloat16"


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_a_pool_after_a_deep_conv_splits_the_layer(precision):
    """The conv runs on the TMA engine into T0 (with 3 input channels in tf32 and fp32 on the slab
    engine: in TF32, `plan.slab_in_tf32`, and in 3xTF32, `tail.split_engine`); the pool and what
    follows read it over an identity conv."""
    stem = spec_of(cin=3, cout=64, size=(64, 64), kernel=7, padding=3, conv={"stride": 2}, precision=precision,
                   epilogue=["relu", {"max_pool": {"kernel": 3, "stride": 2, "padding": 1}}, "sigmoid"])
    plan = build_plan(stem, target=HOPPER)
    assert plan["engine"] == "sequence" and [s["kind"] for s in plan["steps"]] == ["layer", "layer"]
    body, rest = (p["plan"] for p in plan["parts"])
    assert body["engine"] == ("tma" if precision == "bf16" else "slab") and [p["op"] for p in body["pointwise"]] == ["relu"]
    assert precision == "bf16" or body["mma"]["products"] == (1 if precision == "tf32" else 3)
    assert rest["engine"] == "ffma" and rest["transposed"] is False and plan["steps"][1]["ones"] == 64
    assert plan["parts"][1]["spec"].precision == ("bf16" if precision == "bf16" else "fp32")  # an exact identity conv
    assert plan["out_shape"] == list(stem.shapes()[-1].sizes)
    assert "max_pool would keep the whole layer on FFMA" in plan["why"][0]
    assert build_plan(stem, target=AMPERE)["engine"] == "ffma"  # no TMA engine there: whole


def test_a_pool_after_a_shallow_conv_into_many_channels_splits_too():
    """K = 72 (8 channels, 3 x 3) into 64 channels before a max pool: whole, the layer would run
    on FFMA at a fraction of its floor (benchmarks/pool_split.py); split, its conv runs on tensor cores."""
    layer = spec_of(cin=8, cout=64, size=(32, 32), precision="tf32", epilogue=["tanh", {"max_pool": {"kernel": 4}}])
    plan = build_plan(layer, target=HOPPER)
    assert plan["engine"] == "sequence" and plan["parts"][0]["plan"]["engine"] == "tma"
    assert build_plan(spec_of(cin=8, cout=16, size=(32, 32), precision="tf32",
                              epilogue=["tanh", {"max_pool": {"kernel": 4}}]), target=HOPPER)["engine"] == "ffma"


@pytest.mark.parametrize("data", [
    # K = 81 into 16 output channels: too few for tensor cores (tail.POOL_SPLIT_MIN_K)
    {"cin": 3, "cout": 16, "size": (12, 16, 16), "kernel": 3, "epilogue": [{"max_pool": {"kernel": 2}}, {"sum": {"dims": [1]}}]},
    {"cin": 2, "size": (12, 16, 16), "kernel": 3, "epilogue": [{"max_pool": {"kernel": 2}}]},  # K = 54: too shallow
    {"epilogue": ["relu", {"max_pool": {"kernel": 2}}], "tile": {"engine": "ffma"}},  # an engine named
    # (a relu first: a sum right after the conv folds before it, specgen.tapsum)
    {"cin": 16, "epilogue": ["relu", {"sum": {"dims": [2, 3]}}]},  # a reduction after a conv of few channels: whole on FFMA
    {"cin": 32, "cout": 32, "epilogue": ["relu", {"sum": {"dims": [2, 3]}}]},  # ... or on the slab engine, on tensor cores
    {"cin": 16, "cout": 32, "padding": 0, "epilogue": [{"avg_pool": {"kernel": 2}}]},  # an avg-pool right after the conv folds into it
])
def test_other_layers_stay_whole(data):
    assert build_plan(spec_of(**data), target=HOPPER)["engine"] != "sequence"


@pytest.mark.parametrize("precision", ["fp16", "tf32"])
def test_an_avg_pool_after_a_strided_conv_splits_like_any_windowed_pool(precision):
    """The avg-pool fold takes a pool after a conv of stride 1 only: after a strided conv the avg
    pool is split from it like a max pool (it was left whole, on FFMA, expecting a fold that
    never came: 64 -> 64 channels 3x3 stride 2 before a 2x2 average ran at 0.12x eager in fp16)."""
    data = {"cin": 64, "cout": 64, "size": (56, 56), "conv": {"stride": 2}, "epilogue": [{"avg_pool": {"kernel": 2}}],
            "precision": precision}
    plan = build_plan(spec_of(**data), target=HOPPER)
    assert plan["engine"] == "sequence" and plan["parts"][0]["plan"]["engine"] == "tma"
    assert "avg_pool would keep the whole layer on FFMA" in plan["why"][0]
    # stride 1: the split is left to the fold (the planner splits only where its weights do not fit)
    assert tail.pool_split(spec_of(**{**data, "conv": {}}), HOPPER) is None
    assert tail.pool_split(spec_of(**data), HOPPER) == 0


def test_a_reduction_after_a_deep_conv_that_would_run_on_ffma_splits_the_layer():
    """64 -> 128 channels, 3 x 3: too many weights for the slab engine, so the reduction would keep
    the whole layer on FFMA; split, the conv runs on the TMA engine and the reductions read T0."""
    data = {"epilogue": ["relu", {"mean": {"dims": [2, 3], "keepdim": True}}, {"logsumexp": {"dims": [1]}}],  # (relu: no tap-sum fold)
            "precision": "tf32"}
    whole = build_plan(spec_of(**data, tile={}), target=HOPPER)
    assert whole["engine"] == "ffma"
    plan = build_plan(spec_of(**data), target=HOPPER)
    assert plan["engine"] == "sequence" and [p["plan"]["engine"] for p in plan["parts"]] == ["tma", "ffma"]
    assert "mean would keep the whole layer on FFMA (a fused reduction)" in plan["why"][0]
    # few input channels: the FFMA conv is cheap, the layer stays whole
    assert build_plan(spec_of(cin=16, **data), target=HOPPER)["engine"] != "sequence"


# ---- split K: small batches of deep layers ------------------------------------------------------------

def test_a_deep_layer_with_few_positions_gets_a_split_kernel_that_divides_k():
    """ResNet's last stage at batch 1: 49 positions x 512 channels are a handful of tiles for 132 SMs."""
    tp = build_plan(spec_of(cin=512, cout=512, size=(7, 7), precision="tf32"), target=HOPPER)["tma"]
    assert tp.split_k > 1 and tp.k_iters % tp.split_k == 0 and tp.split_iters == tp.k_iters // tp.split_k
    assert tp.split_iters >= splitk.MIN_ITERATIONS
    tiles = -(-49 // tp.bm) * tp.n_tiles
    assert tiles * tp.split_k <= 132  # one sample's split grid is one wave
    assert "K split" in describe(build_plan(spec_of(cin=512, cout=512, size=(7, 7), precision="tf32"), target=HOPPER))


def test_layers_that_fill_the_gpu_get_no_split_kernel():
    plan = build_plan(spec_of(cin=64, cout=64, size=(224, 224), precision="tf32"), target=HOPPER)
    assert plan["tma"].split_k == 1
    text = render_plan(plan)
    assert "_split(" not in text and "_reduce(" not in text and "SPLIT_K" not in text


def test_the_launch_takes_the_split_kernel_only_where_it_pays():
    from specgen import tmarun

    tp = build_plan(spec_of(cin=512, cout=512, size=(7, 7), precision="tf32"), target=HOPPER)["tma"]
    assert tmarun.uses_split(tp, 1, 132)
    assert not tmarun.uses_split(tp, 256, 132)  # 256 samples: hundreds of tiles already
    # the choice is the cost model's: split where it is a tenth cheaper
    for batch in (1, 2, 4, 8, 16, 32, 64):
        tiles, outputs = -(-batch * 49 // tp.bm) * tp.n_tiles, batch * 49 * 512
        split, plain = (splitk.cost(tiles, tp.k_iters, s, 132, outputs) for s in (tp.split_k, 1))
        assert tmarun.uses_split(tp, batch, 132) == (split * 10 <= plain * 9)


def test_the_split_cost_model_follows_the_measured_choices():
    """Kernel times measured on an H200 (benchmarks/NOTES.md, v23), tf32: the model picks the faster
    of the two kernels on these (tiles, stages, parts, outputs) rows."""
    rows = [  # tiles, k_iters, parts, outputs, split faster?
        (4, 144, 24, 49 * 512, True),  # 512 ch at 7x7, batch 1: 8.5 against 44.7 us
        (8, 144, 24, 4 * 49 * 512, True),  # batch 4: 16.3 against 47.1
        (28, 72, 24, 16 * 49 * 512, False),  # 3x3 s2 256 -> 512 to 7x7, batch 16: 38.2 against 28.6
        (32, 48, 16, 16 * 64 * 512, False),  # conv1d 512 ch, length 64, batch 16: 26.7 against 19.2
        (8, 48, 16, 4 * 64 * 512, True),  # ... batch 4: 8.6 against 18.2
        (25, 36, 12, 4 * 784 * 128, False),  # 128 ch at 28x28, batch 4: 17.3 against 15.8
        (7, 36, 12, 784 * 128, True),  # ... batch 1: 7.5 against 14.8
    ]
    for tiles, k_iters, parts, outputs, faster in rows:
        assert splitk.pays(tiles, k_iters, parts, 132, outputs) == faster, (tiles, k_iters, parts, outputs)


def test_a_tile_config_can_ask_for_a_split_or_none():
    spec = spec_of(cin=512, cout=512, size=(7, 7), precision="tf32")
    base = build_plan(spec, target=HOPPER)["tma"].config
    none = build_plan(spec, None, HOPPER, tma.TmaConfig(base.bm, base.bn, base.stages, base.kb_per_stage, 1))["tma"]
    assert none.split_k == 1
    four = build_plan(spec, None, HOPPER, tma.TmaConfig(base.bm, base.bn, base.stages, base.kb_per_stage, 4))["tma"]
    assert four.split_k == 4 and four.split_iters == four.k_iters // 4
    with pytest.raises(PlanError, match="does not divide"):
        build_plan(spec, None, HOPPER, tma.TmaConfig(base.bm, base.bn, base.stages, base.kb_per_stage, 7))
    with pytest.raises(ValueError, match="split_k"):
        tma.TmaConfig(128, 128, 4, 1, -1)


def test_the_split_kernels_walk_their_part_of_k_and_reduce_in_order():
    text = render_plan(build_plan(spec_of(cin=512, cout=512, size=(7, 7), precision="tf32",
                                          epilogue=[{"add": {"input": "shortcut"}}, "relu"]), target=HOPPER))
    tp = build_plan(spec_of(cin=512, cout=512, size=(7, 7), precision="tf32"), target=HOPPER)["tma"]
    assert f"constexpr int SPLIT_K = {tp.split_k};" in text
    assert "conv_block<1>(" in text and "conv_block<SPLIT_K>(" in text
    split = text[text.index("_split(\n"):text.index("_reduce(\n")]
    assert "partial" in split and "i_shortcut" not in split  # no epilogue in the split kernel
    reduce = text[text.index("_reduce(\n"):]
    assert "for (int part = 0; part < SPLIT_K; ++part) sum +=" in reduce  # a fixed order: the same sum every run
    assert "input_value(i_shortcut, e_out)" in reduce and "fmaxf(v, 0.0f)" in reduce
    assert "atomic" not in text


@pytest.mark.nvcc
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_split_kernels_compile_without_spills(precision):
    spec = spec_of(cin=256, cout=256, size=(14, 14), precision=precision, tile={"engine": "tma"},
                   epilogue=[{"add": {"input": "shortcut"}}, "relu"])
    sp = pipeline.specialize(spec, "sm_90")
    assert sp.plan["tma"].split_k > 1
    assert sp.build.spill_bytes == 0, f"{sp.build.spill_bytes} bytes spilled"


# ---- a transposed conv's stride phases ---------------------------------------------------------


def _emulate_tma_phases(spec, tp, x, weight, bias):
    """The TMA kernel's arithmetic for stride phases, as the hardware and the template walk it: per
    phase, grid position j (every phase's grid), im2col box from LOWER (its corners: the map's), tap
    t' reading input j + LOWER + t' (zeros outside the input), weights from the permuted layout
    (`tmarun.phase_weight_layout`), stored at OUT_OFF + S * j where the phase has an output."""
    from specgen import tmarun

    nd = spec.ndim
    cin, cout = spec.input.channels, spec.conv.out_channels
    in3 = (1,) * (3 - nd) + tuple(spec.input.size)
    out3 = (1,) * (3 - nd) + tuple(spec.conv_output().sizes[1:])
    s3 = (1,) * (3 - nd) + tuple(spec.conv_geometry()["stride"])
    x3 = x.reshape(x.shape[0], cin, *in3)
    laid = tmarun.phase_weight_layout(weight, tp, cin)
    assert laid.shape == (tp.gemms * tp.n_pad, tp.k_total)
    out = torch.full((x.shape[0], cout, *out3), float("nan"), dtype=x.dtype)
    for ph in tp.phases:
        # the im2col box spans GRID positions from LOWER: upper = GRID - IN + LOWER, W first
        assert ph.lower_map == tuple(reversed(ph.lower[3 - nd:]))
        assert ph.upper_map == tuple(reversed([g - i + lo for g, i, lo in zip(tp.grid, in3, ph.lower)][3 - nd:]))
        w = laid[ph.index * tp.n_pad:ph.index * tp.n_pad + cout].reshape(cout, -1, tp.cip)[:, :ph.taps, :cin]
        assert not laid[ph.index * tp.n_pad:(ph.index + 1) * tp.n_pad].reshape(tp.n_pad, -1, tp.cip)[:, ph.taps:].any()
        acc = torch.zeros((x.shape[0], cout, *tp.grid), dtype=x.dtype)
        for t in range(ph.taps):
            td, th, tw = t // (ph.kp[1] * ph.kp[2]), t // ph.kp[2] % ph.kp[1], t % ph.kp[2]
            idx = [torch.arange(tp.grid[a]) + ph.lower[a] + (td, th, tw)[a] for a in range(3)]
            ok = [(i >= 0) & (i < in3[a]) for a, i in enumerate(idx)]
            xs = x3[:, :, idx[0].clamp(0, in3[0] - 1)][:, :, :, idx[1].clamp(0, in3[1] - 1)][..., idx[2].clamp(0, in3[2] - 1)]
            mask = ok[0][:, None, None] & ok[1][None, :, None] & ok[2][None, None, :]
            acc += torch.einsum("ncdhw,oc->nodhw", xs * mask, w[:, t, :])
        if bias is not None:
            acc += bias.view(1, cout, 1, 1, 1)
        mine = acc[:, :, :ph.op[0], :ph.op[1], :ph.op[2]]  # grid positions past the phase's outputs: not stored
        target = out[:, :, ph.out_off[0]::s3[0], ph.out_off[1]::s3[1], ph.out_off[2]::s3[2]]
        assert target.shape == mine.shape and target.isnan().all()  # each output written by one phase only
        out[:, :, ph.out_off[0]::s3[0], ph.out_off[1]::s3[1], ph.out_off[2]::s3[2]] = mine
    return out.reshape(x.shape[0], cout, *out3[3 - nd:])


@pytest.mark.parametrize("conv, size", [
    ({"kernel": 3, "stride": 2, "padding": 1, "output_padding": 1}, [5, 7]),
    ({"kernel": 4, "stride": 2, "padding": 1, "output_padding": 1}, [6, 5]),
    ({"kernel": 4, "stride": 2}, [4, 6]),
    ({"kernel": 5, "stride": 3, "padding": 2, "output_padding": 2}, [7, 4]),
    ({"kernel": [2, 3], "stride": [2, 1], "padding": [0, 1]}, [5, 6]),
    ({"kernel": 3, "stride": 2, "padding": 1, "output_padding": 1}, [3, 4, 5]),
    ({"kernel": [3, 4, 2], "stride": [2, 2, 2], "padding": [0, 1, 0]}, [2, 3, 4]),
    ({"kernel": 4, "stride": 3, "padding": 1}, [9]),
    ({"kernel": 2, "stride": 2}, [5]),
])
def test_the_tma_stride_phases_compute_the_transposed_conv(conv, size):
    from conv_family_specs import float64_transposed_case

    torch.manual_seed(len(size) * 11 + sum(size))
    cin, cout = 20, 24
    spec = validate({"name": "ph", "input": {"channels": cin, "size": size},
                     "conv": {"out_channels": cout, **conv, "transposed": True}, "tile": {"engine": "tma"}})
    plan = build_plan(spec, target=HOPPER)
    tp = plan["tma"]
    assert plan["engine"] == "tma" and tp.phases and tp.split_k == 1
    covered = sorted(t for ph in tp.phases for t in ph.tap_index)
    assert covered == list(range(plan["taps"]))  # every tap in exactly one phase
    for ph in tp.phases:  # a phase's stages walk its own taps
        assert ph.k_iters * tp.kb_per_stage == ph.taps * tp.cb and ph.taps * tp.cip <= tp.k_total
    x, w, b, ref = float64_transposed_case(spec)
    got = _emulate_tma_phases(spec, tp, x, w, b)
    assert got.shape == ref.shape and not got.isnan().any()
    assert torch.allclose(got, ref, atol=1e-12, rtol=0)


def test_tma_stride_phases_render_a_gemm_per_phase_and_fit_the_box_limits():
    spec = validate({"name": "up", "input": {"channels": 64, "size": [32, 32]},
                     "conv": {"out_channels": 128, "kernel": 4, "stride": 2, "padding": 1, "transposed": True},
                     "epilogue": ["relu"], "precision": "tf32"})
    plan = build_plan(spec, target=HOPPER)
    tp = plan["tma"]
    # W pairs: a block runs phases 0 and 1 (W phase 0 and 1 of the first H phase), then 2 and 3
    assert plan["engine"] == "tma" and len(tp.phases) == 4 and tp.grid[1:] == (32, 32) and tp.w_pairs
    assert [ph.out_off for ph in tp.phases] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)] and tp.grid_gemms == 2
    text = render_plan(plan)
    assert "case 0: conv_block<1, 0>(map_a_hi_0, map_a_hi_1," in text and "case 1: conv_block<1, 2>(map_a_hi_2, map_a_hi_3," in text
    assert "*reinterpret_cast<float2*>(o) = make_float2(pair[0], pair[1]);" in text  # an even output width
    assert "a block runs both W phases" in describe(plan)
    # one phase per block (a tile that asks for it)
    single = build_plan(spec, target=HOPPER, tma_config=replace(tp.config, phases_per_block=1))
    assert not single["tma"].w_pairs and single["tma"].grid_gemms == 4
    text = render_plan(single)
    for ph in tp.phases:
        assert f"struct Phase<{ph.index}>" in text and f"conv_block<1, {ph.index}>(map_a_hi_{ph.index}," in text
    assert "PH * N_PAD + n0" in text and "row_mine[i][h]" in text and "K_ITERS = 8;" in text
    assert "one GEMM per stride phase of the transposed conv (4 phases" in describe(single)
    # an odd output width: the pair's two values in two stores; a softmax over the channels: no pairs
    odd = validate({**spec.model_dump(mode="json"), "conv": {**spec.model_dump(mode="json")["conv"], "output_padding": 1}})
    assert "o[1] = pair[1];" in render_plan(build_plan(odd, target=HOPPER))
    soft = validate({**spec.model_dump(mode="json"), "epilogue": [{"softmax": 1}]})
    assert not build_plan(soft, target=HOPPER)["tma"].w_pairs
    # an extra input: the implicit GEMM, unless a tile asks for the TMA engine (then W pairs read it at both outputs)
    data = {**spec.model_dump(mode="json"), "epilogue": [{"add": {"input": "skip"}}, "relu"]}
    assert build_plan(validate(data), target=HOPPER)["engine"] == "igemm"
    pinned = build_plan(validate({**data, "tile": {"engine": "tma"}}), target=HOPPER)
    assert pinned["tma"].w_pairs and "e_out = static_cast<size_t>(sample) * (C_OUT * POSITIONS) + static_cast<size_t>(cj) * " \
        "POSITIONS + p + (row_mine2[i][h] ? 1 : 0);" in render_plan(pinned)
    # a kernel smaller than its stride leaves a phase without taps: the implicit GEMM (or FFMA) runs it
    small = validate({**spec.model_dump(mode="json"), "conv": {**spec.model_dump(mode="json")["conv"], "kernel": 1}})
    assert build_plan(small, target=HOPPER)["engine"] != "tma"
    # a 3-D box's corners are limited to [-16, 16): a wide padding refuses with the reason
    wide = validate({"name": "w", "input": {"channels": 32, "size": [60, 4, 4]},  # (phase input offsets of 18-20)
                     "conv": {"out_channels": 32, "kernel": 5, "stride": 2, "padding": [40, 0, 0], "transposed": True},
                     "tile": {"engine": "tma"}})
    with pytest.raises(PlanError, match="box limits"):
        build_plan(wide, target=HOPPER)


# ---- a 16-bit 1x1 conv reads its NC(D)HW input in place ------------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("cin,size", [(256, (56, 56)), (24, (8, 16)), (8, (192,)), (16, (4, 4, 8))])
def test_a_16_bit_1x1_conv_reads_its_nchw_input_in_place(precision, cin, size):
    """No layout pass: A is loaded from [batch][C_IN][positions] by a tiled 3-D map (64 positions x
    BKC channels), fed to wgmma transposed (MN-major), and the prep kernels are not in the module."""
    from specgen import tmarun

    spec = spec_of(cin=cin, cout=64, size=size, kernel=1, padding=0, precision=precision, tile={"engine": "tma"})
    plan = build_plan(spec, target=HOPPER)
    tp = plan["tma"]
    assert tp.a_in_place
    text = render_plan(plan)
    assert "cp.async.bulk.tensor.3d.shared::cluster.global.tile" in text and "im2col" not in text
    assert "_prep(" not in text and "_prep_cl(" not in text
    assert "acc, 1, 1, 1, 0;" in text  # imm-trans-a 1: A is MN-major
    assert "descriptor_mn(rows)" in text
    assert "A_CHUNK_BYTES = BKC * 128" in text and f"BKC = {tp.bkc};" in text
    assert not any(name.endswith(("_prep", "_prep_cl")) for name in tmarun.extra_functions(plan))
    assert "no layout pass" in describe(plan)


@pytest.fixture
def staged(monkeypatch):
    """The staging path on (`tma.STAGED_NCHW`: off by default until it has run on a GPU)."""
    monkeypatch.setattr(tma, "STAGED_NCHW", True)


@pytest.mark.usefixtures("staged")
@pytest.mark.parametrize("precision", ["tf32", "fp32"])
@pytest.mark.parametrize("cin,size", [(256, (56, 56)), (24, (8, 16)), (8, (192,)), (16, (4, 4, 8)), (64, (28, 28))])
def test_a_32_bit_1x1_conv_reads_its_nchw_input_in_place_through_a_staging_buffer(precision, cin, size):
    """tf32 and fp32 mode: wgmma reads a 32-bit A only K-major, so the tiled loads (32 positions x BKC
    channels, 128-byte rows) land in a staging buffer at the end of each stage and warps 1-3 of the
    producer warpgroup transpose them into the K-major A tile (fp32 mode: its hi and lo planes); the
    consumers read A as the im2col path's. One map of the input (fp32 mode splits in shared memory)."""
    from specgen import tmarun

    spec = spec_of(cin=cin, cout=64, size=size, kernel=1, padding=0, precision=precision, tile={"engine": "tma"})
    plan = build_plan(spec, target=HOPPER)
    tp = plan["tma"]
    assert tp.a_in_place and tp.a_staged
    # the stage: its planes, 1024-byte aligned, then the staging buffer of KB_PER_STAGE A tiles
    planes = 2 if tp.split else 1  # (a tf32 conv of few channels may run as fp32: the plan's mode)
    body = planes * tp.kb_per_stage * (tp.a_bytes + tp.b_bytes)
    assert tp.stage_bytes == -(-body // 1024) * 1024 + tp.kb_per_stage * tp.a_bytes
    assert tp.stage_tx == planes * tp.kb_per_stage * tp.b_bytes  # (the A boxes count on the staging barrier)
    text = render_plan(plan)
    assert "cp.async.bulk.tensor.3d.shared::cluster.global.tile" in text and "im2col" not in text
    assert "_prep(" not in text and "_prep_cl(" not in text
    assert "descriptor_mn" not in text and "descriptor(rows)" in text
    assert f"constexpr unsigned STAGING_AT = {-(-body // 1024) * 1024};" in text
    assert "mbar_init(smem_u32(&full_bar[s]), 1 + TRANSPOSERS);" in text
    assert "transpose_unit(stage + STAGING_AT + j * STAGING_BYTES, stage + j * A_BYTES, u);" in text
    assert "fence.proxy.async.shared::cta" in text
    assert text.count("const __grid_constant__ TensorMap map_a_") == 1 + (tp.split_k > 1)
    assert ("l[e] = x[e] - h[e];" in text) == tp.split
    assert ("const int i = r % 8, j = i ^ (r / 8);" in text) == (tp.bkc == 32)
    assert not any(name.endswith(("_prep", "_prep_cl")) for name in tmarun.extra_functions(plan))
    assert "no layout pass" in describe(plan)


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
@pytest.mark.parametrize("cin,size,kernel,padding,dilation", [
    (64, (56, 56), 3, 1, 1), (16, (16, 20), 3, 1, 1), (32, (16, 32, 32), 3, 1, 1), (24, (256,), 7, 3, 1),
    (40, (16, 12), 3, 2, 2),
])
def test_a_32_bit_conv_of_several_taps_reads_its_nchw_input_through_shifted_boxes(monkeypatch, precision, cin, size,
                                                                                  kernel, padding, dilation):
    """With `tma.STAGED_TAPS` on, a stride-1 conv that keeps the input's extents reads NC(D)HW in place:
    a K-block's box per m64 chunk is STAGED_SPAN positions from the tap's shifted start rounded down
    to 16 bytes, unswizzled (the map's box and swizzle say so), counted on the stage's one barrier with
    the B tiles; the consumers read their A registers from it, and the stage has no A tile."""
    from specgen import tmarun

    monkeypatch.setattr(tma, "STAGED_TAPS_MAX_TAPS", 27)  # (the 3-D conv's taps)
    spec = spec_of(cin=cin, cout=128, size=size, kernel=kernel, padding=padding, precision=precision,
                   tile={"engine": "tma"}, conv={"dilation": dilation})
    plan = build_plan(spec, target=HOPPER)
    tp = plan["tma"]
    assert tp.a_in_place and tp.a_staged and tp.a_shifted and tp.staging_row == tma.STAGED_SPAN * 4
    assert tp.a_bytes == 0
    planes = 2 if tp.split else 1
    body = planes * tp.kb_per_stage * tp.b_bytes
    staging = tp.kb_per_stage * (tp.bm // 64) * tp.bkc * tma.STAGED_SPAN * 4
    assert tp.stage_bytes == -(-body // 1024) * 1024 + staging
    assert tp.stage_tx == body + staging  # (one barrier: the boxes and the B tiles)
    text = render_plan(plan)
    assert "im2col" not in text and "_prep(" not in text
    assert "tma_nchw(staging + q * A_CHUNK_BYTES, map_a_hi, full, (chunk_p[q] + shift) & ~3, c, chunk_n[q]);" in text
    assert "a_fragments(a[j][i], stage + STAGING_AT + j * STAGING_BYTES + (wg * WM + i) * A_CHUNK_BYTES, rows[i], word," in text
    assert text.count("wgmma_rs(") == (4 if tp.split else 2)  # (the helper and its calls)
    assert "staged_bar" not in text and "TRANSPOSERS" not in text
    assert "transpose_unit(" not in text and f"constexpr int SPAN = {tma.STAGED_SPAN};" in text
    assert not any(name.endswith(("_prep", "_prep_cl")) for name in tmarun.extra_functions(plan))
    assert "shifted" in describe(plan)
    # the tiled map: boxes of STAGED_SPAN positions x BKC channels, no swizzle
    seen = {}
    monkeypatch.setattr(tmarun.runtime, "encode_tiled", lambda *args: seen.setdefault("args", args))
    tmarun._nchw_map(0, torch.float32, cin, tp, 2)
    assert seen["args"][4] == (tma.STAGED_SPAN, tp.bkc, 1) and seen["args"][5] == 0


@pytest.mark.parametrize("why,data", [
    ("strided", dict(conv={"stride": 2})),
    ("its output smaller than its input", dict(padding=0)),
    ("16-bit: the pass stays", dict(precision="bf16")),
    ("positions not whole 16-byte units (7 x 7 x 4 bytes)", dict(size=(7, 7))),
    ("positions not whole m64 tiles (12 x 20)", dict(size=(12, 20))),
    ("5x5: more taps than measured faster", dict(kernel=5, padding=2)),
    ("3x3x3: more taps than measured faster", dict(size=(8, 16, 16))),
    ("256 input channels: more than measured faster", dict(cin=256)),
    ("the pass's plan runs two blocks per SM (16 -> 64 channels)", dict(cin=16)),
    ("the switch off", dict(off=True)),
])
def test_convs_of_several_taps_the_shifted_boxes_cannot_read_keep_the_pass(monkeypatch, why, data):
    monkeypatch.setattr(tma, "STAGED_TAPS", not data.pop("off", False))
    extra = {"cin": 64, "cout": 64, "size": (32, 32), "kernel": 3, "padding": 1, "precision": "tf32", **data}
    tp = build_plan(spec_of(tile={"engine": "tma"}, **extra), target=HOPPER)["tma"]
    assert not tp.a_shifted and not tp.a_in_place, why


@pytest.mark.usefixtures("staged")
@pytest.mark.parametrize("size,staged", [((28, 28), True), ((14, 14), False), ((12, 10), True), ((200,), False)])
def test_a_32_bit_1x1_conv_is_staged_only_where_padding_m_adds_few_rows(size, staged):
    """M padded per sample to whole m64 tiles: 28^2 = 784 positions run as 832 rows (6% more) and
    are staged; 14^2 = 196 as 256 (31% more), which lost to the layout pass on the GPU, keep it."""
    plan = build_plan(spec_of(cin=64, cout=64, size=size, kernel=1, padding=0, precision="tf32", tile={"engine": "tma"}),
                      target=HOPPER)
    assert plan["tma"].a_staged == staged and plan["tma"].a_in_place == staged
    bf16 = build_plan(spec_of(cin=64, cout=64, size=size, kernel=1, padding=0, precision="bf16", tile={"engine": "tma"}),
                      target=HOPPER)
    assert bf16["tma"].a_in_place == (math.prod(size) * 2 % 16 == 0)  # (16-bit operands: no such rule)


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
def test_a_channels_last_plan_chooses_its_tile_without_a_staging_buffer(monkeypatch, precision):
    """The channels-last variant of a stageable 1x1 conv reads its input as it lies: its tile is the
    one it had before staging existed (the switch off), while the contiguous plan pays for the buffer."""
    spec = spec_of(cin=64, cout=256, size=(56, 56), kernel=1, padding=0, precision=precision, tile={"engine": "tma"})
    plans = {}
    for on in (False, True):
        monkeypatch.setattr(tma, "STAGED_NCHW", on)
        plans[on] = (build_plan(spec, None, HOPPER, None, pipeline._CHANNELS_LAST)["tma"],
                     build_plan(spec, target=HOPPER)["tma"])
    assert plans[True][0].config == plans[False][0].config and not plans[True][0].a_staged
    assert plans[True][1].a_staged and plans[True][1].smem_bytes <= HOPPER.smem_per_block


def test_the_staging_switch_gives_back_the_layout_pass(monkeypatch):
    spec = spec_of(cin=256, cout=64, size=(56, 56), kernel=1, padding=0, precision="tf32", tile={"engine": "tma"})
    monkeypatch.setattr(tma, "STAGED_NCHW", True)
    assert build_plan(spec, target=HOPPER)["tma"].a_staged
    monkeypatch.setattr(tma, "STAGED_NCHW", False)
    tp = build_plan(spec, target=HOPPER)["tma"]
    assert not tp.a_in_place and not tp.a_staged
    bf16 = spec_of(cin=256, cout=64, size=(56, 56), kernel=1, padding=0, precision="bf16", tile={"engine": "tma"})
    assert build_plan(bf16, target=HOPPER)["tma"].a_in_place  # (16-bit operands need no staging)


@pytest.mark.parametrize("why,data", [
    ("tf32 rows of positions not whole 16-byte units (7 x 7 x 4 bytes)", dict(precision="tf32", size=(7, 7))),
    ("fp32 with padding", dict(precision="fp32", padding=1)),
    ("a stride whose output rows are not whole 16-byte units (7 x 7 x 2 bytes)",
     dict(precision="bf16", conv={"stride": 2}, size=(14, 14))),
    ("padding", dict(precision="bf16", padding=1)),
    ("a 3x3 kernel", dict(precision="bf16", kernel=3, padding=1)),
    ("rows of positions not whole 16-byte units (14 x 14 x 2 bytes)", dict(precision="bf16", size=(14, 14))),
    ("positions not whole m64 tiles, and a split kernel", dict(precision="bf16", size=(12, 10), cin=1024, cout=256)),
])
def test_other_convs_keep_the_layout_pass(why, data):
    extra = {"kernel": 1, "padding": 0, "size": (16, 16), "cin": 64, "cout": 64, **data}
    plan = build_plan(spec_of(tile={"engine": "tma"}, **extra), target=HOPPER)
    assert plan["engine"] == "tma" and not plan["tma"].a_in_place, why
    assert "layout pass" in describe(plan)


@pytest.mark.parametrize("size,rows", [((28, 28), 832), ((12, 10), 128), ((200,), 256)])
def test_positions_that_are_not_whole_m64_tiles_pad_m_per_sample(size, rows):
    """M runs over the positions rounded up to whole m64 tiles per sample (every A load lies in one
    sample); the padding rows are computed on zeros and never stored; no split kernel."""
    spec = spec_of(cin=64, cout=64, size=size, kernel=1, padding=0, precision="bf16", tile={"engine": "tma"})
    plan = build_plan(spec, target=HOPPER)
    tp = plan["tma"]
    assert tp.a_in_place and tp.padded_rows and tp.grid_positions == rows and tp.split_k == 1
    text = render_plan(plan)
    assert f"constexpr int M_POSITIONS = {rows};" in text
    assert "const int m_total = batch * M_POSITIONS;" in text
    assert "row_mine[i][h] = q < POSITIONS;" in text
    # (the positions come in fours: a lane stores four of one channel, never a padding row's)
    assert tp.store_quads and "if (cq < C_OUT && mq < m_total && p < POSITIONS) {" in text
    # a padding row computes on its sample's last position, so that what the epilogue reads there
    # (an extra input of the output's shape) lies in bounds: past the last sample's last channel,
    # its own position would read beyond the tensor
    assert "row_p[i][h] = row_mine[i][h] ? q : POSITIONS - 1;" in text
    residual = spec_of(cin=64, cout=64, size=size, kernel=1, padding=0, precision="bf16", tile={"engine": "tma"},
                       epilogue=[{"add": {"input": "shortcut"}}, "relu"])
    text = render_plan(build_plan(residual, target=HOPPER))
    assert "row_p[i][h] = row_mine[i][h] ? q : POSITIONS - 1;" in text and "input_value(i_shortcut, e_out)" in text
    assert f"M padded to {rows} rows per sample" in describe(plan)
    whole = build_plan(spec_of(cin=64, cout=64, size=(16, 16), kernel=1, padding=0, precision="bf16",
                               tile={"engine": "tma"}), target=HOPPER)
    assert whole["tma"].a_in_place and not whole["tma"].padded_rows
    assert "M_POSITIONS" not in render_plan(whole)


def test_the_channels_last_plan_of_a_1x1_conv_reads_its_own_layout():
    """The channels-last variant keeps the im2col map over the channels-last input (read in place too)."""
    spec = spec_of(cin=64, cout=64, size=(16, 16), kernel=1, padding=0, precision="bf16", tile={"engine": "tma"})
    plan = build_plan(spec, None, HOPPER, None, pipeline._CHANNELS_LAST)
    assert plan["engine"] == "tma" and not plan["tma"].a_in_place and plan["tma"].channels_last_out


@pytest.mark.nvcc
@pytest.mark.usefixtures("staged")
@pytest.mark.parametrize("precision", ["bf16", "fp16", "tf32", "fp32"])
@pytest.mark.parametrize("cin,cout,size,epilogue", [
    (256, 64, (56, 56), ["relu"]),
    (64, 256, (56, 56), ["relu"]),
    (1024, 256, (8, 8), [{"add": {"input": "shortcut"}}, "relu"]),  # a split kernel
    (40, 100, (8, 8), [{"amax": {"dims": [1]}}]),  # a reduction over the channels
    (512, 128, (28, 28), ["relu"]),  # M padded per sample
    (40, 100, (12, 10), [{"softmax": 1}]),  # ... with a softmax over the channels
])
def test_nchw_in_place_kernels_compile_without_spills(precision, cin, cout, size, epilogue):
    spec = spec_of(cin=cin, cout=cout, size=size, kernel=1, padding=0, precision=precision, epilogue=epilogue,
                   tile={"engine": "tma"})
    sp = pipeline.specialize(spec, "sm_90")
    assert sp.plan["engine"] == "tma" and sp.plan["tma"].a_in_place
    assert sp.build.spill_bytes == 0, f"{sp.build.spill_bytes} bytes spilled"


@pytest.mark.nvcc
@pytest.mark.parametrize("precision", ["tf32", "fp32"])
@pytest.mark.parametrize("cin,cout,size,kernel,epilogue", [
    (128, 128, (112, 112), 3, ["relu"]),
    (64, 64, (56, 56), 3, [{"add": {"input": "shortcut"}}, "relu"]),
    (32, 64, (16, 32, 32), 3, ["relu"]),
    (256, 256, (4096,), 3, [{"gelu": {"approximate": "none"}}]),
    (16, 96, (16, 20), 5, [{"softmax": 1}]),  # a softmax over the channels
])
def test_shifted_tap_kernels_compile_without_spills(monkeypatch, precision, cin, cout, size, kernel, epilogue):
    monkeypatch.setattr(tma, "STAGED_TAPS_MAX_TAPS", 27)
    monkeypatch.setattr(tma, "STAGED_TAPS_MAX_CIN", 256)
    spec = spec_of(cin=cin, cout=cout, size=size, kernel=kernel, padding=kernel // 2, precision=precision,
                   epilogue=epilogue, tile={"engine": "tma"})
    sp = pipeline.specialize(spec, "sm_90")
    assert sp.plan["engine"] == "tma" and sp.plan["tma"].a_shifted
    assert sp.build.spill_bytes == 0, f"{sp.build.spill_bytes} bytes spilled"


@pytest.mark.parametrize("precision,size,align", [
    ("bf16", (12, 12), 16), ("bf16", (14, 14), 8), ("bf16", (10, 9), 4), ("bf16", (7, 7), 2),
    ("tf32", (7, 7), 4), ("tf32", (9, 7), 4), ("tf32", (14, 14), 16), ("fp32", (10, 9), 8),
])
def test_the_layout_pass_reads_rows_in_their_widest_aligned_pieces(precision, size, align):
    """A channel's row of the input starts as aligned as its byte length allows (x 16-byte aligned):
    the pass reads 16 bytes at a time in pieces of that width (value by value below 4 bytes)."""
    plan = build_plan(spec_of(cin=64, cout=64, size=size, precision=precision, tile={"engine": "tma"}), target=HOPPER)
    assert not plan["tma"].a_in_place
    text = render_plan(plan)
    assert f"constexpr int PREP_ALIGN = {align};" in text
    assert ("const uint2 lo = __ldg" in text) == (align == 8)
    assert ("make_uint4(__ldg(w), __ldg(w + 1)" in text) == (align == 4)


class _StubbedDriver:
    """tmarun.launch without a GPU: the driver calls stubbed out, what they were given recorded
    (`queued`: the functions launched, `grids`: their blocks, `tiled`: the tiled maps' arguments), and every tensor the
    launch allocates watched (`made`: weak references)."""

    def __init__(self, monkeypatch):
        import types
        import weakref

        from specgen import runtime, tmarun

        self.tmarun, self.made, self.queued, self.tiled, self.alive_at_launch = tmarun, [], [], [], []
        self.grids = []  # each launch's blocks
        self.addresses = []  # where each tensor made lies
        real_empty = self.real_empty = torch.empty

        def empty(*args, **kwargs):
            t = real_empty(*args, **kwargs)
            self.made.append(weakref.ref(t))
            self.addresses.append(t.data_ptr())
            return t

        self.packs = []  # each launch's argument array

        def launch_packed(kernel, fn, *args):
            fn = getattr(fn, "value", fn)
            self.queued.append(fn)
            self.grids.append(args[0])
            self.packs.append(args[3])
            if fn != "prep":  # whether what the maps read is still alive when the GEMM (or its split) is queued
                self.alive_at_launch.append(all(ref() is not None for ref in self.made))

        class Pack:
            def set(self, values):
                return self

        def tiled(*args):
            self.tiled.append(args)
            return types.SimpleNamespace(address=1)

        monkeypatch.setattr(tmarun.torch, "empty", empty)
        monkeypatch.setattr(tmarun, "_calls", {})  # (each case's launch arguments made afresh)
        monkeypatch.setattr(tmarun, "_per_thread", tmarun._PerThread())
        self.im2col = []  # the im2col maps' arguments

        def im2col(*args):
            self.im2col.append(args)
            return types.SimpleNamespace(address=1)

        monkeypatch.setattr(runtime, "encode_im2col", im2col)
        monkeypatch.setattr(runtime, "encode_tiled", tiled)
        monkeypatch.setattr(runtime, "arg_pack", lambda key, kinds: Pack())
        monkeypatch.setattr(runtime, "launch_packed", launch_packed)
        monkeypatch.setattr(tmarun, "sm_count", lambda index: 132)
        monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)

    def launch(self, data: dict, batch: int = 1, memory_format=torch.contiguous_format, record=None):
        """Plan `data` (a spec's fields) for Hopper and launch it on a random input (in
        `memory_format`; `record` as tmarun.launch takes it); the plan."""
        import types

        spec = validate({"name": "ws", "epilogue": ["relu"], **data})
        plan = build_plan(spec, target=HOPPER)
        name = plan["kernel_name"]
        kernel = types.SimpleNamespace(function=types.SimpleNamespace(value="main"),
                                       extra={f"{name}_prep": "prep", f"{name}_prep_cl": "prep_cl",
                                              **{n: n for n in splitk.kernel_names(name)}})
        sp = types.SimpleNamespace(plan=plan, spec=spec, key=f"stub-{len(self.queued)}-{name}-{spec.precision}")
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.precision, torch.float32)
        weight = torch.randn(spec.weight_shape()).to(dtype)
        bias = torch.randn(spec.conv.out_channels).to(dtype)
        self.x = torch.randn(batch, spec.input.channels, *spec.input.size).to(dtype).to(memory_format=memory_format)
        self.tmarun.launch(sp, kernel, self.x, weight, bias, {}, self.real_empty(1), 0, record)
        return plan


@pytest.mark.parametrize("what,data,batch,memory_format,queued", [
    ("3xTF32 planes from a contiguous input", dict(precision="fp32", input={"channels": 64, "size": [56, 56]},
     conv={"out_channels": 64, "kernel": 3, "padding": 1}, tile={"engine": "tma"}), 8, torch.contiguous_format,
     ["prep", "main"]),
    ("a channels-last input", dict(precision="fp32", input={"channels": 64, "size": [56, 56]},
     conv={"out_channels": 64, "kernel": 3, "padding": 1}, tile={"engine": "tma"}), 8, torch.channels_last,
     ["prep_cl", "main"]),
    ("a channels-last tf32 input read in place", dict(precision="tf32", input={"channels": 64, "size": [56, 56]},
     conv={"out_channels": 64, "kernel": 3, "padding": 1}, tile={"engine": "tma"}), 8, torch.channels_last, ["main"]),
    ("a contiguous tf32 input read in place, staged", dict(precision="tf32", input={"channels": 64, "size": [16, 16]},
     conv={"out_channels": 128, "kernel": 1}, tile={"engine": "tma"}), 2, torch.contiguous_format, ["main"]),
    ("split K at batch 1", dict(precision="fp32", input={"channels": 512, "size": [7, 7]},
     conv={"out_channels": 512, "kernel": 3, "padding": 1}, tile={"engine": "tma"}), 1, torch.contiguous_format,
     ["prep", "split", "reduce"]),
    ("a contiguous 16-bit input read in place", dict(precision="bf16", input={"channels": 64, "size": [16, 16]},
     conv={"out_channels": 128, "kernel": 1}, tile={"engine": "tma"}), 2, torch.contiguous_format, ["main"]),
    ("3xTF32 from a contiguous input read in place, taps shifted", dict(
     precision="fp32", input={"channels": 64, "size": [56, 56]}, conv={"out_channels": 64, "kernel": 3, "padding": 1},
     tile={"engine": "tma"}, shifted=True), 8, torch.contiguous_format, ["main"]),
])
def test_a_recorded_tma_launch_repeats_with_new_addresses(monkeypatch, what, data, batch, memory_format, queued):
    """`tmarun.launch(record=...)` keeps the call's launches (`Launches`): repeated, they queue
    the same kernels with the new input's, workspace's and output's addresses, the layer's own
    arguments as set, and the input's maps made once per address. Driver calls stubbed out."""
    from specgen import tmarun

    data = dict(data)
    monkeypatch.setattr(tma, "STAGED_TAPS", data.pop("shifted", False))  # (the 3x3 convs: the layout pass, but one)
    stub = _StubbedDriver(monkeypatch)
    record = []
    plan = stub.launch(data, batch, memory_format, record)
    name = plan["kernel_name"]
    names = {"prep": "prep", "prep_cl": "prep_cl", "main": "main",
             "split": splitk.kernel_names(name)[0], "reduce": splitk.kernel_names(name)[-1]}
    assert stub.queued == [names[q] for q in queued], what
    (launches, held), = record
    assert isinstance(launches, tmarun.Launches) and held, what
    first = list(stub.packs)
    stub.queued.clear(), stub.packs.clear()
    x2 = stub.x.clone(memory_format=memory_format)
    out = torch.empty(4)
    launches.run(x2.data_ptr(), [], out.data_ptr(), 0, torch.device("cpu"))
    assert stub.queued == [names[q] for q in queued], what
    assert stub.packs == first, f"{what}: the recorded launches keep their own argument arrays"
    packs = dict(zip(queued, stub.packs))
    last = stub.packs[-1]  # the main kernel or the reduction: the output's address last but the batch
    assert last._ptrs[len(last.kinds) - 2] == out.data_ptr() and last._ints[len(last.kinds) - 1] == batch, what
    if "prep" in queued or "prep_cl" in queued:
        prep = packs.get("prep") or packs["prep_cl"]
        assert prep._ptrs[0] == x2.data_ptr(), what
        ws = stub.addresses[-1]  # the workspace, made by this call
        assert prep._ptrs[1] == ws, what
        if "split" in queued:  # the partial sums lie in the same workspace, past the planes
            assert packs["reduce"]._ptrs[0] == packs["split"]._ptrs[len(packs["split"].kinds) - 2] > ws, what
        assert stub.im2col[-1][1] >= ws, f"{what}: the maps are of the workspace's planes"
    elif memory_format == torch.channels_last:  # read in place: its map is of x2 itself
        assert stub.im2col[-1][1] == x2.data_ptr(), what
    again, seen = len(stub.im2col), {stub.im2col[i][1] for i in range(len(stub.im2col))}
    made = len(stub.addresses)
    launches.run(x2.data_ptr(), [], out.data_ptr(), 0, torch.device("cpu"))
    # (the maps are of x2 itself, or of this call's workspace: made where its address is new)
    address = stub.addresses[-1] if len(stub.addresses) > made else x2.data_ptr()
    assert (len(stub.im2col) == again) == (address in seen or "nchw" == launches.mode), what


@pytest.mark.parametrize("kept", [True, False])
def test_a_recorded_tma_launch_keeps_its_workspace_per_stream(monkeypatch, kept):
    """`torchop._TmaReplay` (what a FusedLayer's repeat calls run) keeps a small workspace per
    stream: repeat calls on one stream allocate nothing and make the maps over its planes once; a
    call on another stream gets its own. A workspace over the limit is allocated per call.
    Driver calls stubbed out."""
    from specgen import torchop

    stub = _StubbedDriver(monkeypatch)
    record = []
    stub.launch(dict(precision="fp32", input={"channels": 512, "size": [7, 7]},
                     conv={"out_channels": 512, "kernel": 3, "padding": 1}, tile={"engine": "tma"}),
                1, torch.contiguous_format, record)
    (launches, _), = record
    assert launches.ws_bytes > 0 and launches.prep is not None and launches.partial_at is not None
    monkeypatch.setattr(torchop, "KEPT_WORKSPACE_BYTES", launches.ws_bytes if kept else launches.ws_bytes - 1)
    replay = torchop._TmaReplay(launches, 0, torch.device("cpu"))
    x2, out = stub.x.clone(), torch.empty(4)
    replay.values[0], replay.values[-1] = x2.data_ptr(), out.data_ptr()
    made, maps = len(stub.addresses), len(stub.im2col)
    stub.queued.clear()
    for _ in range(3):
        replay.launch(0)
    assert len(stub.queued) == 9, "three calls of three launches (layout pass, split, reduction)"
    assert len(stub.addresses) - made == (1 if kept else 3)
    ws = stub.addresses[made]
    prep = stub.packs[-3]
    assert prep._ptrs[1] == stub.addresses[-1] and prep._ptrs[0] == x2.data_ptr()
    if kept:
        assert len(stub.im2col) - maps <= 2, "the maps over the kept planes are made once (hi and lo)"
        assert replay.workspaces[0].data_ptr() == ws
        replay.launch(7)
        assert len(stub.addresses) - made == 2 and set(replay.workspaces) == {0, 7}
        assert stub.packs[-3]._ptrs[1] == replay.workspaces[7].data_ptr() != ws
    else:
        assert replay.workspaces is None


@pytest.mark.parametrize("data", [
    dict(precision="bf16", input={"channels": 64, "size": [14, 14]},
         conv={"out_channels": 300, "kernel": 3, "padding": 1}),  # the layout pass, a 16-bit bias widened
    dict(precision="fp32", input={"channels": 64, "size": [9, 9]},
         conv={"out_channels": 64, "kernel": 3, "padding": 1}, tile={"engine": "tma"}),  # hi and lo planes
    dict(precision="bf16", input={"channels": 32, "size": [8, 8]},
         conv={"out_channels": 32, "kernel": 4, "stride": 2, "padding": 1, "transposed": True}),  # stride phases
])
def test_the_layout_pass_workspace_outlives_the_launches(monkeypatch, data):
    """The workspace the layout pass writes must be held until the main kernel is queued: freed
    earlier, torch's allocator may hand its block to the next allocation on the stream (a widened
    16-bit bias), whose write lands before the main kernel reads. Driver calls stubbed out."""
    stub = _StubbedDriver(monkeypatch)
    plan = stub.launch(data)
    assert plan["engine"] == "tma" and not plan["tma"].a_in_place
    name = plan["kernel_name"]
    # the pass, then the GEMM (or its split and reduction), and a workspace was made
    assert stub.queued[0] == "prep" and stub.queued[1:] in (["main"], list(splitk.kernel_names(name))) and stub.made
    assert stub.alive_at_launch and all(stub.alive_at_launch), "a tensor the maps read was freed before the launch"


@pytest.mark.parametrize("size,stride,out,padded", [
    ((56, 56), 2, (28, 28), True), ((31, 33), 2, (16, 17), True), ((64, 64), 2, (32, 32), False),
    ((3, 8, 16), (1, 2, 2), (3, 4, 8), True), ((383,), 3, (128,), False),
])
def test_a_strided_1x1_conv_reads_its_subsampled_input_in_place(monkeypatch, size, stride, out, padded):
    """A 16-bit 1x1 conv of stride > 1 without padding is the stride-1 conv of its input's every
    stride-th position: the launch copies those out (contiguous) and the kernel reads the copy in
    place; no layout pass. The kernel is the stride-1 kernel of the output's size."""
    strides = stride if isinstance(stride, tuple) else (stride,) * len(size)
    data = dict(precision="bf16", input={"channels": 64, "size": list(size)},
                conv={"out_channels": 128, "kernel": 1, "stride": list(strides)}, tile={"engine": "tma"})
    stub = _StubbedDriver(monkeypatch)
    plan = stub.launch(data, batch=3)
    tp = plan["tma"]
    assert tp.a_in_place and tp.subsample == strides and tp.padded_rows == padded
    assert tp.positions == math.prod(out) and "prep" not in stub.queued and stub.queued == ["main"]
    args = stub.tiled[-1]  # the input's map (after the weights'): [batch][C_IN][output positions] of the copy
    assert args[2] == (math.prod(out), 64, 3) and args[-1] == 3 * 64 * math.prod(out) * 2
    assert args[1] != stub.x.data_ptr()  # (the copy, not the input)
    assert "stride-1 conv of that copy" in render_plan(plan) and "copied out first" in describe(plan)
    # the same kernel as the stride-1 conv over the output's size, but for the spec it was rendered from
    same = dict(data, input={"channels": 64, "size": list(out)}, conv={"out_channels": 128, "kernel": 1})
    code = lambda p: [l for l in render_plan(p).splitlines()  # noqa: E731
                      if not l.startswith("//") and not re.match(r"constexpr int (IN_|K_|IN_POSITIONS)", l)]
    assert code(plan) == code(build_plan(validate({"name": "ws", "epilogue": ["relu"], **same}), target=HOPPER))


@pytest.mark.parametrize("data", [
    dict(precision="tf32", conv={"out_channels": 64, "kernel": 1, "stride": 4}),  # 7^2 out: 196-byte rows
    dict(precision="bf16", conv={"out_channels": 64, "kernel": 1, "stride": 2, "padding": 1}),  # padded
    dict(precision="bf16", conv={"out_channels": 64, "kernel": 1, "stride": 4}),  # 7^2 out: 98-byte rows
])
def test_strided_1x1_convs_the_map_cannot_read_keep_the_pass(data):
    spec = validate({"name": "s", "input": {"channels": 64, "size": [28, 28]}, "epilogue": ["relu"],
                     "tile": {"engine": "tma"}, **data})
    tp = build_plan(spec, target=HOPPER)["tma"]
    assert not tp.a_in_place and tp.subsample == ()


@pytest.mark.parametrize("why,data,quads", [
    ("NCHW bf16, 28^2", {"precision": "bf16"}, True),
    ("NCHW fp16", {"precision": "fp16"}, True),
    ("NCHW tf32 (eight floats of a channel already fill a sector)", {"precision": "tf32"}, False),
    ("NCHW 3xTF32", {"precision": "fp32"}, False),
    ("positions not in fours (7^2)", {"precision": "bf16", "size": (7, 7)}, False),
    ("1-D, 30 positions", {"precision": "bf16", "size": (30,)}, False),
    ("a transposed conv's stride phases", {"precision": "bf16", "conv": {"transposed": True, "stride": 2}}, False),
    ("a sum over the channels", {"precision": "bf16", "epilogue": ["relu", {"sum": {"dims": [1]}}]}, False),
])
def test_an_nchw_output_stores_four_positions_of_a_channel_at_once(why, data, quads):
    """A 16-bit output whose positions come in fours: each lane's values are transposed across its
    group of four lanes and leave as four neighbouring positions of one channel (8 bytes)."""
    extra = {"kernel": 3, "padding": 1, "size": (28, 28), "cin": 64, "cout": 64, **data}
    plan = build_plan(spec_of(tile={"engine": "tma"}, **extra), target=HOPPER)
    assert plan["engine"] == "tma" and plan["tma"].store_quads == quads, why
    text = render_plan(plan)
    assert ("transpose4(q, r, 4);" in text) == quads, why
    if quads:
        assert "store_v2(o, " in text, why


@pytest.mark.parametrize("why,data,quads", [
    ("bf16, 64 channels", {"precision": "bf16"}, True),
    ("fp16, 48 channels (n8 blocks in pairs: BN 48)", {"precision": "fp16", "cout": 48}, True),
    ("bf16, 60 channels (not in eights)", {"precision": "bf16", "cout": 60}, False),
    ("tf32 (its float pairs already fill whole sectors)", {"precision": "tf32"}, False),
    ("a transposed conv's stride phases", {"precision": "bf16", "conv": {"transposed": True, "stride": 2}}, False),
])
def test_a_channels_last_16_bit_output_stores_eight_channels_of_a_row_at_once(why, data, quads):
    """Channels-last: each lane's channel pairs of two n8 blocks are transposed across its quad and
    leave as eight neighbouring channels of one row (16 bytes)."""
    extra = {"kernel": 3, "padding": 1, "size": (28, 28), "cin": 64, "cout": 64, **data}
    plan = build_plan(spec_of(tile={"engine": "tma"}, **extra), None, HOPPER, None, pipeline._CHANNELS_LAST)
    tp = plan["tma"]
    assert plan["engine"] == "tma" and tp.channels_last_out and tp.store_quads == quads, why
    if quads:
        assert tp.bn % 16 == 0, why
    text = render_plan(plan)
    assert ("transpose4(q, tq, 1);" in text) == quads, why
    assert ("store_v4(out + " in text) == quads, why


def test_quad_stores_are_left_out_where_an_extra_input_meets_128_accumulators():
    """A residual's reads beside 128 accumulators a thread: the quads' held values spilled 200 bytes
    (16 one value at a time), so such a plan stores a value at a time; 64 accumulators keep them."""
    wide = spec_of(cin=256, cout=512, kernel=1, padding=0, size=(28, 28), precision="bf16",
                   epilogue=[{"add": {"input": "r"}}, "relu"], tile={"engine": "tma"})
    tp = build_plan(wide, target=HOPPER)["tma"]
    assert tp.acc_regs == 128 and not tp.store_quads
    assert build_plan(spec_of(cin=256, cout=512, kernel=1, padding=0, size=(28, 28), precision="bf16",
                              tile={"engine": "tma"}), target=HOPPER)["tma"].store_quads
    narrow = spec_of(cin=64, cout=64, size=(28, 28), precision="bf16", epilogue=[{"add": {"input": "r"}}, "relu"],
                     tile={"engine": "tma"})
    tp = build_plan(narrow, target=HOPPER)["tma"]
    assert tp.acc_regs <= 64 and tp.store_quads


@pytest.mark.parametrize("data,batch,persistent", [
    (dict(precision="bf16", input={"channels": 64, "size": [56, 56]}, conv={"out_channels": 256, "kernel": 1}), 64, True),
    (dict(precision="bf16", input={"channels": 64, "size": [56, 56]}, conv={"out_channels": 256, "kernel": 1}), 1, True),
    (dict(precision="tf32", input={"channels": 64, "size": [28, 28]},
          conv={"out_channels": 64, "kernel": 3, "padding": 1}), 16, True),
    (dict(precision="bf16", input={"channels": 32, "size": [8, 8]},
          conv={"out_channels": 32, "kernel": 4, "stride": 2, "padding": 1, "transposed": True}), 64, False),
])
def test_the_main_kernel_is_launched_with_the_blocks_the_sms_hold(monkeypatch, data, batch, persistent):
    """Each block of the main kernel walks tiles blockIdx.x, + gridDim.x, ...: it is launched with
    min(tiles, SMs x blocks per SM) blocks (the producer then loads a tile's stages while the
    consumers finish the one before). Stride phases keep a block per tile (the block's phase is
    picked from blockIdx.x), and so does the split kernel. Driver calls stubbed out (132 SMs)."""
    stub = _StubbedDriver(monkeypatch)
    plan = stub.launch(data, batch=batch)
    tp = plan["tma"]
    tiles = -(-batch * (tp.grid_positions or tp.positions) // tp.bm) * tp.n_tiles * tp.grid_gemms
    launched = dict(zip(stub.queued, stub.grids))
    name = plan["kernel_name"]
    split = splitk.kernel_names(name)
    if split[0] in launched:  # (the split kernel ran instead: a block per tile, its parts along y)
        assert launched[split[0]] == tiles and "main" not in launched
        return
    assert tp.persistent == persistent
    assert ("each block walking tiles" in describe(plan)) == persistent
    assert launched["main"] == (min(tiles, 132 * tp.blocks_per_sm) if persistent else tiles)
    text = render_plan(plan)
    walks = "for (int tile = blockIdx.x; tile < tile_total; tile += gridDim.x, it0 += ITERS) {"
    assert text.count(walks) == (2 if persistent else 0)  # (the producer's and the consumers')
    assert text.count("const int tile = blockIdx.x, it0 = 0;") == (0 if persistent else 2)
    # (the last stage of each tile is given back before the next tile's loads wait on it)
    assert ("mbar_arrive(smem_u32(&empty_bar[(it0 + ITERS - 1) % STAGES]));" in text) == (persistent and not tp.split)


def test_a_softmax_over_the_channels_keeps_a_block_per_tile():
    """Its epilogue in the tile loop spilled 972 bytes: such plans keep a block per tile."""
    spec = spec_of(cin=16, cout=256, size=(20, 22), precision="bf16", epilogue=["relu", {"softmax": {"dim": 1}}],
                   tile={"engine": "tma"})
    tp = build_plan(spec, target=HOPPER)["tma"]
    assert tp.channel_norm and not tp.persistent


@pytest.mark.nvcc
@pytest.mark.parametrize("precision,cin", [("bf16", 64), ("fp16", 48), ("tf32", 64), ("fp32", 8)])
def test_the_layout_pass_writes_whole_16_byte_vectors(precision, cin):
    """The layout pass writes each thread's channels of a position as one 16-byte store (two for
    3xTF32's planes). nvcc had split the C++ vector stores into 4-byte ones, which fill a quarter of
    a sector each: the bf16 pass ran at 1.35 TB/s. The stores are PTX, so the PTX shows them whole."""
    from specgen import compile as compile_mod

    plan = build_plan(spec_of(cin=cin, cout=64, size=(28, 28), precision=precision, tile={"engine": "tma"}), target=HOPPER)
    assert plan["engine"] == "tma" and not plan["tma"].a_in_place
    ptx = compile_mod.compile_ptx(render_plan(plan), "sm_90a")
    prep = re.search(r"\.entry \w+_prep\(.*?\n}\n", ptx, re.S)
    assert prep is not None, "no layout pass in the PTX"
    stores = re.findall(r"st\.global[.\w]*", prep.group(0))
    assert stores and set(stores) == {"st.global.v4.b32"}, stores


@pytest.mark.parametrize("cin, precision, bm, blocks, stages", [
    (192, "tf32", 256, 1, 4),  # deep K: one block of 4 (two of 2 measured 1.54x-1.67x slower, NOTES v50)
    (64, "tf32", 256, 1, 4),  # shallow K too (two of 2 measured 1.09x-1.15x slower, NOTES v64)
    (96, "tf32", 256, 2, 3),  # 32 output channels: two blocks of 3 stages fit
    (64, "bf16", 128, 2, 4),  # 16-bit: two blocks of 128 rows, 4 stages each (1.07x-1.08x, NOTES v64)
])
def test_two_blocks_per_sm_only_with_three_stages_each(monkeypatch, cin, precision, bm, blocks, stages):
    """Up to 64 output channels two blocks share an SM only where each keeps a pipeline of
    TWO_BLOCK_MIN_STAGES stages: a 256 x 64 tile of 128-byte K stages gets 2, so tf32 runs one
    block of 4 and bf16 / fp16 two blocks of 128 x 64 tiles. (Behind the layout pass: the stages
    of a conv reading its taps in place have no A tile.)"""
    monkeypatch.setattr(tma, "STAGED_TAPS", False)
    spec = validate({"name": "t", "input": {"channels": cin, "size": [64, 64]},
                      "conv": {"out_channels": 64 if cin != 96 else 32, "kernel": 3, "padding": 1, "bias": False},
                      "epilogue": ["batch_norm", "relu"], "precision": precision})
    cfg = build_plan(spec)["tma"].config
    assert (cfg.bm, cfg.blocks_per_sm, cfg.stages) == (bm, blocks, stages)
    assert cfg.blocks_per_sm == 1 or cfg.stages >= tma.TWO_BLOCK_MIN_STAGES


def test_a_transposed_convs_blocks_keep_two_blocks_of_two_stages():
    """A strided transposed conv's blocks hold one tile each (its stride phases are not walked), so
    two blocks per SM still hide one's fill and epilogue behind the other: 2 stages each stay."""
    spec = validate({"name": "t", "input": {"channels": 64, "size": [32, 32]},
                      "conv": {"out_channels": 64, "kernel": 4, "stride": 2, "padding": 1, "bias": False,
                               "transposed": True},
                      "epilogue": ["relu"], "precision": "tf32"})
    plan = build_plan(spec, target=HOPPER)
    assert plan["engine"] == "tma"
    cfg = plan["tma"].config
    assert cfg.blocks_per_sm == 2 and cfg.stages >= tma.TWO_BLOCK_TRANSPOSED_MIN_STAGES


def test_tiles_whose_input_rows_overflow_l2_come_last():
    """A 3x3 conv's taps re-read the input rows the SMs' tiles hold: 384 channels in tf32 on 256-row
    tiles keep 52 MB in flight, past L2_WORKING_SET, so 128-row tiles win (UNet's up3_0, 1.37x
    faster, NOTES v64); 128 channels keep 256 x 128. A 1x1 conv reads each row once: no limit."""
    def cfg(cin, kernel):
        spec = validate({"name": "t", "input": {"channels": cin, "size": [32, 32]},
                          "conv": {"out_channels": 128, "kernel": kernel, "padding": kernel // 2, "bias": False},
                          "epilogue": ["relu"], "precision": "tf32"})
        return build_plan(spec, target=HOPPER)["tma"].config
    assert (cfg(384, 3).bm, cfg(384, 3).bn) == (128, 128)
    assert (cfg(128, 3).bm, cfg(128, 3).bn) == (256, 128)
    # `specgen show --plan` says why, only where the limit decided it
    def note(cin):
        spec = validate({"name": "t", "input": {"channels": cin, "size": [32, 32]},
                          "conv": {"out_channels": 128, "kernel": 3, "padding": 1, "bias": False},
                          "epilogue": ["relu"], "precision": "tf32"})
        return tma.describe(build_plan(spec, target=HOPPER)["tma"])
    assert "128 x 128 tiles, not 256 x 128: those would keep 52 MB of input rows in flight" in note(384)
    assert "MB of input rows in flight" not in note(128)
    spec512 = validate({"name": "t", "input": {"channels": 512, "size": [14, 14]},
                        "conv": {"out_channels": 512, "kernel": 3, "padding": 1}, "epilogue": ["relu"], "precision": "tf32"})
    assert "MB of input rows in flight" not in tma.describe(build_plan(spec512, target=HOPPER)["tma"])  # (fewer waves chose it)
    shapes = tma.candidates(128, 64 * 1024, False, 132, tap_row_bytes=384 * 4)
    over = [s for s in shapes if s[0] * 384 * 4 * min(-(-64 * 1024 // s[0]) * -(-128 // s[1]), 132) > tma.L2_WORKING_SET]
    assert over and shapes[-len(over):] == over
    assert tma.candidates(128, 64 * 1024, False, 132)[0] == (256, 128)


def test_the_tile_cost_prefers_fewer_larger_tiles_over_full_waves_of_small_ones():
    """256 channels at 14^2, batch 64 (M = 12544): 98 tiles of 256 x 128 fill 98 of 132 SMs once,
    392 of 128 x 64 three waves; the larger tiles measured 1.25x faster (NOTES v64)."""
    assert tma.candidates(256, 64 * 196, False, 132)[0] == (256, 128)


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
@pytest.mark.parametrize("cin,cout,size", [(64, 64, (56, 56)), (128, 128, (112, 112)), (96, 128, (32, 32)),
                                            (32, 128, (8, 16, 16))])
def test_a_conv_reading_its_taps_in_place_gets_the_tile_the_pass_would_get(monkeypatch, precision, cin, cout, size):
    """The stage of a conv reading its taps in place has no A tile, so a taller tile would fit; taken,
    it ran at 0.54x at batch 1 (fp32 64 -> 64 at 56^2, 13 blocks of 256 x 64: NOTES v71). It gets
    the pass's tile, as deep as its own stages fit."""
    monkeypatch.setattr(tma, "STAGED_TAPS_MAX_TAPS", 27)
    spec = spec_of(cin=cin, cout=cout, size=size, kernel=3, padding=1, precision=precision)
    shifted = build_plan(spec, target=HOPPER)["tma"]
    monkeypatch.setattr(tma, "STAGED_TAPS", False)
    passed = build_plan(spec, target=HOPPER)["tma"]
    assert shifted.a_shifted and not passed.a_in_place
    assert (shifted.bm, shifted.bn, shifted.kb_per_stage, shifted.blocks_per_sm) == \
        (passed.bm, passed.bn, passed.kb_per_stage, passed.blocks_per_sm)
    assert shifted.stages >= passed.stages and shifted.smem_bytes <= HOPPER.smem_per_block


@pytest.mark.parametrize("precision", ["tf32", "fp32"])
@pytest.mark.parametrize("cin,cout,size", [(16, 64, (40, 40)), (64, 64, (56, 56)), (96, 32, (64, 64)),
                                           (128, 128, (112, 112))])
def test_every_tuning_candidate_of_a_conv_reading_its_taps_in_place_plans(precision, cin, cout, size):
    """`specgen tune`'s candidates (`tma.configs`) for a conv that can read its taps in place all plan:
    a two-block one keeps the pass (`plan`), so its depth is counted on stages with an A tile (with
    the stages without one, 7 of 56 such candidates here did not fit two blocks on an SM)."""
    spec = spec_of(cin=cin, cout=cout, size=size, kernel=3, padding=1, precision=precision, tile={"engine": "tma"})
    assert tma.reads_nchw_staged_taps(spec)
    for cfg in tma.configs(spec, HOPPER):
        tp = build_plan(spec, target=HOPPER, tma_config=cfg)["tma"]
        assert tp.a_shifted == (cfg.blocks_per_sm == 1), cfg

"""The implicit-GEMM engine without a GPU: engine choice, tiling arithmetic, rendering, nvcc
resources (no spills), and the weight layout the launch prepares."""

from __future__ import annotations

import pytest

from specgen import igemm, pipeline
from specgen.target import BUILTIN
from specgen.plan import PlanError, build_plan, describe
from specgen.render import render_plan
from specgen.spec import validate



def spec_of(cin=64, cout=128, size=(14, 14), kernel=3, epilogue=("relu",), **extra):
    data = {"name": "ig", "input": {"channels": cin, "size": list(size)},
            "conv": {"out_channels": cout, "kernel": kernel, "padding": 1}, "epilogue": list(epilogue), **extra}
    return validate(data)


# Hopper's own engine (TMA, specgen/tma.py) takes these layers on sm_90 when left to the planner;
# the implicit GEMM is what every other target gets.
AMPERE = BUILTIN["sm_80"]


def test_deep_layers_take_the_implicit_gemm():
    plan = build_plan(spec_of(), target=AMPERE)
    assert plan["engine"] == "igemm"
    ig = plan["igemm"]
    assert ig.k_pad == 9 * 64 and ig.k_tiles * ig.bk == ig.k_pad
    assert ig.n_tiles == -(-128 // ig.bn)
    assert "implicit GEMM" in describe(plan)


def test_the_seeds_few_channels_stay_on_the_slab_engine():
    assert build_plan(spec_of(cin=8, cout=64, size=(16, 16)))["engine"] == "slab"
    assert build_plan(spec_of(cin=8, cout=64, size=(16, 16)), target=AMPERE)["engine"] == "slab"


@pytest.mark.parametrize("epilogue,conv,why", [
    (["relu", {"max_pool": {"kernel": 2}}], {}, "a pool follows the conv"),
    (["relu", {"sum": {"dims": [1]}}], {}, "the epilogue reduces"),
    (["relu"], {"groups": 4}, "the conv has groups"),
])
def test_asking_for_igemm_where_it_cannot_run_says_why(epilogue, conv, why):
    data = {"name": "ig", "input": {"channels": 16, "size": [12, 12]},
            "conv": {"out_channels": 32, "kernel": 3, **conv}, "epilogue": epilogue, "tile": {"engine": "igemm"}}
    with pytest.raises(PlanError) as err:
        build_plan(validate(data))
    assert "tile.engine" in str(err.value) and why in str(err.value)


def test_other_engines_can_be_asked_for():
    assert build_plan(spec_of(tile={"engine": "ffma"}))["engine"] == "ffma"
    assert build_plan(spec_of(tile={"tensor_cores": False}))["engine"] == "ffma"


@pytest.mark.parametrize("cin,cip,bk,tpc", [(64, 64, 32, 1), (48, 48, 16, 1), (24, 24, 8, 1), (20, 24, 8, 1),
                                            (3, 4, 16, 4), (1, 1, 8, 8), (12, 16, 32, 2), (5, 8, 32, 4)])
def test_channel_padding_and_k_chunks(cin, cip, bk, tpc):
    ig = build_plan(spec_of(cin=cin, cout=32, tile={"engine": "igemm"}), target=BUILTIN["sm_80"])["igemm"]  # mma.sync
    assert (ig.cip, ig.bk, ig.tpc) == (cip, bk, tpc)
    assert ig.taps_pad % ig.tpc == 0 and ig.taps_pad >= 9 and ig.k_pad == ig.taps_pad * ig.cip


@pytest.mark.parametrize("cin,cout,precision,wgmma", [(64, 64, "fp32", True), (64, 128, "tf32", True),
                                                      (64, 128, "fp32", False), (64, 256, "tf32", False),
                                                      (48, 64, "tf32", False), (12, 64, "tf32", True)])
def test_hopper_takes_wgmma_where_the_sweep_found_it_faster(cin, cout, precision, wgmma):
    ig = build_plan(spec_of(cin=cin, cout=cout, precision=precision, tile={"engine": "igemm"}))["igemm"]
    assert ig.wgmma is wgmma
    if wgmma:
        assert ig.bk == 32 and ig.bn == cout and ig.threads == 384
    other = build_plan(spec_of(cin=cin, cout=cout, precision=precision), target=BUILTIN["sm_89"])["igemm"]
    assert not other.wgmma  # targets without wgmma get mma.sync


def test_one_by_one_convs_copy_four_positions_at_once():
    one = validate({"name": "p", "input": {"channels": 32, "size": [8, 12]}, "conv": {"out_channels": 64, "kernel": 1}})
    assert build_plan(one, target=AMPERE)["igemm"].a_vec == 4
    assert build_plan(spec_of(), target=AMPERE)["igemm"].a_vec == 1  # a padded 3 x 3 conv reads unaligned rows


def test_tf32_and_fp32_differ_only_in_the_split():
    fp32 = render_plan(build_plan(spec_of(), target=AMPERE))
    tf32 = render_plan(build_plan(spec_of(precision="tf32"), target=AMPERE))
    assert "split_tf32" in fp32 and "3xTF32" in fp32 and "part[" in fp32
    assert "split_tf32" not in tf32 and "tf32_round" in tf32


def test_every_extent_is_a_literal():
    text = render_plan(build_plan(spec_of(cin=64, cout=96, size=(10, 12)), target=AMPERE))
    for line in ("constexpr int C_IN = 64;", "constexpr int C_OUT = 96;", "constexpr int K_TILES =",
                 "constexpr int OUT_D = 1, OUT_H = 10, OUT_W = 12;"):
        assert line in text
    assert "static constexpr int taps = TAPS, taps_pad = TAPS_PAD, k_pad = K_PAD, k_tiles = K_TILES;" in text
    assert "constexpr int ITERS = G::k_tiles / PARTS;" in text  # (PARTS: 1, or SPLIT_K in the split kernel)
    assert "#pragma unroll 1\n  for (int kt = 0; kt < ITERS; ++kt)" in text


def test_a_tile_that_does_not_fit_is_refused():
    spec = spec_of(tile={"engine": "igemm"})
    with pytest.raises(PlanError) as err:
        build_plan(spec, igemm.IgemmConfig(8, 4, 4, 8, 32, 8))  # far past shared memory
    assert "tile" in str(err.value)


@pytest.mark.nvcc
@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("cin,cout,kernel,size", [(64, 64, 3, (20, 20)), (256, 256, 3, (7, 7)),
                                                  (3, 24, 7, (30, 30)), (64, 256, 1, (8, 8)), (32, 16, (3, 3, 3), (6, 6, 6))])
def test_default_tiles_compile_without_spills(precision, cin, cout, kernel, size):
    spec = spec_of(cin=cin, cout=cout, kernel=kernel, size=size, precision=precision, tile={"engine": "igemm"})
    sp = pipeline.specialize(spec)
    assert sp.plan["engine"] == "igemm"
    assert sp.build.spill_bytes == 0, f"{sp.build.spill_bytes} bytes spilled"
    assert sp.build.registers <= 255


def test_the_launch_permutes_the_weights_tap_major_with_zero_padding():
    torch = pytest.importorskip("torch")
    from specgen import torchop

    w = torch.randn(8, 3, 3, 3)
    layout = (3, 9, 4, 10)  # c_in, taps, padded c_in, padded taps
    p = torchop.gemm_weight(w, layout)
    assert p.shape == (8, 10, 4)
    torch.testing.assert_close(p[:, :9, :3], w.reshape(8, 3, 9).transpose(1, 2), rtol=0, atol=0)
    assert p[:, 9].abs().sum() == 0 and p[:, :, 3].abs().sum() == 0
    assert torchop.gemm_weight(w, layout) is p  # kept while the weights are unchanged
    with torch.no_grad():
        w.add_(1.0)
    q = torchop.gemm_weight(w, layout)
    assert q is not p and torch.equal(q[:, :9, :3], w.reshape(8, 3, 9).transpose(1, 2))


# ---- split K ------------------------------------------------------------------------------------------

def test_a_deep_layer_with_few_positions_gets_a_split_kernel():
    """512 channels at 7x7 (49 positions): one M tile, a few N tiles, K = 4608."""
    plan = build_plan(spec_of(cin=512, cout=512, size=(7, 7)), target=AMPERE)
    ig = plan["igemm"]
    assert ig.split_k > 1 and ig.k_tiles % ig.split_k == 0 and ig.split_iters == ig.k_tiles // ig.split_k
    assert ig.cout == 512 and "K split" in describe(plan)
    text = render_plan(plan)
    assert f"constexpr int SPLIT_K = {ig.split_k};" in text
    assert "gemm<Conv, SPLIT_K>(" in text and "_reduce(" in text
    reduce = text[text.index("_reduce(\n"):]
    assert "for (int part = 0; part < SPLIT_K; ++part) sum +=" in reduce and "fmaxf(v, 0.0f)" in reduce
    assert "atomic" not in text


def test_wide_layers_and_transposed_convs_get_no_split_kernel():
    wide = build_plan(spec_of(cin=64, cout=64, size=(112, 112)), target=AMPERE)
    assert wide["igemm"].split_k == 1 and "SPLIT_K" not in render_plan(wide)
    up = validate({"name": "up", "input": {"channels": 256, "size": [7, 7]},
                   "conv": {"out_channels": 256, "kernel": 4, "stride": 2, "padding": 1, "transposed": True},
                   "epilogue": ["relu"], "tile": {"engine": "igemm"}})
    plan = build_plan(up, target=AMPERE)
    assert plan["igemm"].phases and plan["igemm"].split_k == 1


def test_an_igemm_config_can_ask_for_a_split_or_none():
    spec = spec_of(cin=512, cout=512, size=(7, 7))
    base = build_plan(spec, target=AMPERE)["igemm"].config
    none = igemm.IgemmConfig(**{**base.__dict__, "split_k": 1})
    assert build_plan(spec, none, AMPERE)["igemm"].split_k == 1
    two = igemm.IgemmConfig(**{**base.__dict__, "split_k": 2})
    assert build_plan(spec, two, AMPERE)["igemm"].split_k == 2
    with pytest.raises(PlanError, match="does not divide"):
        build_plan(spec, igemm.IgemmConfig(**{**base.__dict__, "split_k": 7}), AMPERE)


def test_the_launch_takes_the_igemm_split_kernel_where_it_pays():
    pytest.importorskip("torch")
    from specgen import splitk, torchop

    sp = pipeline.specialize(spec_of(cin=512, cout=512, size=(7, 7), tile={"engine": "igemm"}), "sm_80")
    lp = torchop._launch_plan(sp)
    ig = sp.plan["igemm"]
    assert lp.igemm_split[0] == ig.split_k and lp.igemm_split[4] == splitk.kernel_names(sp.plan["kernel_name"])
    slots = 132 * sp.plan["min_blocks"]
    for batch in (1, 2, 8, 64, 512):
        tiles = -(-batch * 49 // ig.bm) * ig.n_tiles
        want = splitk.pays(tiles, ig.k_tiles, ig.split_k, slots, batch * 49 * 512)
        assert torchop.igemm_uses_split(lp, batch, 132) == want
    assert torchop.igemm_uses_split(lp, 1, 132) and not torchop.igemm_uses_split(lp, 512, 132)

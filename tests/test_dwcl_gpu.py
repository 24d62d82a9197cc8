"""specgen/dwcl.py on the GPU (marker `gpu`; skipped without CUDA): a depthwise conv and
`layer_norm_channels` given a channels-last input run as one kernel that writes a channels-last
output, against float64 at each precision's bar (gpu_helpers.compare: outputs poisoned first,
fresh inputs and parameters per check, odd batches); ConvNeXt-T imported with its activations
channels-last, as PyTorch leaves them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from specgen import pipeline  # noqa: E402
from specgen.importer import from_module  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402

from gpu_helpers import as_channels_last, compare, compare_formats, rel_l2, tf32_allowed  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp32_reference")]

CASES = {
    "c96_56": (96, [56, 56], {"kernel": 7, "padding": 3}, [{"layer_norm_channels": {"eps": 1e-6}}]),
    "c192_gelu": (192, [28, 21], {"kernel": 7, "padding": 3}, [{"layer_norm_channels": {"eps": 1e-6}}, "gelu"]),
    "c768_7": (768, [7, 7], {"kernel": 7, "padding": 3}, [{"layer_norm_channels": {}}, {"add": 0.5}]),
    "c40_s2_d2": (40, [15, 17], {"kernel": 3, "padding": 2, "stride": 2, "dilation": 2, "bias": False},
                  [{"layer_norm_channels": {"elementwise_affine": False}}, {"mul": {"param": "s"}}]),
    "c1024_3": (1024, [5, 6], {"kernel": 3, "padding": 1}, [{"layer_norm_channels": {}}]),
}


@pytest.mark.parametrize("precision", ["fp32", "tf32"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_a_channels_last_input_runs_the_one_kernel(name, precision):
    channels, size, conv, epilogue = CASES[name]
    layer = FusedLayer(validate({"name": f"dwcl_{name}_{precision}", "input": {"channels": channels, "size": size},
                                 "conv": {"out_channels": channels, "groups": channels, **conv},
                                 "epilogue": epilogue, "precision": precision})).cuda()
    variant = pipeline.channels_last_variant(layer.specialize())
    assert variant is not None and variant.plan.channels_last_io
    compare_formats(layer)  # (contiguous at batch 1 and 3, channels-last at 2)
    compare(layer, 5, seed=4, channels_last=True)
    x = as_channels_last(torch.randn(3, channels, *size, device="cuda"))
    with torch.no_grad():
        y = layer(x)
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()


def _convnext():
    path = Path(__file__).resolve().parent.parent / "examples" / "models.py"
    spec = importlib.util.spec_from_file_location("specgen_example_models_dwcl", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ConvNeXtT


def test_convnext_runs_its_blocks_channels_last_and_matches_float64():
    cls = _convnext()
    with tf32_allowed(False):  # fp32 mode
        model = cls.make(depths=(1, 1, 2, 1)).cuda()
        x = cls.example_input(batch=2, device="cuda")
        fused = from_module(model, x, keep_slower=True)
        layers = [m for m in fused.modules() if isinstance(m, FusedLayer)]
        blocks = [m for m in layers if m.spec.name.endswith("_dwconv")]
        # the stem, each block's depthwise conv + LayerNorm and its two Linear layers (1x1 convs),
        # and the three downsampling convs, which run alone (fused in fp32 mode: 3xTF32 beats FFMA)
        assert len(layers) == 19 and len(blocks) == 5
        assert sum(m.spec.name.endswith(("_pwconv1", "_pwconv2")) for m in layers) == 10
        assert sum(not m.spec.epilogue for m in layers) == 3
        with torch.no_grad():
            got = fused(x)
            want64 = model.double()(x.double())
    variants = [pipeline.channels_last_variant(m.specialize()) for m in blocks]
    assert all(v is not None and v.plan.channels_last_io for v in variants)
    assert rel_l2(got, want64) <= 1e-5

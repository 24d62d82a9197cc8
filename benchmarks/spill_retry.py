"""The spill retry's smaller tiles, timed: each layer of `tests/test_spill_retry.py` (builds that
spilled registers under the planner's tile with nvcc 13.0) built without the smaller-tile retry
(the planner's tile, spilling) and with it (v48: `pipeline._smaller_tiles`), beside eager PyTorch in
the same precision.

    python benchmarks/spill_retry.py [--batch 16 128]

Each way builds under its own name (so each caches apart), is checked against PyTorch's float64
output and timed: median of CUDA events over calls on fresh random inputs, ms. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from specgen import bench, pipeline, reference  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.spec import validate  # noqa: E402
from test_spill_retry import LAYERS  # noqa: E402

REPS = 15
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _describe(layer: FusedLayer) -> str:
    item = layer.specialize()
    p, tile = item.plan, ""
    if p["engine"] == "ffma":
        tile = f"ct {p['ct']}"
    elif p.get("tma") is not None:
        tile = f"bm {p['tma'].config.bm}"
    elif p.get("mma") is not None:
        tile = f"wn {p['mma'].wn}"
    return f"{p['engine']} {tile}, {item.build.spill_bytes} B spilled"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[16, 128])
    args = ap.parse_args(argv)
    smaller = pipeline._smaller_tiles
    print(f"ms per call (median of {REPS}); before = the planner's tile, now = the spill retry's smaller tile", flush=True)
    print(f"{'layer':18}{'batch':>6}{'eager':>9}{'before':>9}  {'plan':28}{'now':>9}  {'plan':28}{'x before':>9}{'x eager':>8}",
          flush=True)
    for name, layer_spec in LAYERS.items():
        precision = layer_spec["precision"]
        torch.backends.cudnn.allow_tf32 = precision == "tf32"
        dtype = DTYPES.get(precision, torch.float32)
        layers, plans = {}, {}
        for way in ("before", "now"):
            pipeline._smaller_tiles = (lambda plan, settings: []) if way == "before" else smaller
            pipeline._memo.clear()
            spec = validate({"name": f"spill_{name}_{way}", **layer_spec})
            layers[way] = FusedLayer(spec).cuda().to(dtype)
            plans[way] = _describe(layers[way])
        pipeline._smaller_tiles = smaller
        layers["before"].load_state_dict(layers["now"].state_dict())
        spec = layers["now"].spec
        cin, size = spec.input.channels, list(spec.input.size)
        with torch.no_grad():
            eager = reference.Reference(spec).cuda()
            eager.load_state_dict({k: v.float() for k, v in layers["now"].state_dict().items()}, strict=False)
            ref64 = reference.Reference(spec).cuda().double()
            ref64.load_state_dict({k: v.double() for k, v in layers["now"].state_dict().items()}, strict=False)
            eager = eager.to(dtype)
            for batch in args.batch:
                xs = [torch.randn(batch, cin, *size, device="cuda").to(dtype) for _ in range(2)]
                want, times = ref64(xs[1].double()), {}
                for way in ("before", "now"):
                    got = layers[way](xs[1]).double()
                    rel = ((got - want).norm() / want.norm()).item()
                    assert rel < 2e-2, f"{name} {way}: rel L2 {rel:.1e}"
                    times[way] = bench._time(lambda: layers[way](xs[0]), REPS)
                times["eager"] = bench._time(lambda: eager(xs[0]), REPS)
                print(f"{name:18}{batch:6d}{times['eager']:9.3f}{times['before']:9.3f}  {plans['before']:28}{times['now']:9.3f}  "
                      f"{plans['now']:28}{times['before'] / times['now']:9.2f}{times['eager'] / times['now']:8.2f}", flush=True)
                xs = None
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

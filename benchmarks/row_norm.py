"""A statistic stage over trailing spatial dims taken in the TMA epilogue (`tma.row_norm`, v51),
against the same layers run as before: the conv's kernel writes T0, a tail kernel reads it for
the statistics and writes the normalized output (`tma.ROW_NORM` off). Rows: KernelBench 34 and 3
(a stride-2 transposed Conv3d, LayerNorm over W), the family's 25 (a stride-2 Conv3d, LayerNorm
over W, whose few multiply-adds per input byte kept its conv on the implicit GEMM before; the 'tma'
column asks for the TMA engine where the planner does not take it),
a 2-D LayerNorm over W, a softmax over W, an instance norm of an 8x8 map, and `layer_norm_channels`
(new in v51: its 'before' is the same plan). Each layer is checked
against the float64 reference first; eager is PyTorch running the spec's reference ops (TF32
convolutions in tf32 mode, PyTorch's default).

    python benchmarks/row_norm.py [--batch 16] [--only TEXT] [--channels-last]

--channels-last hands every contender its input channels-last (eager PyTorch too): a depthwise
conv's `layer_norm_channels` rows then run specgen's channels-last kernel (specgen/dwcl.py, v52).

'before' is v51's plan: `tma.ROW_NORM`, `tail.STRIDED_TEAMS` (v52: a strided group of many values,
or a sample of few groups, a team's; before, a thread per group) and `dwcl.ENABLED` (v52) off, so
the `layer_norm_channels` rows after a depthwise conv time the strided teams (and with
--channels-last the one channels-last kernel).

ms per call, CUDA events, median of 15, two inputs in turn. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specgen import bench, dwcl, pipeline, reference, tail, tma  # noqa: E402
from specgen.module import FusedLayer  # noqa: E402
from specgen.plan import PlanError  # noqa: E402
from specgen.spec import validate  # noqa: E402

REPS = 15
C3 = {"kernel": 3, "padding": 1}
# label: (input channels, size, conv, epilogue)
LAYERS = {
    "kb34 convT3d 32->64 k4s2, LN(W 64), gelu": (32, [16, 32, 32], {"out_channels": 64, "kernel": 4, "stride": 2, "padding": 1,
                                                                  "transposed": True}, [{"layer_norm": 64}, "gelu", {"mul": 1.0}]),
    "kb3 convT3d 32->64 k3s2, +1, LN(W 64), avgpool 2, gelu": (
        32, [16, 32, 32], {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1, "transposed": True},
        [{"add": 1.0}, {"layer_norm": 64}, {"avg_pool": 2}, "gelu"]),
    "fam25 conv3d 16->32 s2, LN(W 32), gelu": (16, [32, 64, 64], {"out_channels": 32, "kernel": 3, "stride": 2, "padding": 1},
                                               [{"layer_norm": 32}, "gelu"]),
    "conv2d 128->128 32x64, LN(W 64), gelu": (128, [32, 64], {"out_channels": 128, **C3}, [{"layer_norm": 64}, "gelu"]),
    "conv2d 32->16 s2 64x64, LN(W 32)": (32, [64, 64], {"out_channels": 16, "kernel": 3, "stride": 2, "padding": 1},
                                         [{"layer_norm": 32}]),
    "conv2d 64->96 32x32, softmax(W)": (64, [32, 32], {"out_channels": 96, **C3}, [{"softmax": -1}]),
    "conv2d 256->256 8x8, instance norm, relu": (256, [8, 8], {"out_channels": 256, **C3},
                                                 [{"instance_norm": {"affine": True}}, "relu"]),
    # a LayerNorm over the channels (v51-4: new, so 'before' is the same plan): on the TMA epilogue,
    # and after a depthwise conv on the tail engine's strided kernel (ConvNeXt's stages 1 and 4)
    "conv2d 64->96 28x28, LN over channels, gelu": (64, [28, 28], {"out_channels": 96, **C3},
                                                    [{"layer_norm_channels": {}}, "gelu"]),
    "dwconv 96 7x7 56x56, LN over channels": (96, [56, 56], {"out_channels": 96, "kernel": 7, "padding": 3, "groups": 96},
                                              [{"layer_norm_channels": {"eps": 1e-6}}]),
    "dwconv 192 7x7 28x28, LN over channels": (192, [28, 28], {"out_channels": 192, "kernel": 7, "padding": 3, "groups": 192},
                                               [{"layer_norm_channels": {"eps": 1e-6}}]),
    "dwconv 384 7x7 14x14, LN over channels": (384, [14, 14], {"out_channels": 384, "kernel": 7, "padding": 3, "groups": 384},
                                               [{"layer_norm_channels": {"eps": 1e-6}}]),
    "dwconv 768 7x7 7x7, LN over channels": (768, [7, 7], {"out_channels": 768, "kernel": 7, "padding": 3, "groups": 768},
                                             [{"layer_norm_channels": {"eps": 1e-6}}]),
}


def _build(name: str, cin, size, conv, epilogue, precision: str, row_norm: bool, engine: str | None):
    tma.ROW_NORM = tail.STRIDED_TEAMS = dwcl.ENABLED = row_norm
    pipeline._memo.clear()
    data = {"name": name, "input": {"channels": cin, "size": size}, "conv": conv, "epilogue": epilogue, "precision": precision}
    if engine:
        data["tile"] = {"engine": engine}
    layer = FusedLayer(validate(data)).cuda().eval()
    plan = layer.specialize().plan
    pipeline.channels_last_variant(layer.specialize())  # (its channels-last kernel chosen now, under these switches)
    tma.ROW_NORM = tail.STRIDED_TEAMS = dwcl.ENABLED = True
    parts = plan.get("parts")
    if parts:
        what = "+".join(p.plan.get("engine", p.role) if hasattr(p.plan, "get") else p.role for p in parts)
    else:
        what = plan["engine"] + (" fused" if plan.get("tma") is not None and plan["tma"].row_norm else "")
    return layer, what


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", nargs="+", type=int, default=[16])
    ap.add_argument("--precision", default="tf32")
    ap.add_argument("--only", default=None, help="rows whose label contains this text")
    ap.add_argument("--channels-last", action="store_true", help="inputs channels-last, for every contender")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    precision = args.precision
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    print(f"ms per call (median of {REPS}), {precision}; before = the tail engine's sequence, now = the planner's plan, "
          f"tma = the TMA engine asked for (where 'now' is not on it)")
    print(f"{'layer':56}{'batch':>6}{'eager':>8}{'before':>8}{'now':>8}{'tma':>8}  {'x before':>8}{'x eager':>8}  plans (before / now / tma); rel L2 now")
    for label, (cin, size, conv, epilogue) in LAYERS.items():
        if args.only and args.only not in label:
            continue
        for batch in args.batch:
            before, p0 = _build("rn_before", cin, size, conv, epilogue, precision, False, None)
            now, p1 = _build("rn_now", cin, size, conv, epilogue, precision, True, None)
            layers = [before, now]
            plans = [p0, p1]
            if "tma" not in p1:
                try:
                    asked, p2 = _build("rn_tma", cin, size, conv, epilogue, precision, True, "tma")
                    layers.append(asked)
                    plans.append(p2)
                except PlanError:  # (the TMA engine cannot run it: a depthwise conv)
                    tma.ROW_NORM = True
            for m in layers[1:]:
                m.load_state_dict(before.state_dict())
            xs = [torch.rand(batch, cin, *size, device="cuda") for _ in range(2)]
            if args.channels_last:
                fmt = torch.channels_last if len(size) == 2 else torch.channels_last_3d
                xs = [x.contiguous(memory_format=fmt) for x in xs]
            w, b, params = before.conv.weight, before.conv.bias, before.spec_params()
            with torch.no_grad():
                ref = reference.forward64(before.spec, xs[0], w, b, params)
                rels = [((m(xs[0]).double() - ref).norm() / ref.norm()).item() for m in layers]
                times = []
                for fn in [lambda x: reference.forward(before.spec, x, w, b, params), *layers]:
                    calls = [0]

                    def step(fn=fn):
                        calls[0] += 1
                        return fn(xs[calls[0] % 2])

                    times.append(bench._time(step, REPS))
            eager, t_before, t_now = times[:3]
            t_tma = times[3] if len(times) > 3 else float("nan")
            best = min(t_now, t_tma) if len(times) > 3 else t_now
            print(f"{label:56}{batch:>6}{eager:8.3f}{t_before:8.3f}{t_now:8.3f}{t_tma:8.3f}  {t_before / t_now:8.2f}"
                  f"{eager / t_now:8.2f}  {' / '.join(plans)}; {' / '.join(f'{r:.1e}' for r in rels)}"
                  + (f" (tma {t_before / best:.2f}x before)" if len(times) > 3 else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The opt-in small-batch rule (SPECGEN_SMALL_BATCH=1, `pipeline.small_batch_config`) against the
planner's TMA kernel, layer by layer, at the batches the rule covers, beside PyTorch.

    python benchmarks/small_batch.py [--batch 1 4 16] [--layer r18_64_56 ...]

Layers: ones the planner puts on the TMA engine (ResNet-18's 3x3 convs, VGG's, a stride-2 conv, a
3x3 512 -> 512 conv at 14^2, ViT-S/16's qkv and fc2 and ConvNeXt's 768 -> 3072 as 1x1 convs), in
tf32 and fp32 mode. Per layer and batch (where the batch's output positions are at most
SMALL_BATCH_MAX_POSITIONS): the time per call of eager PyTorch (conv + activation, cuDNN), of the
layer with the rule off (its TMA kernel) and on (the implicit GEMM's tile), each as

  wall: CUDA events around loops of back-to-back no_grad calls (`bench._time_stream`: the host's
        launch path counts where it is longer than the kernels: what an eager caller waits for);
  gpu:  the calls captured in a CUDA graph, the replays timed (`measured.time_graphed`: the
        kernels alone, what a graph pays);

the median of 7 reps each, and the rule's ratios on/off. A rule worth turning on wins on both at the
batches it covers. Needs a GPU.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from specgen import measured, pipeline, torchop
from specgen.bench import _time_stream
from specgen.module import FusedLayer
from specgen.spec import LayerSpec


def _conv(name, cin, cout, size, kernel=3, stride=1, act="relu", precision="tf32"):
    return {"name": name, "input": {"channels": cin, "size": list(size)},
            "conv": {"out_channels": cout, "kernel": kernel, "stride": stride, "padding": kernel // 2},
            "epilogue": [act] if act else [], "precision": precision}


LAYERS = [
    _conv("r18_64_56", 64, 64, (56, 56)),
    _conv("r18_128_28", 128, 128, (28, 28)),
    _conv("r18_256_14", 256, 256, (14, 14)),
    _conv("r18_512_7", 512, 512, (7, 7)),
    _conv("r18_s2_128_256", 128, 256, (28, 28), stride=2),
    _conv("vgg_256_28", 256, 256, (28, 28)),
    _conv("c512_14", 512, 512, (14, 14)),
    _conv("qkv", 384, 1152, (196, 1), kernel=1, act=None),
    _conv("fc2", 1536, 384, (196, 1), kernel=1, act=None),
    _conv("cnx_pw_7", 768, 3072, (7, 7), kernel=1, act="gelu"),
    _conv("r18_64_56_fp32", 64, 64, (56, 56), precision="fp32"),
    _conv("r18_256_14_fp32", 256, 256, (14, 14), precision="fp32"),
    _conv("c512_14_fp32", 512, 512, (14, 14), precision="fp32"),
]


def clocks(fn, x, reps=7) -> tuple[float, float]:
    """(wall, gpu) milliseconds per call of `fn(x)`."""
    return _time_stream(lambda: fn(x), reps), measured.time_graphed([fn], [x], reps)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--layer", nargs="+", help="layer names (default: all)")
    args = parser.parse_args()
    specs = [LayerSpec.model_validate(d) for d in LAYERS if not args.layer or d["name"] in args.layer]
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; times in us per call")
    os.environ["SPECGEN_SMALL_BATCH"] = "1"
    layers = [FusedLayer(s).cuda().eval() for s in specs]
    items = [layer.specialize() for layer in layers]
    for batch in args.batch:
        pipeline.build_batch_variants(items, batch)  # (the rule's kernels, in one parallel build)
    print(f"{'layer':16} {'b':>3} | {'torch wall':>10} {'gpu':>7} | {'off wall':>8} {'gpu':>7} | "
          f"{'on wall':>8} {'gpu':>7} | on/off wall  gpu  (engine on)")
    for spec, layer, sp in zip(specs, layers, items):
        torch.backends.cudnn.allow_tf32 = spec.precision == "tf32"
        conv = nn.Conv2d(spec.input.channels, spec.conv.out_channels, spec.conv.kernel, stride=spec.conv.stride,
                         padding=spec.conv.padding).cuda()
        act = {"relu": F.relu, "gelu": F.gelu}.get(spec.epilogue[0].op if spec.epilogue else None, lambda t: t)
        for batch in args.batch:
            if batch * pipeline._out_positions(spec) > pipeline.SMALL_BATCH_MAX_POSITIONS:
                continue
            x = torch.randn(batch, spec.input.channels, *spec.input.size, device="cuda")
            with torch.no_grad():
                ref = clocks(lambda t: act(conv(t)), x)
                times, engine = {}, ""
                for on in ("0", "1"):
                    os.environ["SPECGEN_SMALL_BATCH"] = on
                    engine = torchop.kernel_for(sp, x).plan["engine"]
                    times[on] = clocks(layer, x)
            off, on = times["0"], times["1"]
            us = [1e3 * t for t in (*ref, *off, *on)]
            print(f"{spec.name:16} {batch:3} | {us[0]:10.1f} {us[1]:7.1f} | {us[2]:8.1f} {us[3]:7.1f} | "
                  f"{us[4]:8.1f} {us[5]:7.1f} | {on[0] / off[0]:10.2f} {on[1] / off[1]:5.2f}  ({engine})", flush=True)


if __name__ == "__main__":
    main()

"""One strided transposed conv layer on a chosen engine, for a profiler to read (and its time).

    python benchmarks/transposed_layer.py kb2 tma            # ms per forward, CUDA events
    ncu --metrics dram__bytes_read.sum,dram__bytes_write.sum -k regex:"_(tma|igemm)$" \\
        --launch-skip 3 --launch-count 1 python benchmarks/transposed_layer.py kb2 igemm

The layers are KernelBench level-2 transposed convs at their own sizes, in tf32, with the engine
pinned by the spec's tile (`tma`: the TMA engine's stride phases; `igemm`: the implicit GEMM's).
"""

from __future__ import annotations

import argparse

LAYERS = {
    # name: (input, conv, epilogue, batch)
    "kb2": ({"channels": 64, "size": [128, 128]},
            {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1}, ["relu"], 128),
    "kb26": ({"channels": 32, "size": [16, 16, 16]},
             {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1},
             [{"add": {"input": "skip"}}, "hardswish"], 128),
    "kb26n": ({"channels": 32, "size": [16, 16, 16]},  # KernelBench 26 without its extra input
              {"out_channels": 64, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1}, ["hardswish"], 128),
    "kb93": ({"channels": 64, "size": [64, 64]}, {"out_channels": 128, "kernel": 4, "stride": 2}, ["relu"], 128),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("layer", choices=sorted(LAYERS))
    ap.add_argument("engine", choices=["tma", "igemm"])
    args = ap.parse_args(argv)

    import torch

    from specgen.module import FusedLayer
    from specgen.spec import validate

    inp, conv, epilogue, batch = LAYERS[args.layer]
    spec = validate({"name": f"p_{args.layer}_{args.engine}", "input": inp, "conv": {**conv, "transposed": True},
                     "epilogue": epilogue, "precision": "tf32", "tile": {"engine": args.engine}})
    layer = FusedLayer(spec).cuda()
    x = torch.randn(batch, inp["channels"], *inp["size"], device="cuda")
    extra = [torch.randn(batch, *spec.shapes()[-1].sizes, device="cuda") for _ in spec.inputs()]
    with torch.no_grad():
        for _ in range(3):
            layer(x, *extra)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            layer(x, *extra)
        end.record()
        torch.cuda.synchronize()
    print(f"{args.layer} {args.engine}: {start.elapsed_time(end) / 10:.3f} ms per forward")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

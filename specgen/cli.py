"""The `specgen` command line: build, show, check, bench, tune, plot, doctor, cache, import.

Exit codes: 0 ok; 1 a build or check failed (the compiler's log is shown); 2 bad input.
`build` and `show` never import torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specgen import __version__

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
# Hex digits of a cache key that `build` prints (`specgen cache ls` shows as many).
KEY_DIGITS = 16
# What `show --plan` calls each axis's role (the plan's names: specgen/plan.py).
ROLE_LEGEND = (
    "roles: F = kept (no reduction touches it; blocks tile it), R1 = reduced by the first reduction "
    "(walked chunk by chunk inside a block), R2, R3 = reduced by a later reduction (walked one "
    "coordinate at a time)"
)


class BadInput(ValueError):
    """A command-line argument that cannot work (exit 2)."""


def _load(path: str, name: str | None = None):
    from specgen.spec import load_specs

    specs = load_specs(path)
    if name is not None:
        specs = [s for s in specs if s.name == name]
        if not specs:
            from specgen.spec import SpecError

            from specgen.literals import quote

            raise SpecError([f"--name: no spec named {quote(name)} in {path}"])
    return specs


def _load_all(paths: list[str]):
    out = []
    for p in paths:
        out.extend(_load(p))
    return out


def cmd_build(args) -> int:
    from specgen import compile as nvcc, pipeline, target

    if args.arch is not None:
        nvcc.validate_arch(args.arch)
    target.resolve(args.arch)  # an arch specgen cannot build for: one line, exit 2, before any compile
    from specgen import progress

    specs = _load_all(args.files)
    out_dir = Path(args.out)
    try:  # before compiling: a bad --out should not cost a build
        out_dir.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise BadInput(f"--out {args.out}: exists and is not a directory; give a directory") from None
    except OSError as err:
        raise BadInput(f"--out {args.out}: cannot create the directory: {err.strerror or err}") from None
    with progress.track("building", total=len(specs)):
        built = pipeline.specialize_many(specs, args.arch)
    for item in built:
        cu = out_dir / f"{item.spec.name}.cu"
        cu.write_text(item.source)
        record = item.build.as_json()
        record.update({"cu": str(cu), "smem_bytes": item.plan["smem_bytes"] + item.build.smem_bytes})
        if args.json:
            print(json.dumps(record, sort_keys=True))
        else:
            print(
                f"{item.spec.name}: {record['cache']} {record['key'][:KEY_DIGITS]}  {record['registers']} registers, "
                f"{record['spill_bytes']} spill bytes, {record['smem_bytes']} B shared  "
                f"({record['compile_seconds']:.2f} s)  -> {cu}, {record['cubin']}"
            )
    return EXIT_OK


def cmd_show(args) -> int:
    from specgen import pipeline
    from specgen.plan import describe

    for spec in _load(args.file, args.name):
        tuned = None
        if args.plan:
            from specgen import tune

            tuned = tune.stored_choice(spec, args.arch)  # None without a GPU (no torch needed)
        plan, source, req = pipeline.request(spec, args.arch, igemm_config=tuned and tuned["config"])
        if args.channels_last:
            found = pipeline.channels_last_request(spec, args.arch)
            if found is None:
                print(f"# {spec.name}: no channels-last kernel: a channels-last input is laid out as NC(D)HW first "
                      f"and takes the kernel below", file=sys.stderr)
            else:
                plan, source, req = found
        if args.ptx:
            from specgen import compile as nvcc

            print(nvcc.compile_ptx(source, req.arch or nvcc.default_arch()))
        elif args.plan:
            print(describe(plan))
            if tuned is not None:
                print(f"tuned: {tuned['label']} for {tuned['gpu']}, batch bucket {tuned['bucket']} (specgen tune)")
            if not args.channels_last and (few := pipeline.small_batch_largest(spec, plan, args.arch)):
                print(f"small batches: a call of up to {few} sample(s) on an NC(D)HW input runs the implicit GEMM's "
                      f"128 x 64 tile instead, unless a tuned choice for its batch bucket says otherwise "
                      f"(the opt-in rule SPECGEN_SMALL_BATCH=1)")
            if not args.channels_last and (few := pipeline.small_batch_spread_largest(spec, plan, args.arch)):
                print(f"small batches: a call of up to {few} sample(s) on an NC(D)HW input runs this box with one "
                      f"register tile a thread instead of four (about four times the blocks), unless a tuned choice "
                      f"for its batch bucket says otherwise")
            if "role" in describe(plan) or "axes:" in describe(plan):  # the slab and FFMA engines' axis roles
                print(ROLE_LEGEND)
        else:
            sys.stdout.write(source)
    return EXIT_OK


def _need_gpu(command: str) -> None:
    """`check` and `bench` run kernels: say so plainly where torch or a CUDA GPU is missing."""
    try:
        import torch
    except ImportError:
        raise BadInput(f"{command} needs PyTorch with CUDA and a GPU: torch is not installed") from None
    if not torch.cuda.is_available():
        build = "a CPU-only build of torch" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise BadInput(f"{command} needs a CUDA GPU: {build} (torch {torch.__version__})")


def cmd_check(args) -> int:
    specs = _load_all(args.files)
    _need_gpu("check")
    from specgen import check

    return check.main(specs, batch=args.batch, seed=args.seed)


def cmd_bench(args) -> int:
    if args.plot:
        from specgen import plot

        plot.require_matplotlib()  # before the measurements, not after
    from specgen import bench

    if args.model:
        return bench.model_main(args)  # checks its input, then the GPU
    if not args.files:
        raise ValueError("bench: give FILE.yaml... or --model FILE.py:NAME --input-shape B,C,...")
    specs = _load_all(args.files)
    if args.name:
        specs = [s for s in specs if s.name in args.name]
    if args.precision:
        specs = [s.model_copy(update={"precision": args.precision}) for s in specs]
    _need_gpu("bench")
    ceil = bench.ceilings()
    results = []
    for spec in specs:
        for batch in args.batch or [128]:
            result = bench.bench(spec, batch, reps=args.reps, compile=not args.no_compile, ceil=ceil)
            results.append(result)
            print(bench.format_table(result), flush=True)
    host_us = bench.host_overhead()
    print(
        f"host time per call (tiny spec, 1000 calls, no CUDA graph): inference forward {host_us['forward_us']:.1f} us;"
        f" into out= {host_us['launch_us']:.1f} us; with autograd (custom op) {host_us['autograd_op_us']:.1f} us"
    )
    meta = {**bench.environment(), "host_overhead_us": host_us}
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    if args.plot:
        print(f"plot: {plot.plot_record({'meta': meta, 'results': results}, args.plot)}")
    return EXIT_OK


def cmd_tune(args) -> int:
    from specgen import tune

    return tune.main(_load_all(args.files), batch=args.batch, reps=args.reps)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specgen", description="Specialize fused convolution layers into CUDA kernels.")
    p.add_argument("--version", action="version", version=f"specgen {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    b = sub.add_parser("build", help="render and compile every spec of YAML files (cached)")
    b.add_argument("files", nargs="+", metavar="FILE.yaml")
    b.add_argument("--arch", default=None, help="target: sm_80, sm_86, sm_89, sm_90, sm_90a or sm_100 (default: this GPU's, else sm_90)")
    b.add_argument("--out", default="generated", help="where <name>.cu is written (default: generated/)")
    b.add_argument("--json", action="store_true", help="one JSON object per spec")
    b.set_defaults(run=cmd_build)

    s = sub.add_parser("show", help="print the generated .cu (or its PTX, or the plan)")
    s.add_argument("file", metavar="FILE.yaml")
    s.add_argument("--name", default=None, help="the spec to show, when the file holds several")
    s.add_argument("--arch", default=None)
    g = s.add_mutually_exclusive_group()
    g.add_argument("--ptx", action="store_true", help="print the PTX instead of the .cu")
    g.add_argument("--plan", action="store_true", help="print the plan's summary: tiling, rewrites")
    s.add_argument("--channels-last", action="store_true",
                   help="the kernel a channels-last input runs (the layer's channels-last kernel, where it has one)")
    s.set_defaults(run=cmd_show)

    c = sub.add_parser("check", help="compare specgen with the PyTorch reference on the GPU")
    c.add_argument("files", nargs="+", metavar="FILE.yaml")
    c.add_argument("--batch", type=int, default=2)
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(run=cmd_check)

    be = sub.add_parser("bench", help="time specgen against eager PyTorch and torch.compile (GPU)")
    be.add_argument("files", nargs="*", metavar="FILE.yaml")
    be.add_argument("--batch", type=int, nargs="+", default=None, help="batch sizes (default 128; --model: the input's)")
    be.add_argument("--model", metavar="FILE.py:NAME", default=None, help="time a whole model (eager, compile, from_module)")
    be.add_argument("--input-shape", default=None, help="with --model: the example input, batch first, e.g. 8,3,224,224")
    be.add_argument("--reps", type=int, default=20)
    be.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    be.add_argument("--name", action="append", default=None, help="only this spec (repeatable)")
    be.add_argument("--precision", choices=["fp32", "tf32", "bf16", "fp16"], default=None, help="run every spec in this precision")
    be.add_argument("--json", metavar="PATH", default=None, help="write all numbers as JSON")
    be.add_argument("--plot", metavar="FILE.png", default=None, help="draw a roofline and the speedups (needs matplotlib)")
    be.set_defaults(run=cmd_bench)

    t = sub.add_parser("tune", help="time the tensor-core engines' tile candidates on this GPU and keep the fastest correct one (GPU)")
    t.add_argument("files", nargs="+", metavar="FILE.yaml")
    t.add_argument("--batch", type=int, default=64, help="the batch to time at; the choice holds for its power-of-two bucket")
    t.add_argument("--reps", type=int, default=15, help="timed reps per candidate (the median is kept)")
    t.set_defaults(run=cmd_tune)

    from specgen import doctor, plot

    pl = sub.add_parser("plot", help="draw a roofline and the speedups of a bench --json record (needs matplotlib)")
    plot.add_arguments(pl)
    pl.set_defaults(run=plot.run)

    d = sub.add_parser("doctor", help="what works here: GPU, driver, torch, compilers, cache; builds (and runs) a tiny spec")
    d.set_defaults(run=doctor.run)

    from specgen import cachecli

    cachecli.register(sub)
    try:
        from specgen import importcli
    except ImportError:  # the importer needs torch; the rest of the CLI does not
        importcli = None
    if importcli is not None:
        importcli.register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit: a closed pipe is then caught below
        return code
    except BrokenPipeError:
        # The reader went away (`specgen show ... | head`): not an error of ours. Send what is still
        # buffered nowhere, so that the interpreter's exit does not complain about the pipe.
        import os

        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_OK


def _main(argv: list[str] | None) -> int:
    from specgen.spec import SpecError

    args = parser().parse_args(argv)
    try:
        return args.run(args)
    except BrokenPipeError:
        raise
    except SpecError as err:
        print(f"specgen: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except (ValueError, FileNotFoundError) as err:
        print(f"specgen: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except Exception as err:  # a failed build: CompileError carries the log and source lines
        from specgen.compile import CompileError
        from specgen.render import TemplateError

        if isinstance(err, TemplateError):
            print(f"specgen: template error: {err}", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(err, CompileError):
            print(f"specgen: build failed\n{err}", file=sys.stderr)
            return EXIT_FAILED
        if isinstance(err, OSError):  # e.g. a .cu that cannot be written: the OS's reason and the path
            print(f"specgen: error: {err}", file=sys.stderr)
            return EXIT_FAILED
        raise


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

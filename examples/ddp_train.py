"""Train one of the example models with specgen layers on several processes, and time it.

    torchrun --nproc_per_node=2 examples/ddp_train.py                      # nccl on GPUs, else gloo on CPU
    torchrun --nproc_per_node=8 examples/ddp_train.py --model VGG11 --batch 64 --fsdp
    torchrun --nproc_per_node=2 examples/ddp_train.py --plain              # the same without specgen

Every rank builds the model from the same seed (`examples/models.py`, eval mode so that batch
norms fuse with their running statistics), passes it through `specgen.from_module` and wraps it in
DistributedDataParallel (or shards it with FSDP's `fully_shard` under `--fsdp`). With nccl each
rank uses the GPU `cuda:<LOCAL_RANK>`; with gloo the CPU, where the layers run their PyTorch
reference. Rank 0 runs `from_module` first, so that its kernels and its never-slower decisions
land in the cache the other ranks then read (one compile per kernel on a host), and the ranks
check that they fused the same chains. Then `--steps` SGD steps on random data (`--batch` samples
per rank), and as many inference forwards, are timed after `--warmup` untimed ones; rank 0 prints
samples per second, per rank and in all, and writes them to `--json PATH`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _models():
    path = Path(__file__).resolve().parent / "models.py"
    spec = importlib.util.spec_from_file_location("specgen_example_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    models = _models()
    names = [cls.__name__ for cls in models.MODELS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=names, default="VGG11")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl with CUDA, else gloo")
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP (fully_shard) instead of DDP")
    parser.add_argument("--plain", action="store_true", help="no specgen: the model as written")
    parser.add_argument("--batch", type=int, default=8, help="samples per rank and step")
    parser.add_argument("--full-size", action="store_true", help="the model's full input size (default: its small one)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--json", type=Path, help="rank 0 writes the timings here")
    args = parser.parse_args(argv)
    for field in ("batch", "steps"):
        if getattr(args, field) < 1:
            parser.error(f"--{field} must be at least 1, got {getattr(args, field)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")

    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        if not torch.cuda.is_available():
            parser.error("--backend nccl needs CUDA GPUs; use --backend gloo on CPUs")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        record = _run(args, models, device, rank, world, backend)
    finally:
        dist.destroy_process_group()
    if rank == 0:
        print(
            f"{args.model} x{world} {backend} {'fsdp' if args.fsdp else 'ddp'} {'plain' if args.plain else 'specgen'}: "
            f"train {record['train_samples_per_s']:.1f} samples/s ({record['train_samples_per_s'] / world:.1f} per rank), "
            f"inference {record['infer_samples_per_s']:.1f} samples/s ({record['infer_samples_per_s'] / world:.1f} per rank); "
            f"{record['fused_layers']} fused layers"
        )
        if args.json:
            args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


def _run(args, models, device, rank: int, world: int, backend: str) -> dict:
    import specgen

    cls = getattr(models, args.model)
    shape = cls.INPUT_SHAPE if args.full_size else cls.SMALL_SHAPE
    model = cls.make(seed=0).to(device)  # the same parameters on every rank
    example = torch.randn(args.batch, *shape, device=device)
    fused_names: list[str] = []
    if not args.plain:
        # Rank 0 first: it compiles and measures; the others then find both in the cache.
        for turn in (0, 1):
            if (rank == 0) == (turn == 0):
                model = specgen.from_module(model, example)
            dist.barrier()
        fused_names = sorted(n for n, m in model.named_modules() if isinstance(m, specgen.FusedLayer))
        everyone = [None] * world
        dist.all_gather_object(everyone, fused_names)
        if any(names != fused_names for names in everyone):
            raise RuntimeError(f"ranks fused different chains (rank 0: {everyone[0]}, rank {rank}: {fused_names})")
    if args.fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model)
        wrapped = model
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

    optimizer = torch.optim.SGD(wrapped.parameters(), lr=args.lr)
    gen = torch.Generator(device=device).manual_seed(1 + rank)  # each rank its own data
    x = torch.randn(args.batch, *shape, device=device, generator=gen)
    with torch.no_grad():
        classes = wrapped(x).shape[-1]
    target = torch.randint(0, classes, (args.batch,), device=device, generator=gen)

    def train_step():
        y = wrapped(x)
        loss = F.cross_entropy(y.reshape(args.batch, -1), target) if y.dim() == 2 else y.float().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    def infer_step():
        with torch.no_grad():
            wrapped(x)

    timings = {}
    for label, step in (("train", train_step), ("infer", infer_step)):
        for _ in range(args.warmup):
            step()
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        _sync(device)
        dist.barrier()
        seconds = time.perf_counter() - start
        timings[f"{label}_samples_per_s"] = args.steps * args.batch * world / seconds
        timings[f"{label}_seconds"] = seconds
    return {
        "model": args.model,
        "input_shape": list(shape),
        "world": world,
        "backend": backend,
        "wrapper": "fsdp" if args.fsdp else "ddp",
        "specgen": not args.plain,
        "fused_layers": len(fused_names),
        "batch_per_rank": args.batch,
        "steps": args.steps,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        **timings,
    }


if __name__ == "__main__":
    sys.exit(main())

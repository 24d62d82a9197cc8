"""A torchrun worker for tests/test_distributed.py: specialized layers under torch.distributed.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/dist_worker.py train OUT_DIR
    python -m torch.distributed.run --standalone --nproc_per_node=3 tests/dist_worker.py compile OUT_DIR

`train`: the model of `build_model` (a `FusedLayer` head, a `from_module` body, a linear classifier)
trains for `STEPS` SGD steps on this rank's share of a seeded global batch, once under
DistributedDataParallel and once sharded by FSDP (`fully_shard`). Each rank saves, per wrapper,
its outputs of every step, the full (averaged) gradients of the first step and the full parameters
after the last, all by the parameter names of the plain model, to `OUT_DIR/<wrapper>_rank<r>.pt`.
The test compares them with one process training the plain PyTorch model on the whole batch.

`compile`: every rank waits at a barrier, then specializes the same spec (nvcc, no GPU needed)
into the cache all ranks share (`SPECGEN_CACHE_DIR`), and writes its key and whether it was a
hit or a miss to `OUT_DIR/compile_rank<r>.json`.

The backend is gloo, or nccl with `--backend nccl` (one GPU per rank: `cuda:<LOCAL_RANK>`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

HEAD_SPEC = {
    "name": "dist_head",
    "input": {"channels": 3, "size": [8, 8]},
    "conv": {"out_channels": 8, "kernel": 3, "padding": 1},
    "epilogue": [{"leaky_relu": {"negative_slope": 0.1}}, {"add": {"param": "shift"}}],
}
COMPILE_SPEC = {
    "name": "dist_compile",
    "input": {"channels": 4, "size": [8, 8]},
    "conv": {"out_channels": 8, "kernel": 3},
    "epilogue": [{"relu": {}}],
}
PER_RANK = 3  # samples per rank and step
STEPS = 2
LR = 0.05
CLASSES = 5


class Net(nn.Module):
    def __init__(self, head: nn.Module, body: nn.Module, fc: nn.Module):
        super().__init__()
        self.head = head
        self.body = body
        self.fc = fc

    def forward(self, x):
        return self.fc(torch.flatten(self.body(self.head(x)), 1))


def _plain_body() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3, padding=1), nn.Hardswish(), nn.MaxPool2d(2)
    )


def build_model(fused: bool, seed: int = 0) -> tuple[nn.Module, dict[str, str]]:
    """The test model, and the name in the plain model of each of its parameters.

    `fused`: the head is a `FusedLayer` and the body goes through `specgen.from_module` (two
    chains); otherwise all plain PyTorch (the head is the spec's reference module). Both draw the
    same parameters from `seed`.
    """
    from specgen import reference

    torch.manual_seed(seed)
    head = reference.Reference(HEAD_SPEC)
    with torch.no_grad():
        head.shift.normal_(0.0, 0.3)  # a non-trivial per-channel parameter
    body = _plain_body()
    plain = Net(head, body, nn.Linear(4 * 4 * 4, CLASSES))
    canonical = {id(p): name for name, p in plain.named_parameters()}
    if not fused:
        return plain, {name: name for name in canonical.values()}
    import specgen

    fused_head = specgen.FusedLayer(HEAD_SPEC)
    fused_head.load_state_dict(head.state_dict())
    head_names = {id(p): f"head.{n}" for n, p in fused_head.named_parameters()}
    fused_body = specgen.from_module(body, torch.zeros(2, 8, 8, 8))  # shares body's parameters
    model = Net(fused_head, fused_body, plain.fc)
    names = {}
    for name, p in model.named_parameters():
        names[name] = canonical.get(id(p)) or head_names[id(p)]
    return model, names


def global_batch(world: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch of one step, for `world` ranks of PER_RANK samples (rank r: rows r*PER_RANK...)."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(world * PER_RANK, 3, 8, 8, generator=g)
    target = torch.randint(0, CLASSES, (world * PER_RANK,), generator=g)
    return x, target


def _full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a parameter or gradient (FSDP's are sharded DTensors: gathered)."""
    full = getattr(t, "full_tensor", None)
    return (full() if full is not None else t).detach().cpu().clone()


def train(model: nn.Module, names: dict[str, str], world: int, rank: int | None, device="cpu") -> dict:
    """STEPS SGD steps on this rank's rows of every global batch (`rank` None: the whole batch)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    outputs, grads = [], {}
    for step in range(STEPS):
        x, target = global_batch(world, step)
        rows = slice(None) if rank is None else slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        y = model(x[rows].to(device))
        loss = F.cross_entropy(y, target[rows].to(device))
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            grads = {names[n]: _full(p.grad) for n, p in model.named_parameters()}
        optimizer.step()
        outputs.append(y.detach().cpu())
    params = {names[n]: _full(p) for n, p in model.named_parameters()}
    return {"outputs": outputs, "grads": grads, "params": params}


def _train_main(out: Path, device) -> None:
    import specgen
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    for wrapper in ("ddp", "fsdp"):
        model, names = build_model(fused=True)
        fused_layers = sum(isinstance(m, specgen.FusedLayer) for m in model.modules())
        model = model.to(device)
        if wrapper == "ddp":
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
            names = {f"module.{n}": c for n, c in names.items()}
        else:
            from torch.distributed.fsdp import fully_shard

            fully_shard(model.head)  # the FusedLayer is its own FSDP unit: its parameters are sharded
            fully_shard(model)
        result = train(model, names, world, rank, device)
        result.update(rank=rank, world=world, fused_layers=fused_layers)
        torch.save(result, out / f"{wrapper}_rank{rank}.pt")
        dist.barrier()


def _compile_main(out: Path) -> None:
    import specgen

    rank = dist.get_rank()
    layer = specgen.FusedLayer(COMPILE_SPEC)
    dist.barrier()  # every rank asks for the kernel at the same moment
    sp = layer.specialize()
    record = {"rank": rank, "pid": os.getpid(), "key": sp.key, "cache": sp.build.cache}
    (out / f"compile_rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("train", "compile"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        if args.what == "train":
            _train_main(args.out, device)
        else:
            _compile_main(args.out)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

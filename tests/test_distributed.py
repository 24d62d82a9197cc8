"""Specialized layers under torch.distributed, run by torchrun (tests/dist_worker.py is the worker).

CPU (gloo, two ranks): a model with a `FusedLayer` and a `from_module` body trains two SGD steps
under DistributedDataParallel and under FSDP (`fully_shard`); every rank's outputs are those of
the plain PyTorch model on its rows, and its gradients and updated parameters are those of one
process training the plain model on the whole batch. Without a GPU the layers run their PyTorch
reference path, so this checks the module side: parameters registered, synchronised, sharded.

The older `FullyShardedDataParallel` wrapper is not exercised: it refuses to run without an
accelerator ("FSDP needs a non-CPU accelerator device"); `fully_shard` is its replacement.

Compiles: three ranks specializing the same spec at the same moment into one shared cache run
nvcc once (the cache's per-key lock); counted as tests/test_cache_procs.py counts them.

GPU (marked `gpu`, need two or more GPUs): the same training under nccl, one GPU per rank, and a
layer moved between two GPUs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_worker
from conftest_cache_helpers import REPO, isolated_cache

WORKER = Path(dist_worker.__file__).resolve()
TIMEOUT = 240


def torchrun(nproc: int, script: Path, *args: str, env: dict | None = None, timeout: float = TIMEOUT):
    """Run `script` under torchrun with `nproc` local ranks; fails the test with the ranks' output."""
    env = dict(os.environ if env is None else env)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _reference() -> dict:
    """One process, the plain PyTorch model, the whole batch of every step."""
    model, names = dist_worker.build_model(fused=False)
    return dist_worker.train(model, names, world=2, rank=None)


def _check_rank(result: dict, ref: dict, rank: int, rtol: float | None = None, atol: float | None = None) -> None:
    tol = {} if rtol is None else {"rtol": rtol, "atol": atol}
    per = dist_worker.PER_RANK
    assert result["rank"] == rank and result["world"] == 2
    assert result["fused_layers"] == 3, "the head and two from_module chains should be FusedLayers"
    for step, (got, want) in enumerate(zip(result["outputs"], ref["outputs"], strict=True)):
        torch.testing.assert_close(got, want[rank * per : (rank + 1) * per], msg=lambda m: f"rank {rank} step {step}: {m}", **tol)
    assert sorted(result["grads"]) == sorted(ref["grads"])
    for name, want in ref["grads"].items():
        torch.testing.assert_close(result["grads"][name], want, msg=lambda m: f"rank {rank} grad {name}: {m}", **tol)
    for name, want in ref["params"].items():
        torch.testing.assert_close(result["params"][name], want, msg=lambda m: f"rank {rank} param {name}: {m}", **tol)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist_train")
    torchrun(2, WORKER, "train", str(out))
    return {(w, r): torch.load(out / f"{w}_rank{r}.pt") for w in ("ddp", "fsdp") for r in (0, 1)}


@pytest.fixture(scope="module")
def reference():
    return _reference()


def test_reference_is_sensitive_to_the_data_split(reference):
    """The check has teeth: one rank's own gradients (no averaging) differ from the whole batch's."""
    model, names = dist_worker.build_model(fused=False)
    local = dist_worker.train(model, names, world=2, rank=0)
    assert all(g.abs().max() > 0 for g in reference["grads"].values()), "every parameter gets a gradient"
    differ = [n for n, g in reference["grads"].items() if not torch.allclose(local["grads"][n], g, rtol=1e-4, atol=1e-6)]
    assert len(differ) == len(reference["grads"]), f"only {differ} differ"


@pytest.mark.parametrize("wrapper", ["ddp", "fsdp"])
@pytest.mark.parametrize("rank", [0, 1])
def test_gloo_training_equals_single_process(trained, reference, wrapper, rank):
    _check_rank(trained[wrapper, rank], reference, rank)


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    yield from isolated_cache(tmp_path, monkeypatch)


def test_ranks_sharing_a_cache_compile_each_kernel_once(cache_env):
    nproc = 3
    out = cache_env.tmp / "compile"
    torchrun(nproc, WORKER, "compile", str(out), env=cache_env.env())
    records = [json.loads((out / f"compile_rank{r}.json").read_text()) for r in range(nproc)]
    compiles = cache_env.compiles()
    keys = {r["key"] for r in records}
    assert len(keys) == 1, f"ranks specialized different kernels: {records}"
    compiled_keys = [c["key"] for c in compiles]
    assert compiles and len(compiled_keys) == len(set(compiled_keys)), f"a kernel compiled twice: {compiles}"
    assert keys <= set(compiled_keys), (keys, compiles)
    assert {c["pid"] for c in compiles} <= {r["pid"] for r in records}, "compiled by a process that is not a rank"
    assert sum(r["cache"] == "miss" for r in records) == 1, f"expected one miss among {nproc} ranks: {records}"


def test_ddp_train_example_runs_on_cpu(tmp_path):
    script = REPO / "examples" / "ddp_train.py"
    record = tmp_path / "record.json"
    args = ("--model", "Conv3dStack", "--fsdp", "--backend", "gloo", "--steps", "2", "--warmup", "1", "--batch", "2")
    proc = torchrun(2, script, *args, "--json", str(record))
    data = json.loads(record.read_text())
    assert data["world"] == 2 and data["backend"] == "gloo" and data["wrapper"] == "fsdp", data
    assert data["fused_layers"] == 5, data  # Conv3dStack's five conv + batch norm + relu chains
    assert data["train_samples_per_s"] > 0 and data["infer_samples_per_s"] > 0, data
    assert "samples/s" in proc.stdout


# -- GPU: nccl, one GPU per rank ------------------------------------------------------------------

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
)


@pytest.mark.gpu
@two_gpus
def test_nccl_training_equals_single_process(tmp_path):
    out = tmp_path / "nccl"
    torchrun(2, WORKER, "train", str(out), "--backend", "nccl")
    ref = _reference()
    for wrapper in ("ddp", "fsdp"):
        for rank in (0, 1):
            # The kernels are fp32-accurate (3xTF32): the fp32 bar, widened for two SGD steps.
            _check_rank(torch.load(out / f"{wrapper}_rank{rank}.pt"), ref, rank, rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@two_gpus
def test_layer_moved_between_gpus_runs_on_its_device_and_stream():
    import specgen
    from specgen import reference

    layer = specgen.FusedLayer(dist_worker.HEAD_SPEC)
    plain = reference.Reference(dist_worker.HEAD_SPEC)
    with torch.no_grad():
        plain.shift.normal_()
    layer.load_state_dict(plain.state_dict())
    x = torch.randn(4, 3, 8, 8)
    want = plain(x)
    for index in (0, 1, 0):
        device = torch.device("cuda", index)
        layer.to(device)
        stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream), torch.no_grad():
            got = layer(x.to(device))
        stream.synchronize()
        assert got.device == device
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)

"""Measured choices: whether a specialized kernel beats the PyTorch code it would replace.

`from_module` times each fusable chain twice on the GPU at specialization, as the original
PyTorch code and as the fused layer, and keeps the original where the kernel is not faster.
The timing (`compare`): CUDA events around a loop of calls, warm-up first, the two contenders
interleaved rep by rep, the median of the reps, fresh non-zero (normal random) inputs.

Each decision is kept in the specgen cache directory, one small JSON file per decision under
`measured/`, named by a sha256 over what the times depend on: the kernel's cache key, the GPU
(name and SM count), the batch bucket (the next power of two at or above the batch), the torch
version and whether cuDNN may use TF32. A file is written to a temporary name and renamed into
place (atomic), so concurrent processes never read half a record; an unreadable record counts
as no record and is measured again.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import uuid
from pathlib import Path

from specgen.log import get_logger

SCHEMA = 1
SUBDIR = "measured"
REPS = 9
WARMUP = 3
TARGET_REP_MS = 0.5  # each rep loops until it takes about this long (short layers are launch-bound)
MAX_INNER = 200


def batch_bucket(batch: int) -> int:
    """The next power of two at or above `batch` (batches 5 to 8 share a decision)."""
    if batch < 1:
        raise ValueError(f"batch: expected a positive int, got {batch!r}")
    return 1 << (batch - 1).bit_length()


def gpu_identity(device) -> str:
    """The GPU's name and SM count, e.g. 'NVIDIA H200 (132 SMs)'."""
    import torch

    props = torch.cuda.get_device_properties(device)
    return f"{props.name} ({props.multi_processor_count} SMs)"


def decision_key(kernel_key: str, gpu: str, bucket: int, context: dict | None = None) -> str:
    """sha256 hex over everything a decision depends on."""
    material = {"schema": SCHEMA, "kernel": kernel_key, "gpu": gpu, "bucket": bucket, "context": context or {}}
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def torch_context() -> dict:
    """The torch settings a PyTorch chain's time depends on, beyond the GPU."""
    import torch

    return {"torch": torch.__version__, "cudnn_tf32": bool(torch.backends.cudnn.allow_tf32),
            "matmul_tf32": bool(torch.backends.cuda.matmul.allow_tf32)}  # (an imported Linear's PyTorch time)


def _store_dir(subdir: str = SUBDIR) -> Path:
    from specgen import cache

    return cache.cache_dir() / subdir


def load(key: str) -> dict | None:
    """The stored decision for `key`, or None (missing, unreadable, or not a decision)."""
    try:
        record = json.loads((_store_dir() / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    if not all(isinstance(record.get(k), (int, float)) for k in ("specgen_ms", "pytorch_ms")):
        return None
    return record


def cached_or_timed(key: str, timed, record: dict) -> tuple[float, float, str]:
    """(specgen ms, PyTorch ms, "cached" or "measured"): the stored decision for `key`, else
    `timed()`'s two times, stored with `record` (what the decision is about)."""
    found = load(key)
    if found is not None:
        return found["specgen_ms"], found["pytorch_ms"], "cached"
    ms, pt = timed()
    store(key, {**record, "specgen_ms": ms, "pytorch_ms": pt})
    return ms, pt, "measured"


def random_inputs(shapes: list, channels_last: list, dtype, device, count: int = 2) -> list[tuple]:
    """`count` tuples of fresh normal random tensors of `shapes` (seeded: the same on every run),
    each laid out channels-last where `channels_last` says (4-D and 5-D tensors)."""
    import torch

    from specgen import tmarun

    generator = torch.Generator(device=device).manual_seed(0)
    return [tuple(tmarun.laid_out(torch.randn(s, device=device, generator=generator).to(dtype), cl)
                  for s, cl in zip(shapes, channels_last)) for _ in range(count)]


def store(key: str, record: dict, subdir: str = SUBDIR) -> bool:
    """Write the decision atomically (into `subdir` of the cache: other measured choices, such as
    tuned tiles, share this writer); False (and a log line) when the cache cannot be written."""
    from specgen.cache import CacheDirError

    tmp = None
    try:
        folder = _store_dir(subdir)
        folder.mkdir(mode=0o700, exist_ok=True)
        tmp = folder / f"tmp.{os.getpid()}.{uuid.uuid4().hex}"
        tmp.write_text(json.dumps({**record, "key": key}, sort_keys=True))
        os.replace(tmp, folder / f"{key}.json")
        return True
    except (OSError, CacheDirError) as err:
        get_logger().info("could not keep a measured decision in the cache: %s", err)
        if tmp is not None:
            try:
                tmp.unlink()
            except OSError:
                pass
        return False


def compare(first, second, inputs: list, reps: int = REPS, warmup: int = WARMUP) -> tuple[float, float]:
    """Median milliseconds per call of `first(x)` and `second(x)` on the current CUDA stream
    (`time_loops`)."""
    first_ms, second_ms = time_loops([first, second], inputs, reps, warmup)
    return first_ms, second_ms


def time_loops(fns: list, inputs: list, reps: int = REPS, warmup: int = WARMUP) -> tuple[float, ...]:
    """Median milliseconds per call of each `fn(x)` on the current CUDA stream.

    The inputs are cycled through; each rep times a loop of calls (long enough to measure a
    launch-bound layer) between two CUDA events, and the contenders take turns rep by rep so
    that clock and thermal drift hit all alike. Runs under torch.no_grad()."""
    import torch

    first_input = inputs[0][0] if isinstance(inputs[0], (tuple, list)) else inputs[0]  # a model's several inputs
    with torch.no_grad(), torch.cuda.device(first_input.device):
        for fn in fns:
            for i in range(warmup):
                fn(inputs[i % len(inputs)])
        torch.cuda.synchronize()
        inner = [_calls_per_rep(fn, inputs) for fn in fns]

        def loop(fn, calls):
            def run():
                for i in range(calls):
                    fn(inputs[i % len(inputs)])
            return run

        return _alternate([loop(fn, calls) for fn, calls in zip(fns, inner)], inner, reps)


def _alternate(runs: list, calls: list[int], reps: int) -> tuple[float, ...]:
    """Median milliseconds per call of each of `runs` (run k makes `calls[k]` calls), timed
    between CUDA events, the runs taking turns rep by rep so that clock and thermal drift hit all alike."""
    import torch

    times: list[list] = [[] for _ in runs]
    for _ in range(reps):
        for which, run in enumerate(runs):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times[which].append(start.elapsed_time(end) / calls[which])
    return tuple(statistics.median(t) for t in times)


def _calls_per_rep(fn, inputs: list, target_ms: float = TARGET_REP_MS, most: int = MAX_INNER) -> int:
    """How many calls of `fn(inputs[0])` take about `target_ms` (from one timed call; 1 to `most`)."""
    import torch

    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn(inputs[0])
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    return max(1, min(most, int(target_ms / once)))


GRAPH_CALLS = 20  # at most this many calls captured in each contender's graph (compare_graphed)


def compare_graphed(first, second, inputs: list, reps: int = REPS, warmup: int = WARMUP) -> tuple[float, float]:
    """Median milliseconds per call of `first(x)` and `second(x)` on the GPU alone (`time_graphed`):
    what a call costs inside a CUDA graph, where the host's launch time is gone (`specgen.replay`)."""
    first_ms, second_ms = time_graphed([first, second], inputs, reps, warmup)
    return first_ms, second_ms


def time_graphed(fns: list, inputs: list, reps: int = REPS, warmup: int = WARMUP) -> tuple[float, ...]:
    """Median milliseconds per call of each `fn(x)` on the GPU alone: each contender's calls (the
    inputs cycled through; as many as make a rep last about TARGET_REP_MS host-inclusive, at most
    GRAPH_CALLS, the same number for all) captured in a CUDA graph, the replays timed as `compare`
    times its loops, the contenders taking turns. Warm-up calls first, on a side stream; the
    captures read the derived weights the warm-up kept (`tmarun.reusing_caches`). Runs under
    torch.no_grad(); raises what a capture raises."""
    import torch

    from specgen import tmarun

    first_input = inputs[0][0] if isinstance(inputs[0], (tuple, list)) else inputs[0]
    graphs = []
    with torch.no_grad(), torch.cuda.device(first_input.device):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for fn in fns:
                for i in range(warmup):
                    fn(inputs[i % len(inputs)])
        torch.cuda.current_stream().wait_stream(side)
        # as many calls per graph as make a replay last about TARGET_REP_MS (one call of a long layer)
        calls = min(_calls_per_rep(fn, inputs) for fn in fns)
        calls = max(1, min(GRAPH_CALLS, calls))
        for fn in fns:
            graph = torch.cuda.CUDAGraph()
            with tmarun.reusing_caches(), torch.cuda.graph(graph):
                for i in range(calls):
                    fn(inputs[i % len(inputs)])
            graphs.append(graph)
        for graph in graphs:
            graph.replay()
        torch.cuda.synchronize()
        return _alternate([graph.replay for graph in graphs], [calls] * len(graphs), reps)

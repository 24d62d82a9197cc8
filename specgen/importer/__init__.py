"""Import PyTorch models: find convolution chains that specgen can fuse and build their specs.

    report = specgen.explain(model, x)      # report.specs: the fusable chains; report.fallbacks: the rest, and why
    fused = specgen.from_module(model, x)   # the same model, each chain run by one FusedLayer

How it works. The model is captured with torch.fx (a symbolic trace, no GPU needed) and run once
on the example inputs to record every value's shape and dtype. Every convolution then starts a
chain that grows while the next node is something a spec can say:

* pointwise ops, however they are written (module, functional, method, operator), map to spec ops
  through the op table, specgen.ops: each row's `spellings` say how PyTorch writes the op, and
  `ops.EXPR_ONLY` lists the functions no op names (written inside an `expr`). A connected
  pointwise DAG over the chain value, numbers and per-channel tensors (hardswish written out by
  hand, `x * torch.sigmoid(x)`, ...) becomes one `expr` stage; a plain sequence of ops becomes
  the named stages (`leaky_relu`, `add`, ...);
* pools and reductions map to their spec ops (an adaptive pool to 1 is a global pool; one whose
  output size divides the input's is a windowed pool with kernel = stride = input / output);
  shape ops (view, reshape, flatten, squeeze, unsqueeze, and indexing with None and whole slices:
  `p[None, :, None, None]`) that only drop or insert size-1 dims are absorbed, and the fused
  layer's output is reshaped back to what the model returned;
* sizes read in forward that do not involve the batch (a pool's window `x.size()[2:]`, a divisor
  `x.shape[2] * x.shape[3]`) are numbers, as every size but the batch is fixed for a fused layer
  (`graph.batch_free_value`); one that involves the batch (`x / x.size(0)`) stays the model's;
* in-place ops written as statements (`y.mul_(0.5); y.add_(1.0); return y`), which the trace
  records as several uses of y, read as the chain they compute: each returns that very tensor, so
  later uses of y read its result (`graph.thread_inplace`; the model computes the same);
* the statistic stages (the op table's NORMS rows) in module, functional and method forms:
  group, instance and layer norm (their weight and bias the model's own: per channel, or of the
  normalized shape), softmax and log_softmax over the dims the call names (a view that flattens
  dims for a softmax and the view back are one stage over those dims);
* convolutions and transposed convolutions (module and functional forms) start chains;
* batch norm fuses as what it computes in the model's mode: in eval mode a `batch_norm` stage
  over the running statistics (the fused model keeps that behaviour even if it is later switched
  to training mode); in training mode the batch-statistics stage, which updates the model's very
  running statistics and num_batches_tracked as nn.BatchNormNd does (and after `.eval()` uses
  them); without running statistics the batch's, in either mode. Dropout fuses in eval mode, as
  the identity. Statistic stages run in float32 only: a bfloat16 or float16 chain ends before one.

A model torch.fx cannot trace (an `if` on a tensor's value, ...) runs its own forward as written,
and each direct child that one run on the example inputs calls once, with tensors, is imported on
its own from the inputs it received (an untraceable child the same way, one level down); its
specs are named after the parent and the attribute (`model_block1_conv`).

A chain ends at a value that is used more than once (or returned), at an op outside the
vocabulary, or where the spec would not validate; a chain with nothing after its convolution (or
Linear) is fused only in fp32 mode on a tensor-core engine (3xTF32, where PyTorch runs FFMA with
TF32 off). Every node that runs as PyTorch is a fallback, with its reason.

`from_module` rewrites the traced graph: each chain becomes a call to a FusedLayer whose
`conv.weight`, `conv.bias` and per-channel parameters are the very tensors of the original model
(same nn.Parameter objects), so training either trains both. Everything else runs as the
original PyTorch code. Float32, bfloat16 and float16 chains are fused (each spec's precision follows
the chain's dtype and, for float32, cuDNN's TF32 flag or `precision=`); shapes are those of the example inputs
(the batch size is free).

The package, in the order data flows: `graph` (the trace and the shape-recording run),
`recognize` (what each node computes, from the op table's spellings), `chains` (growing a chain
from each convolution, and why the other nodes run as PyTorch) with `exprs` (pointwise regions:
the named stages or the expr they become), `rewrite` (the fused layers, timing, the rewritten
graph; `joins` and `pools`: the concatenations and max pools no chain takes, each run by one
kernel) and `report` (what explain tells, the specs as YAML).

Never slower: on a GPU, `from_module` compiles every chain's kernel in one parallel build, then
times each chain as the original PyTorch code and as its fused layer (`specgen.measured`), and
keeps the original code wherever the kernel is not faster. Each decision is cached per kernel,
GPU and batch bucket, and shown with both times in the report (`report.choices`).
The joins and pools are timed the same way, each kernel against PyTorch's code for it
(`standalone_choice`), when the fused graph is written (`report.standalone_choices`).
`keep_slower=True` fuses every chain unmeasured; without a GPU nothing is measured.

CUDA graph: an eval-mode model on CUDA inputs is also captured whole in a CUDA graph
(`specgen.replay`), with each chain decided again by its GPU time alone (inside a graph the host's
launch time is gone), and returned wrapped in a `GraphReplay` where that measures faster; calls
that cannot replay (autograd on, other shapes, training mode) run the model chosen without it.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Optional

import torch
import torch.nn as nn

from specgen import measured, pipeline
from specgen.importer.chains import Analysis
from specgen.importer.graph import SPEC_PREFIX
from specgen.importer.recognize import supported_names
from specgen.importer.report import Choice, Fallback, ImportReport, ModelImportError, described_node, spec_yaml_text
from specgen.importer import joins, pools, rewrite
from specgen.importer.rewrite import ImportedLayer
from specgen.log import get_logger

__all__ = [
    "explain",
    "from_module",
    "ImportReport",
    "Fallback",
    "Choice",
    "ModelImportError",
    "ImportedLayer",
    "spec_yaml_text",
    "supported_names",
]


# The fused model replaces the original only when its time is below this fraction of the original's.
WHOLE_MODEL_MARGIN = 0.97


def _precision(precision):
    """The precision float32 chains take: None (as PyTorch would run them: tf32 where cuDNN's TF32
    flag allows it, else fp32), "fp32" or "tf32". 16-bit chains run in their dtype."""
    if precision is None or precision in ("fp32", "tf32"):
        return precision
    if precision in ("bf16", "fp16"):
        raise ValueError(
            f"precision: a {precision} layer needs the model in that dtype: convert the model and its input "
            f"({'.bfloat16()' if precision == 'bf16' else '.half()'}) instead; precision= sets how float32 chains run"
        )
    raise ValueError(f"precision: expected None, 'fp32' or 'tf32', got {precision!r}")


def _importer(model, example_inputs, precision=None) -> Analysis | str:
    """An analyzed importer, or the reason the model cannot be traced."""
    precision = _precision(precision)
    if not isinstance(model, nn.Module):
        raise ModelImportError(f"expected an nn.Module, got {type(model).__name__}")
    if not example_inputs:
        raise ModelImportError("give at least one example input (a tensor shaped like the model's input)")
    try:
        imp = Analysis(model, tuple(example_inputs), precision)
    except ModelImportError:
        raise
    except Exception as err:  # torch.fx cannot trace it (data-dependent control flow, ...)
        first = (str(err).strip().splitlines() or [""])[0]
        return f"torch.fx cannot trace {type(model).__name__}: {type(err).__name__}: {first[:300]}"
    imp.analyze()
    return imp


def _specialize_all(imp: Analysis) -> None:
    """Compile every chain's kernel in one parallel build (only the misses compile), then the
    variants the example's calls will take; the fused layers built afterwards find them in the
    process's memo."""
    if imp.chains and torch.cuda.is_available():
        items = pipeline.specialize_many([chain.spec for chain in imp.chains])
        if imp.channels_last:  # (the kernels its layers will run: their channels-last twins)
            pipeline.build_channels_last_variants(items)
        else:  # (and at a small example batch, the implicit GEMM's kernels of its TMA layers)
            batch = next((t.shape[0] for t in imp.inputs if isinstance(t, torch.Tensor) and t.is_cuda and t.dim() > 0), 0)
            pipeline.build_batch_variants(items, batch)
        joins.prebuild(imp)  # (a join's kernel is timed before the conv that reads it)


def _unmeasurable(imp: Analysis) -> Optional[str]:
    """Why the chains cannot be timed here, or None."""
    if not torch.cuda.is_available():
        return "no GPU"
    first = next((t for t in imp.inputs if isinstance(t, torch.Tensor)), None)
    if first is None or not first.is_cuda:
        return f"the example input is on {'cpu' if first is None else first.device.type}"
    return None


def _channels_last_worth_trying(imp: Analysis, keep_slower: bool) -> bool:
    """Whether from_module builds and times a channels-last candidate: chains to run, a GPU to time
    them on, and a 4-D or 5-D input that does not arrive channels-last already."""
    return (bool(imp.chains) and not keep_slower and _unmeasurable(imp) is None and not imp.channels_last
            and any(isinstance(t, torch.Tensor) and t.dim() in (4, 5) for t in imp.inputs))


def _fused(imp: Analysis, keep_slower: bool, log) -> tuple:
    """(the fused graph, one Choice per chain, the report) of an analyzed model, or (None, ...)
    where no chain is fused; `log`: where the fallbacks are told (None: not told, a second
    candidate of the same model)."""
    _specialize_all(imp)
    choices = _choices(imp, keep_slower)
    report = _report(imp, choices)
    if log is not None:
        by_name = {n.name: n for n in imp.nodes}
        for fb in report.fallbacks:
            level = log.warning if by_name.get(fb.node) in imp.warn else log.info
            level("%s: %s runs as PyTorch: %s", imp.name, fb.node, fb.reason)
        names = ", ".join(s.name for s in report.fused_specs) or "none"
        log.info("%s: %d chain(s) fused: %s", imp.name, len(report.fused_specs), names)
    if not imp.chains:
        return None, choices, report
    imp.chains = [chain for chain, choice in zip(imp.chains, choices) if choice.fused]
    fused = rewrite.fused_graph(imp, measure=not keep_slower and _unmeasurable(imp) is None)
    _standalone_report(report, imp.standalone_choices)
    fused.specgen_report = report
    return fused, choices, report


def _standalone_report(report: ImportReport, choices: list[Choice]) -> None:
    """Put the joins' and pools' never-slower choices into `report`: their times beside them, and
    the ones kept as PyTorch's code moved from `.joins` / `.pools` to the fallbacks."""
    report.standalone_choices = list(choices)
    kept = {c.layer: c for c in choices if not c.fused}
    for attr in ("joins", "pools"):
        runs = []
        for line in getattr(report, attr):
            name, what = described_node(line)
            if name in kept:
                report.fallbacks.append(Fallback(name, f"{what}: {kept[name]}"))
            else:
                runs.append(line)
        setattr(report, attr, runs)


def _report(imp: Analysis, choices: Optional[list[Choice]] = None) -> ImportReport:
    """The analysis's report, with the concatenations a ConcatLayer runs (`joins`) and the max
    pools a MaxPoolLayer runs (`pools`) among `.joins` and `.pools`, not among the fallbacks: where
    some chain is fused, so that the model is rewritten."""
    report = imp.report(choices)
    if any(c.fused for c in report.choices):
        found = joins.find(imp)
        fused = {c.layer for c in report.choices if c.fused}
        pooled = pools.find(imp, [c for c in imp.chains if c.spec.name in fused])  # (`_fused` drops the others next)
        names = {j.node.name for j in found} | {n.name for j in found for n in j.covers} | {p.node.name for p in pooled}
        report.fallbacks = [fb for fb in report.fallbacks if fb.node not in names]
        report.joins = [j.describe() for j in found]
        report.pools = [p.describe() for p in pooled]
    return report


def _choices(imp: Analysis, keep_slower: bool) -> list[Choice]:
    """One Choice per chain: kept as its kernel unless measured not faster than PyTorch."""
    why = "keep_slower=True" if keep_slower else _unmeasurable(imp)
    if why is not None:
        return [Choice(chain.spec.name, True, how=f"not measured ({why})") for chain in imp.chains]
    log = get_logger()
    choices = []
    for chain in imp.chains:
        choice = rewrite.measure(imp, chain)
        if not choice.fused:
            log.info("%s: %s kept as PyTorch (not faster fused): %s", imp.name, choice.layer, choice)
        choices.append(choice)
    return choices


def explain(model: nn.Module, *example_inputs, measure: bool = False, precision: Optional[str] = None) -> ImportReport:
    """What specgen can fuse in `model`, run on `example_inputs`: `.specs` and `.fallbacks`.

    Each spec's precision follows the model: a bfloat16 / float16 chain runs in that dtype; a
    float32 one as PyTorch would run it (`tf32` while `torch.backends.cudnn.allow_tf32` is True,
    PyTorch's default, else `fp32`), or in `precision` ("fp32" or "tf32") when given.

    With `measure=True` (and the model and inputs on a GPU) every chain is compiled and timed as
    `from_module` does, and `.choices` says which ones would stay PyTorch, with both times; the
    joins and pools likewise (`.standalone_choices`, the kept ones among the fallbacks).
    The model is not changed (buffers such as batch norm statistics are restored after the
    shape-recording run). Raises ModelImportError when the model fails on the inputs."""
    imp = _importer(model, example_inputs, precision)
    if isinstance(imp, str):
        report = ImportReport(type(model).__name__, [], [Fallback(type(model).__name__, imp)])
        for name, child, inputs in _child_calls(model, example_inputs):
            with _child_prefix(model, name):
                inner = explain(child, *inputs, measure=measure, precision=precision)
            report.specs += inner.specs
            report.fallbacks += [Fallback(f"{name}.{fb.node}", fb.reason) for fb in inner.fallbacks]
            report.choices += inner.choices
        return report
    if not measure:
        return _report(imp)
    _, _, report = _fused(imp, keep_slower=False, log=None)  # (the joins and pools are timed as the graph is written)
    return report


def from_module(model: nn.Module, *example_inputs, keep_slower: bool = False, precision: Optional[str] = None,
                cuda_graph: Optional[bool] = None, memory_format: str = "as_given") -> nn.Module:
    """`model` with every fusable chain run by a FusedLayer sharing the model's parameters.

    Precision as in `explain`: 16-bit chains in their dtype, float32 chains in `tf32` while cuDNN's
    TF32 flag is on (PyTorch's default) else `fp32`, unless `precision` ("fp32" or "tf32") says.

    On a GPU, all chains' kernels compile in one parallel build, and a chain whose kernel is not
    faster than its PyTorch code (timed once, cached per GPU and batch bucket) keeps the PyTorch
    code; `keep_slower=True` fuses every chain without timing. Unfused nodes run as the original
    PyTorch code; each is logged (logger `specgen`) with its reason: as a warning when it
    concerns a convolution chain, at info level otherwise. The returned module's
    `specgen_report` is the explain() report with `.choices` (both times per chain).
    Example-input shapes are baked into the fused layers (the batch size stays free). On a GPU the
    whole fused model is timed once more against the original, and the original is returned
    (with `specgen_report` set, `.whole_model` holding both times) unless the fused one is faster
    by 3% (WHOLE_MODEL_MARGIN). All timing runs under torch.no_grad(): a forward with autograd on
    records each fused chain for the backward (host time that counts at small batches, where
    a fused model can then be slower than the original), and a backward recomputes each chain
    with PyTorch ops before differentiating it.

    CUDA graph (`cuda_graph`): an eval-mode model on CUDA inputs is also captured whole in a CUDA
    graph for the example inputs' shapes (`specgen.replay.GraphReplay`: one launch per forward,
    no host time per kernel). With None (the default) the graph is timed against the model
    chosen above and returned, wrapping it, when faster by the same margin (the report's
    `.graph` holds both times); True takes it untimed, False never. Calls that cannot replay
    (autograd on, other shapes, training mode) run the chosen model.

    Memory format (`memory_format`): "as_given" (the default) runs the activations in the format
    the inputs come in (channels-last inputs keep the format through every layer that has a
    channels-last kernel). "channels_last" lays the model's 4-D and 5-D inputs out channels-last on
    the way in (one copy each) and makes its outputs contiguous on the way out, each chain decided
    on channels-last inputs, as torch.compile lays a conv net out. "auto" builds both and times
    them on a GPU, taking channels-last when faster by WHOLE_MODEL_MARGIN (the report's
    `.memory_formats` holds both times); it doubles the specialization time, and is not the
    default because no model measured so far gains from it (a pool after a conv, or a depthwise
    conv, still writes NC(D)HW, so the format does not reach the layers after it)."""
    log = get_logger()
    if memory_format not in ("as_given", "channels_last", "auto"):
        raise ValueError(f"memory_format: expected 'as_given', 'channels_last' or 'auto' (both timed), got {memory_format!r}")
    imp = _importer(model, example_inputs, precision)
    if isinstance(imp, str):
        return _fused_children(model, example_inputs, imp, keep_slower=keep_slower, precision=precision,
                               cuda_graph=cuda_graph, memory_format=memory_format)
    as_given = None
    if memory_format == "channels_last" or (memory_format == "auto" and _channels_last_worth_trying(imp, keep_slower)):
        cl = _importer(model, tuple(rewrite.to_channels_last(t) for t in example_inputs), precision)
        if isinstance(cl, Analysis) and cl.channels_last:
            as_given, imp = (imp if memory_format == "auto" else None), cl
    fused, choices, report = _fused(imp, keep_slower, log)
    if fused is None:
        return model
    if as_given is not None:
        # The same model with its activations as given: built and timed against the channels-last one
        fused_given, choices_given, report_given = _fused(as_given, keep_slower, None)
        if fused_given is not None:
            inputs = [tuple(example_inputs)]
            with rewrite.buffers_kept(model, fused, fused_given):
                cl_ms, given_ms = measured.compare(lambda a: fused(*a), lambda a: fused_given(*a), inputs)
            if cl_ms >= given_ms * WHOLE_MODEL_MARGIN:
                fused, choices, report, imp = fused_given, choices_given, report_given, as_given
            report.memory_formats = (cl_ms, given_ms)
            fused.specgen_report = report
    if not imp.chains:
        # every chain measured no faster fused: the original itself (a rewritten module of PyTorch
        # code only would add its own call overhead), unless chains win inside a CUDA graph (below),
        # where a chain costs its GPU time alone (a small batch's Linear layers over tokens)
        fused = model
    elif imp.channels_last:
        report.memory_format = "channels_last"
    chosen: nn.Module = fused
    timed = not keep_slower and _unmeasurable(imp) is None
    if timed and fused is not model:
        # Chains that win alone can still lose together (caches, launch gaps): the whole model is
        # timed once more, and the original is kept unless the fused one is faster by a margin
        # (a launch-bound model's times move by a few percent from run to run).
        inputs = [tuple(example_inputs)]
        with rewrite.buffers_kept(model, fused):
            fused_ms, plain_ms = measured.compare(lambda a: fused(*a), lambda a: model(*a), inputs)
        report.whole_model = (fused_ms, plain_ms)
        if fused_ms >= plain_ms * WHOLE_MODEL_MARGIN:
            chosen = model
    if cuda_graph is not False:
        why = _graph_possible(model, example_inputs)
        if why is None and cuda_graph is None and not timed:
            why = "not measured (keep_slower=True times nothing; cuda_graph=True takes a graph untimed)"
        if why is not None:
            (log.warning if cuda_graph else log.info)("%s: no CUDA graph: %s", imp.name, why)
        else:
            target = _graph_fused(model, example_inputs, precision, fused, choices, report, imp.channels_last) if timed else fused
            graphed = None if target is model else _graph_choice(imp.name, target, chosen, example_inputs, cuda_graph, report)
            if graphed is not None:
                graphed.specgen_report = report
                return graphed
    if chosen is model:
        if fused is not model:
            fused_ms, plain_ms = report.whole_model
            log.warning(
                "%s: the fused model (%.3f ms) is not faster than the original (%.3f ms) at this batch: "
                "keeping the original (keep_slower=True fuses anyway)", imp.name, fused_ms, plain_ms,
            )
        model.specgen_report = report  # the original, with the report that says why
        return model
    return fused


@contextlib.contextmanager
def _child_prefix(model: nn.Module, name: str):
    """Spec names of `model`'s child `name`, imported on its own, start with the parent's and the
    attribute's name (two blocks of one class get different names)."""
    token = SPEC_PREFIX.set(f"{SPEC_PREFIX.get() or type(model).__name__.lower()}_{name}")
    try:
        yield
    finally:
        SPEC_PREFIX.reset(token)


def _child_calls(model: nn.Module, example_inputs: tuple) -> list[tuple[str, nn.Module, tuple]]:
    """The direct children of `model` that one run on the example inputs calls exactly once, with
    tensors alone (positional), and those tensors: (name, child, inputs) in call order. The run's
    buffer updates (training-mode batch norms) are undone."""
    calls: dict[str, list] = {}
    children = dict(model.named_children())
    hooks = []
    for name, child in children.items():
        def record(module, args, name=name):
            calls.setdefault(name, []).append(tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args))

        hooks.append(child.register_forward_pre_hook(record))
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.no_grad():
            model(*example_inputs)
    except Exception as err:  # the model's own error on these inputs
        raise ModelImportError(f"{type(model).__name__} fails on the example inputs: {type(err).__name__}: {err}") from None
    finally:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            for buf, saved in buffers:
                buf.copy_(saved)
    return [(name, children[name], args[0]) for name, args in calls.items()
            if len(args) == 1 and args[0] and all(isinstance(a, torch.Tensor) for a in args[0])]


def _fused_children(model: nn.Module, example_inputs: tuple, why: str, **options) -> nn.Module:
    """A model torch.fx cannot trace (control flow on values, ...): its own forward runs as written,
    and each direct child called once, with tensors, on the example inputs is imported on its own
    (`from_module` on the inputs it received; an untraceable child the same way, one level down).
    Returns a shallow copy of `model` with those children replaced (the same parameters), or
    `model` itself where no child fused. `specgen_report` gathers the children's reports."""
    log = get_logger()
    report = ImportReport(type(model).__name__, [], [Fallback(type(model).__name__, f"{why}; its children are imported one by one")])
    replaced: dict[str, nn.Module] = {}
    for name, child, inputs in _child_calls(model, example_inputs):
        with _child_prefix(model, name):
            fused = from_module(child, *inputs, **options)
        inner = getattr(fused, "specgen_report", None)
        if inner is not None:
            report.specs += inner.specs
            report.fallbacks += [Fallback(f"{name}.{fb.node}", fb.reason) for fb in inner.fallbacks]
            report.choices += inner.choices
        if fused is not child:
            replaced[name] = fused
    if not replaced:
        log.warning("%s runs as PyTorch: %s", type(model).__name__, why)
        return model
    log.info("%s: %s; %d of its children imported one by one (%s)", type(model).__name__, why, len(replaced),
             ", ".join(replaced))
    out = copy.copy(model)
    out._modules = dict(model._modules)  # (its own children; parameters and buffers stay the model's)
    out._modules.update(replaced)
    out.specgen_report = report
    return out


def _graph_possible(model: nn.Module, example_inputs: tuple) -> Optional[str]:
    """Why the model cannot be replayed from a CUDA graph on these inputs, or None."""
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs):
        return "the example inputs are not all CUDA tensors"
    if any(m.training for m in model.modules()):
        return "the model is in training mode"
    return None


def _graph_fused(model: nn.Module, example_inputs: tuple, precision, fused: nn.Module, choices: list[Choice],
                 report: ImportReport, channels_last: bool = False) -> nn.Module:
    """The fused model a CUDA graph replays. Inside a graph a chain costs its GPU time alone, so
    each chain is decided again by that (`rewrite.measure(gpu_only=True)`, cached apart): a kernel
    that wins only by launching faster than PyTorch's several kernels loses there, and one that
    loses only on the host wins. The joins and pools likewise (`report.graph_standalone_choices`).
    `fused` itself where the decisions agree (or cannot be made)."""
    log = get_logger()
    if channels_last:
        example_inputs = tuple(rewrite.to_channels_last(t) for t in example_inputs)
    imp = _importer(model, example_inputs, precision)
    if isinstance(imp, str) or [c.spec.name for c in imp.chains] != [c.layer for c in choices]:
        return fused
    try:
        gpu = [rewrite.measure(imp, chain, gpu_only=True) for chain in imp.chains]
        report.graph_choices = gpu
        same = [c.fused for c in gpu] == [c.fused for c in choices]
        if same and not report.standalone_choices:
            return fused  # (nothing else to decide: no model built again)
        imp.chains = [chain for chain, choice in zip(imp.chains, gpu) if choice.fused]
        graph_fused = rewrite.fused_graph(imp, measure=True, gpu_only=True)
    except Exception as err:  # noqa: BLE001  (a chain that cannot be captured: keep the other decisions)
        log.info("%s: chains not timed inside a CUDA graph: %s: %s", imp.name, type(err).__name__, err)
        return fused
    report.graph_standalone_choices = list(imp.standalone_choices)
    if same and [c.fused for c in imp.standalone_choices] == [c.fused for c in report.standalone_choices]:
        return fused
    log.info("%s: inside the CUDA graph, %d chain(s) run as kernels: %s; joins and pools: %s", imp.name, len(imp.chains),
             ", ".join(c.spec.name for c in imp.chains) or "none",
             ", ".join(c.layer for c in imp.standalone_choices if c.fused) or "none")
    graph_fused.specgen_report = report
    return graph_fused


def _graph_choice(name: str, fused: nn.Module, chosen: nn.Module, example_inputs: tuple, cuda_graph: Optional[bool],
                  report: ImportReport):
    """`fused` replayed from a CUDA graph (`specgen.replay`), its other calls running `chosen`; or
    None where no graph is taken: a forward that cannot be captured, or (`cuda_graph=None`) a graph
    not faster than `chosen` by WHOLE_MODEL_MARGIN. The caller checked that one may be tried."""
    from specgen.replay import GraphReplay

    log = get_logger()
    try:  # (an eval-mode forward changes no buffer: nothing to restore, no version moved)
        graphed = GraphReplay(fused, *example_inputs, fallback=chosen)
    except Exception as err:  # noqa: BLE001  (a forward that syncs or allocates on the host cannot be captured)
        why = f"the forward cannot be captured: {type(err).__name__}: {(str(err).strip().splitlines() or [''])[0][:200]}"
        (log.warning if cuda_graph else log.info)("%s: no CUDA graph: %s", name, why)
        return None
    if cuda_graph is None:
        inputs = [tuple(example_inputs)]
        graph_ms, plain_ms = measured.compare(lambda a: graphed(*a), lambda a: chosen(*a), inputs)
        report.graph = (graph_ms, plain_ms)
        if graph_ms >= plain_ms * WHOLE_MODEL_MARGIN:
            log.info("%s: the CUDA graph (%.3f ms) is not faster than the model it would replace (%.3f ms): not taken",
                     name, graph_ms, plain_ms)
            return None
    report.graph_taken = True
    return graphed

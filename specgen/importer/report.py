"""What the importer tells: the specs it found, the nodes that run as PyTorch and why, and the
never-slower choices; the specs as YAML."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from specgen import ops
from specgen.spec import LayerSpec


class ModelImportError(ValueError):
    """The model cannot be examined at all: it is not an nn.Module, or it fails on the example inputs."""


class Fallback(NamedTuple):
    """One node of the model that runs as PyTorch: its torch.fx node name and why it is not fused."""

    node: str
    reason: str


class Choice(NamedTuple):
    """Whether one fusable chain runs as its specialized kernel, and the times that decided it.

    `how`: "measured" (timed now), "cached" (timed earlier on this GPU kind and batch bucket) or
    "not measured (why)"; the times are milliseconds per call, None when not measured."""

    layer: str
    fused: bool
    specgen_ms: Optional[float] = None
    pytorch_ms: Optional[float] = None
    how: str = "not measured"

    def __str__(self) -> str:
        if self.specgen_ms is None or self.pytorch_ms is None:
            return f"fused, {self.how}"
        verdict = "fused" if self.fused else "kept as PyTorch"
        return f"{verdict}: specgen {self.specgen_ms:.4f} ms, PyTorch {self.pytorch_ms:.4f} ms ({self.how})"


def described_node(line: str) -> tuple[str, str]:
    """(the node, what it is) of a `joins` / `pools` line, "node: description"."""
    node, _, what = line.partition(": ")
    return node, what


@dataclass
class ImportReport:
    """What `explain` found: the specs (in model order) and the nodes that run as PyTorch.

    `choices` holds one Choice per spec (same order): whether `from_module` runs it as its kernel
    or kept the PyTorch code because the kernel was not faster, with both times."""

    model: str
    specs: list[LayerSpec]
    fallbacks: list[Fallback]
    choices: list[Choice] = field(default_factory=list)
    # from_module's last check: (fused, original) milliseconds of the whole model; None: not timed
    whole_model: tuple | None = None
    # from_module's CUDA-graph check: (graph replay, the model it would replace) milliseconds; None: not timed
    graph: tuple | None = None
    graph_taken: bool = False  # whether from_module returned the graph (times within its margin are not taken)
    # from_module's decisions for the CUDA graph: one Choice per spec, timed inside a graph (empty: none made)
    graph_choices: list[Choice] = field(default_factory=list)
    # How the fused model's activations lie: "channels_last" where its inputs are laid out so on the
    # way in (every layer then reads and writes that format), else "as given"
    memory_format: str = "as given"
    # from_module's memory-format check: (channels-last, as given) milliseconds of the fused model; None: not timed
    memory_formats: tuple | None = None
    # The concatenations of an upsampled value that one specgen kernel runs (`specgen.concat`), described
    joins: list[str] = field(default_factory=list)
    # The max pools no chain takes that one specgen kernel runs (`specgen.maxpool`), described
    pools: list[str] = field(default_factory=list)
    # from_module's never-slower choices for the joins and pools (Choice.layer: the cat's or pool's
    # node); those kept as PyTorch are among the fallbacks, not in `joins` / `pools`
    standalone_choices: list[Choice] = field(default_factory=list)
    # ... and inside the CUDA graph (timed there, as `graph_choices` are for the chains; empty: none made)
    graph_standalone_choices: list[Choice] = field(default_factory=list)

    @property
    def fused_specs(self) -> list[LayerSpec]:
        """The specs that run as specialized kernels (all of them, unless measured slower)."""
        kept = {c.layer for c in self.choices if not c.fused}
        return [spec for spec in self.specs if spec.name not in kept]

    def __str__(self) -> str:
        kept = len(self.specs) - len(self.fused_specs)
        also = f" ({kept} more kept as PyTorch: not faster fused)" if kept else ""
        lines = [f"{self.model}: {len(self.specs) - kept} fused layer(s){also}, {len(self.fallbacks)} node(s) run as PyTorch"]
        choice = {c.layer: c for c in self.choices}
        in_graph = {c.layer: c for c in self.graph_choices}
        for spec in self.specs:
            stages = ", ".join(stage.op for stage in spec.epilogue)
            up = f" over its input upsampled {'x'.join(map(str, spec.conv_geometry()['upsample']))}" if spec.upsampled() else ""
            line = f"  {spec.name}: conv{spec.ndim}d {spec.input.channels}->{spec.conv.out_channels}{up} | {stages}"
            if spec.name in choice and choice[spec.name].specgen_ms is not None:
                line += f"  [{choice[spec.name]}]"
            if spec.name in in_graph and in_graph[spec.name].specgen_ms is not None:
                line += f"  [in the CUDA graph: {in_graph[spec.name]}]"
            lines.append(line)
        timed = {c.layer: c for c in self.standalone_choices if c.specgen_ms is not None}
        timed_in_graph = {c.layer: c for c in self.graph_standalone_choices if c.specgen_ms is not None}
        for what, described in (("joined", self.joins), ("pooled", self.pools)):
            for line in described:
                name, _ = described_node(line)
                line = f"  {what} by one kernel: {line}"
                if name in timed:
                    line += f"  [{timed[name]}]"
                if name in timed_in_graph:
                    line += f"  [in the CUDA graph: {timed_in_graph[name]}]"
                lines.append(line)
        for fb in self.fallbacks:
            in_graph = timed_in_graph.get(fb.node)
            lines.append(f"  not fused: {fb.node}: {fb.reason}" + (f"  [in the CUDA graph: {in_graph}]" if in_graph else ""))
        if self.memory_formats is not None:
            cl_ms, given_ms = self.memory_formats
            lines.append(f"  activations: channels-last {cl_ms:.3f} ms, as given {given_ms:.3f} ms: {self.memory_format}")
        elif self.memory_format != "as given":
            lines.append(f"  activations: {self.memory_format}")
        if self.whole_model is not None:
            fused_ms, plain_ms = self.whole_model
            verdict = "fused" if fused_ms < plain_ms else "kept the original (not faster fused)"
            lines.append(f"  whole model: fused {fused_ms:.3f} ms, original {plain_ms:.3f} ms: {verdict}")
        if self.graph is not None:
            graph_ms, plain_ms = self.graph
            verdict = "replayed from the graph" if self.graph_taken else "not taken (not faster by the margin)"
            lines.append(f"  CUDA graph: {graph_ms:.3f} ms against {plain_ms:.3f} ms: {verdict}")
        return "\n".join(lines)

    def yaml(self) -> str:
        """The specs as YAML: one mapping for one spec, a list for several (what `load_specs` reads)."""
        return spec_yaml_text(self.specs)


def spec_yaml_text(specs: list[LayerSpec]) -> str:
    """Specs as YAML, in canonical form (defaults filled in, geometry spelled per dim), leaving out
    unset optional fields; one mapping for one spec, a list for several. Reads back with parse_yaml."""
    import yaml

    data = [_plain(spec) for spec in specs]
    payload = data[0] if len(data) == 1 else data
    return yaml.safe_dump(payload, sort_keys=False, default_flow_style=None, width=100)


def _plain(spec: LayerSpec) -> dict:
    data = spec.canonical()
    if data.get("tile") is None:
        data.pop("tile", None)
    for stage in data["epilogue"]:
        ((op, args),) = stage.items()
        fields = ops.args_model(op).model_fields
        # unset optional fields are left out; a None that is not the default says something (momentum: null)
        stage[op] = {k: v for k, v in args.items() if k in fields and (v is not None or fields[k].default is not None)}
    return data

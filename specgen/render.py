"""Render a plan into CUDA source with Jinja2 (StrictUndefined: a missing value is an error)."""

from __future__ import annotations

import functools
import re

import jinja2

from specgen.kernelplan import SequencePlan
from specgen.paths import templates_dir
from specgen.plan import build_plan
from specgen.spec import LayerSpec, SpecError

# The largest source specgen writes. The examples render 10 to 26 KB and the longest valid spec
# (64 stages of the longest expressions, with nested powers) measured 0.28 MB; nvcc's time and memory
# grow with the source, so a spec that renders more than this is refused before it is compiled.
MAX_SOURCE_BYTES = 2 << 20


# One template per engine. The slab and FFMA engines extend box.cu.j2, the box kernel they share
# (its banner, constants, signature, tiles, pools and reductions).
TEMPLATES = {"tma": "tma.cu.j2", "igemm": "igemm.cu.j2", "slab": "slab.cu.j2", "ffma": "ffma.cu.j2"}
# A sequence's parts that are not a conv engine's plan, by role.
PART_TEMPLATES = {"tail": "tail.cu.j2", "tapsum": "tapsum.cu.j2", "boxmean": "boxmean.cu.j2"}
# The templates without a run-time-dimensions rendering (`specgen bench`'s measurement of what
# specializing saves), and what they render.
NO_RUNTIME_DIMS = {"igemm.cu.j2": "the igemm engine", "tma.cu.j2": "the tma engine",
                   "tail.cu.j2": "a statistic stage's kernels", "tapsum.cu.j2": "the tap-sum fold's kernel",
                   "dwcl.cu.j2": "the channels-last depthwise-LayerNorm kernel"}


class SourceTooLarge(SpecError):
    """The rendered source would exceed MAX_SOURCE_BYTES (bad input: exit 2)."""


class TemplateError(RuntimeError):
    """A template failed to render; the message names the template file and line."""


@functools.cache
def environment() -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
    )


def _template_location(err: BaseException) -> str:
    """'box.cu.j2:42' from the traceback of an error raised while rendering."""
    tb, where = err.__traceback__, ""
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if filename.endswith(".j2"):
            where = f"{filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def _part_template(part) -> str | None:
    """The template of a sequence part: its role's, or the channels-last depthwise-LayerNorm kernel's."""
    return "dwcl.cu.j2" if getattr(part.plan, "family", None) == "dwcl" else PART_TEMPLATES.get(part.role)


def render_plan(plan: dict, template: str | None = None, runtime_dims: bool = False) -> str:
    """The .cu of a plan, from its engine's template. `runtime_dims` renders the measurement-only
    variant whose extents are read at run time (what specializing saves is measured against it)."""
    if template is None and isinstance(plan, SequencePlan):  # one source: each part's in its own namespace
        from specgen import tail

        parts = [render_plan(p.plan, _part_template(p), runtime_dims) for p in plan.parts]
        return _checked(tail.join(plan, parts), plan)
    if template is None:
        engine = plan.get("engine")
        if engine not in TEMPLATES:
            raise TemplateError(f"no template for the engine {engine!r}; known: {', '.join(TEMPLATES)}")
        template = TEMPLATES[engine]
    if runtime_dims and template in NO_RUNTIME_DIMS:
        raise TemplateError(f"{template} ({NO_RUNTIME_DIMS[template]}): no run-time-dimensions rendering")
    try:
        text = environment().get_template(template).render(**plan, runtime_dims=runtime_dims)
    except jinja2.TemplateSyntaxError as err:
        raise TemplateError(f"{err.filename or err.name}:{err.lineno}: {err.message}") from err
    except (jinja2.UndefinedError, TypeError, ValueError, KeyError, AttributeError) as err:
        where = _template_location(err) or template
        raise TemplateError(f"{where}: {type(err).__name__}: {err}") from err
    # Collapse runs of blank lines left by control blocks; strip trailing spaces.
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return _checked(text, plan)


def _templates_of(plan, template: str | None = None):
    """The templates `render_plan(plan, template)` renders from, each part's for a sequence (None
    for an engine without one)."""
    if template is None and isinstance(plan, SequencePlan):
        for p in plan.parts:
            yield from _templates_of(p.plan, _part_template(p))
    else:
        yield template or TEMPLATES.get(plan.get("engine"))


def has_runtime_dims(plan) -> bool:
    """Whether `render_plan(plan, runtime_dims=True)` has a rendering to give: every kernel of the
    plan (each part of a sequence) comes from a template that has one."""
    return all(t is not None and t not in NO_RUNTIME_DIMS for t in _templates_of(plan))


def _checked(text: str, plan: dict) -> str:
    """`text`, unless it is larger than MAX_SOURCE_BYTES (SourceTooLarge)."""
    size = len(text.encode())
    if size > MAX_SOURCE_BYTES:
        raise SourceTooLarge(
            [f"the kernel source would be {size} bytes, more than specgen's limit of {MAX_SOURCE_BYTES} "
             f"({MAX_SOURCE_BYTES >> 20} MiB); shorten the epilogue or its expressions"],
            plan.get("name", ""),
        )
    return text


def render(spec: LayerSpec) -> str:
    """The kernel-only .cu for a spec: same spec, byte-identical text."""
    return render_plan(build_plan(spec))

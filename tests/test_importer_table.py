"""The importer's recognition comes from the op table: every spelling a row of specgen.ops lists
(module, function, Tensor method, Python operator) imports as that row's op, and the importer
itself spells no op of the table (CPU)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import operator
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import specgen.importer  # noqa: E402
from specgen import ops  # noqa: E402
from specgen.importer import explain, recognize, supported_names  # noqa: E402

C = 4
NAMESPACES = {"torch": torch, "F": F, "operator": operator, "torch.special": torch.special}


def _spelled(table):
    """(row, spelling, kind, name) for every name the rows of `table` spell."""
    for row in table.values():
        for spelling in row.spellings:
            for nd in spelling.nd or (None,):
                for kind in ("functions", "methods", "modules"):
                    for name in getattr(spelling, kind):
                        yield row, spelling, kind, name.format(nd=nd)


def _operands(spelling: ops.Spelling) -> list[str]:
    """The operands after the tensor that a call passes: the required ones, else all of them."""
    sig = [part.strip() for part in (spelling.sig or "input").split(",")]
    required = [n for n in sig[1:] if "=" not in n and n in spelling.operands]
    return required or [n for n in spelling.operands[1:] if n not in spelling.fixed]


class Spelled(nn.Module):
    """A convolution followed by one op, written as `kind` `name` of the op table's spelling."""

    def __init__(self, spelling: ops.Spelling, kind: str, name: str, nd: int = 2, row_name: str = ""):
        super().__init__()
        self.conv = getattr(nn, f"Conv{nd}d")(3, C, 3)
        self.kind, self.name, self.operands = kind, name, _operands(spelling)
        self.form = spelling.form
        self.row = row_name
        self.register_buffer("stat", torch.full((C,), 0.5))
        if kind == "modules":
            cls = getattr(nn, name)
            required = [
                p for p in inspect.signature(cls).parameters.values() if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD
            ]
            if row_name == "threshold":  # its threshold and value have no defaults
                self.op = cls(0.5, 0.0)
            else:
                self.op = cls(C) if required else cls()  # nn.BatchNormNd(num_features)

    def forward(self, x):
        x = self.conv(x)
        if self.kind == "modules":
            return self.op(x)
        # a number for a power's exponent, a (C,) buffer for batch norm statistics, else a scalar
        # tensor made in forward (a traced constant, which the importer reads as its number)
        value = {"power": lambda: 0.5, "batch_norm": lambda: self.stat}.get(self.form, lambda: torch.tensor(0.5))
        more = [value() for _ in self.operands]
        if self.kind == "methods":
            method = getattr(x, self.name)

            def call(tensor, *args):  # (tensor is x, the method's own)
                return method(*args)
        else:
            space, _, attr = self.name.rpartition(".")
            call = getattr(NAMESPACES[space], attr)
        if self.row in ops.COMPARISONS:  # a bool tensor: a factor of the chain value
            return x * call(x, *more)
        if self.row == "where":  # its condition a comparison
            return call(x > 0.5, x, *more[1:])
        if self.row == "threshold":
            return call(x, 0.5, 0.0)
        return call(x, *more)


def _case(spelling, kind, name, row_name=""):
    digit = re.search(r"(\d)d$", name) if kind == "modules" else None
    nd = int(digit.group(1)) if digit else 2
    model = Spelled(spelling, kind, name, nd, row_name).eval()
    return model, torch.randn((2, 3) + (6,) * nd)


SPELLED = [
    pytest.param(row, spelling, kind, name, id=f"{row.name}-{name}")
    for table in (ops.POINTWISE, ops.EXPR_ONLY)
    for row, spelling, kind, name in _spelled(table)
]


@pytest.mark.parametrize("row, spelling, kind, name", SPELLED)
def test_every_pointwise_spelling_imports_as_its_row(row, spelling, kind, name):
    model, x = _case(spelling, kind, name, row.name)
    report = explain(model, x)
    assert len(report.specs) == 1 and not report.fallbacks, str(report)
    stages = [stage.op for stage in report.specs[0].epilogue]
    assert stages == [row.name if isinstance(row, ops.Pointwise) else "expr"], str(report)


def test_every_row_with_spellings_has_module_function_and_method_forms_between_them():
    """The rows spell the op every way PyTorch code writes it (where PyTorch has that form)."""
    kinds = {}
    for row, _, kind, _ in _spelled(ops.POINTWISE):
        kinds.setdefault(row.name, set()).add(kind)
    assert set(kinds) == {name for name, row in ops.POINTWISE.items() if row.spellings}
    assert kinds["relu"] == kinds["sigmoid"] == kinds["tanh"] == {"functions", "methods", "modules"}
    assert all("functions" in k for k in kinds.values())


def test_pools_reductions_and_norms_come_from_their_rows():
    names = supported_names()
    for row, spelling, kind, name in (*_spelled(ops.POOLS), *_spelled(ops.REDUCTIONS), *_spelled(ops.NORMS)):
        shown = f"nn.{name}" if kind == "modules" else name
        assert shown in names[kind], (row.name, shown)


def test_a_spelling_added_to_a_row_is_recognized(monkeypatch):
    """torch.special.expit is sigmoid: one more spelling on the sigmoid row makes it import."""

    class Expit(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, C, 3)

        def forward(self, x):
            return torch.special.expit(self.conv(x))

    x = torch.randn(2, 3, 6, 6)
    row = ops.POINTWISE["sigmoid"]
    # (the row spells it; without that spelling it is unknown)
    spellings = tuple(dataclasses.replace(sp, functions=tuple(f for f in sp.functions if f != "torch.special.expit"))
                      for sp in row.spellings)
    monkeypatch.setitem(ops.POINTWISE, "sigmoid", dataclasses.replace(row, spellings=spellings))
    monkeypatch.setattr(recognize, "_TABLES", recognize._tables())
    assert "torch.special.expit is not a supported op" in str(explain(Expit(), x))
    more = dataclasses.replace(row, spellings=(*spellings, ops.Spelling("input", ("torch.special.expit",))))
    monkeypatch.setitem(ops.POINTWISE, "sigmoid", more)
    monkeypatch.setattr(recognize, "_TABLES", recognize._tables())
    report = explain(Expit(), x)
    assert [stage.op for stage in report.specs[0].epilogue] == ["sigmoid"] and not report.fallbacks


def _importer_strings() -> set[str]:
    folder = Path(specgen.importer.__file__).parent
    strings = set()
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.add(node.value)
    return strings


def test_the_importer_spells_no_op_of_the_table():
    """No function, module or method name a row spells appears in the importer's own source (op
    names such as 'mul' aside): the rows are the one place that says how PyTorch writes an op."""
    tables = (ops.POINTWISE, ops.EXPR_ONLY, ops.POOLS, ops.REDUCTIONS, ops.NORMS)
    spelled = {name for table in tables for _, _, _, name in _spelled(table)}
    templates = {n for table in tables for row in table.values() for s in row.spellings for n in s.functions + s.modules}
    op_names = {name for table in tables for name in table}
    found = _importer_strings() & ((spelled | templates) - op_names)
    assert not found, f"the importer spells {sorted(found)} itself; they belong in the op table (specgen.ops)"


def test_every_form_a_spelling_names_is_known_to_the_importer():
    forms = {s.form for table in (ops.POINTWISE, ops.EXPR_ONLY) for row in table.values() for s in row.spellings}
    assert forms - {None} <= set(recognize._FORMS)
    assert all(s.form is None for row in ops.NORMS.values() for s in row.spellings)  # one builder for every norm
    for row in ops.REDUCTIONS.values():
        for spelling in row.spellings:
            assert spelling.elementwise is None or spelling.elementwise in ops.POINTWISE


def test_expr_forms_compute_what_the_row_computes():
    """Each row's expr text (how the importer writes the op inside an expr) is the op: it parses
    in the expr grammar and its PyTorch value equals the row's reference."""
    from specgen import expr as expr_mod

    x = torch.linspace(-3.0, 3.0, 25)
    for row in ops.POINTWISE.values():
        fields = {k: v for k, v in row.args.model_fields.items() if not v.is_required()}
        if not row.spellings or row.name in ("batch_norm", "expr") or len(row.spellings[0].operands) > 1:
            continue
        args = row.args()
        text = row.expr_form(["x"], {k: getattr(args, k) for k in fields})
        if text is None:  # softplus: no expr form
            continue
        got = expr_mod.parse(text).to_torch(x, {})
        torch.testing.assert_close(got, row.torch_ref(x, args, {}), msg=f"{row.name}: {text}")


def test_the_spellings_need_no_torch():
    """ops.py stays importable without torch (the build path): spellings are names, not objects."""
    code = (
        "import sys, specgen.ops as o; "
        "n = sum(len(s.functions) for t in (o.POINTWISE, o.EXPR_ONLY, o.POOLS, o.REDUCTIONS, o.NORMS) "
        "for r in t.values() for s in r.spellings); print(n > 0, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]

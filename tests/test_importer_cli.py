"""`specgen import FILE.py:Model`: the CLI around specgen.explain."""

from __future__ import annotations

import argparse

import pytest
import torch

from specgen import importcli
from specgen.importer import explain
from specgen.spec import load_specs, parse_yaml

MODELS = '''
import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers import SCALE  # a sibling module: the file's folder is on sys.path while it loads


class Net(nn.Module):
    def __init__(self, in_channels=3, out_channels=4, kernel_size=3, divisor=2.0):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.bias = nn.Parameter(torch.randn(out_channels, 1, 1))
        self.divisor = divisor

    def forward(self, x):
        x = torch.relu(self.conv(x)) / self.divisor
        return x + self.bias * SCALE


class TwoStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3)
        self.b = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        return F.gelu(self.b(torch.tanh(self.a(x)))).mean(dim=[2, 3])


class Plain(nn.Module):
    def forward(self, x):
        return torch.relu(x)


class Broken(nn.Module):
    def __init__(self):
        raise RuntimeError("cannot build")


def make_net():
    return Net(3, 6)


instance = Net()
'''

KERNELBENCH = '''
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size, pool_kernel_size):
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size)
        self.avg_pool = nn.AvgPool2d(pool_kernel_size)

    def forward(self, x):
        x = self.conv(x)
        x = self.avg_pool(x)
        x = torch.sigmoid(x)
        return torch.sum(x, dim=[1, 2, 3])


batch_size = 16


def get_inputs():
    return [torch.randn(batch_size, 3, 20, 20)]


def get_init_inputs():
    return [3, 8, 3, 2]
'''


@pytest.fixture
def models(tmp_path):
    (tmp_path / "helpers.py").write_text("SCALE = 0.5\n")
    (tmp_path / "models.py").write_text(MODELS)
    (tmp_path / "kb.py").write_text(KERNELBENCH)
    (tmp_path / "raises.py").write_text("raise SystemExit('no')\n")
    (tmp_path / "syntax.py").write_text("def broken(:\n")
    return tmp_path


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="specgen")
    importcli.register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.run(args)


def test_writes_yaml_that_loads_back(models, capsys):
    out = models / "net.yaml"
    code = _cli("import", f"{models}/models.py:Net", "--input-shape", "2,3,8,8", "-o", str(out))
    assert code == 0
    (spec,) = load_specs(out)
    assert spec.name == "net_conv"
    assert [s.op for s in spec.epilogue] == ["relu", "div", "expr"]
    assert spec.input.size == [8, 8] and spec.conv.out_channels == 4
    err = capsys.readouterr().err
    assert "1 spec(s) (net_conv) written to" in err


def test_stdout_and_constructor_arguments(models, capsys):
    code = _cli("import", f"{models}/models.py:Net", "--input-shape", "1,5,6,6", "--args", "[5]", "--kwargs", '{"out_channels": 7}')
    assert code == 0
    text = capsys.readouterr().out
    assert text.startswith("# specgen import")
    (spec,) = parse_yaml(text)
    assert spec.input.channels == 5 and spec.conv.out_channels == 7


def test_several_specs_become_a_list(models, capsys):
    assert _cli("import", f"{models}/models.py:TwoStage", "--input-shape", "1,3,9,9") == 0
    specs = parse_yaml(capsys.readouterr().out)
    assert [s.name for s in specs] == ["twostage_a", "twostage_b"]


def test_factories_and_instances(models, capsys):
    assert _cli("import", f"{models}/models.py:make_net", "--input-shape", "1,3,8,8") == 0
    assert parse_yaml(capsys.readouterr().out)[0].conv.out_channels == 6
    assert _cli("import", f"{models}/models.py:instance", "--input-shape", "1,3,8,8") == 0
    assert _cli("import", f"{models}/models.py:instance", "--input-shape", "1,3,8,8", "--args", "[1]") == 2


def test_kernelbench_files_need_no_flags(models, capsys):
    assert _cli("import", f"{models}/kb.py:Model") == 0
    (spec,) = parse_yaml(capsys.readouterr().out)
    assert [s.op for s in spec.epilogue] == ["avg_pool", "sigmoid", "sum"]
    assert spec.input.channels == 3 and spec.input.size == [20, 20] and spec.conv.out_channels == 8


def test_the_yaml_matches_explain(models, capsys):
    assert _cli("import", f"{models}/kb.py:Model", "--input-shape", "2,3,20,20", "--args", "[3, 8, 3, 2]") == 0
    (spec,) = parse_yaml(capsys.readouterr().out)
    import importlib.util

    module_spec = importlib.util.spec_from_file_location("kb_for_test", models / "kb.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    (expected,) = explain(module.Model(3, 8, 3, 2).eval(), torch.randn(2, 3, 20, 20)).specs
    assert spec.canonical() == expected.canonical()


def test_nothing_to_fuse_exits_1(models, capsys):
    assert _cli("import", f"{models}/models.py:Plain", "--input-shape", "1,3,8,8") == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "nothing in Plain can be fused" in captured.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{d}/models.py"], "expected FILE.py:NAME"),
        (["{d}/missing.py:Net"], "no such file"),
        (["{d}/models.py:Nope", "--input-shape", "1,3,8,8"], "has no 'Nope'; nn.Module classes in it: Broken, Net, Plain, TwoStage"),
        (["{d}/models.py:Net", "--input-shape", "1,3,8,8", "--args", "[3,"], "--args: not valid JSON"),
        (["{d}/models.py:Net", "--input-shape", "1,3,8,8", "--args", '{"a": 1}'], "--args: expected a list"),
        (["{d}/models.py:Net", "--input-shape", "1,3,8,8", "--kwargs", "[1]"], "--kwargs: expected an object"),
        (["{d}/models.py:Net", "--input-shape", "1,3,8,8", "--kwargs", '{"nope": 1}'], "unexpected keyword argument"),
        (["{d}/models.py:Broken", "--input-shape", "1,3,8,8"], "RuntimeError: cannot build"),
        (["{d}/models.py:Net", "--input-shape", "1,x,8"], "--input-shape: expected comma-separated positive ints"),
        (["{d}/models.py:Net", "--input-shape", "1,3,0,8"], "--input-shape: expected comma-separated positive ints"),
        (["{d}/models.py:Net", "--input-shape", "1,5,8,8"], "Net fails on the example inputs"),
        (["{d}/models.py:Net"], "give --input-shape"),
        (["{d}/raises.py:Net", "--input-shape", "1,3,8,8"], "importing it failed: SystemExit: no"),
        (["{d}/syntax.py:Net", "--input-shape", "1,3,8,8"], "importing it failed: SyntaxError"),
        (["{d}/models.py:SCALE", "--input-shape", "1,3,8,8"], "SCALE is a float, not an nn.Module"),
    ],
)
def test_bad_input_exits_2_with_a_message(models, capsys, argv, message):
    argv = [a.replace("{d}", str(models)) for a in argv]
    assert _cli("import", *argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("specgen import: ")
    assert message in captured.err
    assert "Traceback" not in captured.err


def test_unwritable_output_exits_2(models, capsys):
    target = models / "no-such-dir" / "out.yaml"
    assert _cli("import", f"{models}/kb.py:Model", "-o", str(target)) == 2
    assert "cannot write" in capsys.readouterr().err


def test_help_mentions_the_arguments(capsys):
    with pytest.raises(SystemExit):
        _cli("import", "--help")
    text = capsys.readouterr().out
    for flag in ("--input-shape", "--args", "--kwargs", "--train", "-o"):
        assert flag in text
    assert "exit codes" in text

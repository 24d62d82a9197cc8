"""`specgen import FILE.py:Model`: find the fusable conv chains of a PyTorch model, write their specs.

    specgen import models.py:MyModel --input-shape 1,8,16,64,64 [--args '[8, 64]'] [--kwargs '{"k": 3}'] [-o out.yaml]

FILE.py is imported as a module (its directory first on sys.path, so its own imports work);
`Model` is an nn.Module class, a function returning a module, or a module instance in the file.
The constructor arguments come from `--args` (a JSON list) and `--kwargs` (a JSON object), or,
without `--args`, from the file's `get_init_inputs()` when it has one (the KernelBench
convention). Example inputs are random float32 tensors of each `--input-shape` (batch first;
repeat the flag for a model with several inputs), or else the file's `get_inputs()` with every
tensor's batch cut to 1. The model is examined in eval mode unless `--train` is given.

The YAML (one spec, or a list) goes to `-o FILE` or stdout, headed by comments naming the
nodes that run as PyTorch and why; a summary goes to stderr. Exit codes: 0 specs written,
1 nothing in the model can be fused, 2 bad input (a clear message, never a traceback).

`register(subparsers)` adds the command to an argparse subparsers object; the handler is
stored as `run` (like the rest of the CLI) and returns the exit code.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
from pathlib import Path


class _BadInput(Exception):
    """A problem with what the user gave; the message is printed as is."""


def _fail(message: str) -> int:
    print(f"specgen import: {message}", file=sys.stderr)
    return 2


def _error_text(err: BaseException) -> str:
    first = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {first}" if first else type(err).__name__


def _parse_target(target: str) -> tuple[Path, str]:
    path, sep, name = target.rpartition(":")
    if not sep or not path or not name:
        raise _BadInput(f"expected FILE.py:NAME (e.g. models.py:MyModel), got {target!r}")
    if not name.isidentifier():
        raise _BadInput(f"{name!r} is not a Python name (expected FILE.py:NAME)")
    file = Path(path)
    if not file.is_file():
        raise _BadInput(f"{file}: no such file")
    return file, name


def _load_module(file: Path):
    """Import FILE.py under a private name, with its directory on sys.path while it runs."""
    resolved = file.resolve()
    unique = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(f"_specgen_import_{resolved.stem}_{unique}", resolved)
    if spec is None or spec.loader is None:
        raise _BadInput(f"{file}: cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    folder = str(resolved.parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException as err:  # noqa: BLE001  (whatever the user's file raises, SystemExit included)
        if isinstance(err, KeyboardInterrupt):
            raise
        raise _BadInput(f"{file}: importing it failed: {_error_text(err)}") from None
    finally:
        try:
            sys.path.remove(folder)
        except ValueError:
            pass
    return module


def _json_arg(text: str | None, flag: str, kind: type):
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise _BadInput(f"{flag}: not valid JSON ({err.msg} at column {err.colno}): {text!r}") from None
    if not isinstance(value, kind):
        want = "a list, e.g. '[8, 64, 3]'" if kind is list else "an object, e.g. '{\"kernel_size\": 3}'"
        raise _BadInput(f"{flag}: expected {want}, got {type(value).__name__}")
    return value


def _call_user(fn, what: str, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except BaseException as err:  # noqa: BLE001
        if isinstance(err, KeyboardInterrupt):
            raise
        raise _BadInput(f"{what} failed: {_error_text(err)}") from None


def _build_model(module, name: str, args: argparse.Namespace, file: Path):
    import torch.nn as nn

    if not hasattr(module, name):
        found = sorted(
            k
            for k, v in vars(module).items()
            if isinstance(v, type) and issubclass(v, nn.Module) and v.__module__ == module.__name__
        )
        hint = f"; nn.Module classes in it: {', '.join(found)}" if found else ""
        raise _BadInput(f"{file} has no {name!r}{hint}")
    obj = getattr(module, name)
    ctor_args = _json_arg(args.args, "--args", list)
    ctor_kwargs = _json_arg(args.kwargs, "--kwargs", dict) or {}
    if isinstance(obj, nn.Module):
        if ctor_args or ctor_kwargs:
            raise _BadInput(f"{name} is already a module instance; --args/--kwargs do not apply")
        model = obj
    elif callable(obj):
        if ctor_args is None:
            init = getattr(module, "get_init_inputs", None)
            ctor_args = list(_call_user(init, "get_init_inputs()")) if callable(init) else []
        model = _call_user(obj, f"{name}(*{ctor_args!r}, **{ctor_kwargs!r})", *ctor_args, **ctor_kwargs)
        if not isinstance(model, nn.Module):
            raise _BadInput(f"{name}(...) returned a {type(model).__name__}, not an nn.Module")
    else:
        raise _BadInput(f"{name} is a {type(obj).__name__}, not an nn.Module class, factory or instance")
    return model.train(args.train)


def _parse_shape(text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.split(",")]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise _BadInput(f"--input-shape: expected comma-separated positive ints like 1,8,64,64, got {text!r}") from None
    if not shape or any(s <= 0 for s in shape):
        raise _BadInput(f"--input-shape: expected comma-separated positive ints like 1,8,64,64, got {text!r}")
    return shape


def _example_inputs(module, args: argparse.Namespace) -> list:
    import torch

    if args.input_shape:
        generator = torch.Generator().manual_seed(0)
        return [torch.randn(_parse_shape(s), generator=generator) for s in args.input_shape]
    get_inputs = getattr(module, "get_inputs", None)
    if not callable(get_inputs):
        raise _BadInput("give --input-shape (batch first, e.g. --input-shape 1,8,64,64); the file has no get_inputs()")
    inputs = _call_user(get_inputs, "get_inputs()")
    if not isinstance(inputs, (list, tuple)):
        raise _BadInput(f"get_inputs() returned a {type(inputs).__name__}, not a list of inputs")
    return [x[:1] if isinstance(x, torch.Tensor) and x.dim() >= 1 else x for x in inputs]


def _header(target: str, report) -> str:
    lines = [f"# specgen import {target}: {len(report.specs)} fused layer(s)"]
    if report.fallbacks:
        lines.append(f"# {len(report.fallbacks)} node(s) run as PyTorch:")
        lines.extend(f"#   {fb.node}: {fb.reason}" for fb in report.fallbacks)
    return "\n".join(lines) + "\n"


def _run(args: argparse.Namespace) -> int:
    try:
        file, name = _parse_target(args.target)
        module = _load_module(file)
        model = _build_model(module, name, args, file)
        inputs = _example_inputs(module, args)
        from specgen.importer import ModelImportError, explain

        try:
            report = explain(model, *inputs)
        except ModelImportError as err:
            raise _BadInput(str(err)) from None
    except _BadInput as err:
        return _fail(str(err))

    for fb in report.fallbacks:
        print(f"specgen import: not fused: {fb.node}: {fb.reason}", file=sys.stderr)
    if not report.specs:
        print(f"specgen import: nothing in {report.model} can be fused; no YAML written", file=sys.stderr)
        return 1
    text = _header(args.target, report) + report.yaml()
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as err:
            return _fail(f"cannot write {args.output}: {err.strerror or err}")
        where = args.output
    else:
        sys.stdout.write(text)
        where = "stdout"
    names = ", ".join(spec.name for spec in report.specs)
    print(f"specgen import: {len(report.specs)} spec(s) ({names}) written to {where}", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `import FILE.py:MODEL` to `subparsers`; returns its parser."""
    parser = subparsers.add_parser(
        "import",
        help="find the fusable conv chains of a PyTorch model and write their specs as YAML",
        description=(
            "Trace a PyTorch model (torch.fx) on example inputs, find conv -> pointwise/pool/reduction "
            "chains and write one spec per chain. Nodes that cannot be fused are listed with the reason."
        ),
        epilog="exit codes: 0 specs written, 1 nothing to fuse, 2 bad input",
    )
    parser.add_argument("target", metavar="FILE.py:MODEL", help="the file and the nn.Module class (or factory) in it")
    parser.add_argument(
        "--input-shape",
        action="append",
        metavar="N,C,...",
        help="shape of an example input, batch first (repeat for several inputs); "
        "default: the file's get_inputs(), batch cut to 1",
    )
    parser.add_argument(
        "--args", metavar="JSON", help="constructor arguments as a JSON list (default: get_init_inputs() or none)"
    )
    parser.add_argument("--kwargs", metavar="JSON", help="constructor keyword arguments as a JSON object")
    parser.add_argument("--train", action="store_true", help="examine the model in training mode (default: eval mode)")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the YAML here (default: stdout)")
    parser.set_defaults(run=_run)
    return parser

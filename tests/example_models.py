"""examples/models.py loaded as a module of its own (it is not a package the tests install)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path


@functools.cache
def example_models():
    path = Path(__file__).resolve().parent.parent / "examples" / "models.py"
    spec = importlib.util.spec_from_file_location("specgen_example_models_shared", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

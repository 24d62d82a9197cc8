"""specgen: a code-generating CUDA kernel specializer for fused convolution layers.

The build path (spec -> plan -> render -> compile -> cache) never imports torch, so
`import specgen` stays cheap; the PyTorch-facing names load on first use.
"""

__version__ = "0.1.0"

_LAZY = {
    "FusedLayer": ("specgen.module", "FusedLayer"),
    "reference": ("specgen.reference", None),
    "from_module": ("specgen.importer", "from_module"),
    "explain": ("specgen.importer", "explain"),
}

from specgen.spec import LayerSpec, load_specs  # noqa: E402  (no torch)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'specgen' has no attribute {name!r}")
    import importlib

    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


__all__ = ["__version__", "LayerSpec", "load_specs", *_LAZY]

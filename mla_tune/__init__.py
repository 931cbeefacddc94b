"""mla-tune: autotune MLA decode kernels, keep the winners, dispatch to them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mla_tune.problem.shapes import KVFormat, Shape, generate_input, parse_shape

if TYPE_CHECKING:
    from mla_tune.runtime.dispatcher import Dispatcher
    from mla_tune.runtime.wrapper import MLADecodeWrapper

__version__ = "0.1.0"


def _checkout_subpackages() -> None:
    """Run from a checkout without installing it (PYTHONPATH at the repository, as on the
    GPU machine), the repository's kernels/ and configs/ folders are the sub-packages
    mla_tune.kernels and mla_tune.configs, as an install maps them (pyproject.toml)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "kernels" / "__init__.py").is_file():
        __path__.append(str(root))


_checkout_subpackages()

__all__ = ["Dispatcher", "KVFormat", "MLADecodeWrapper", "Shape", "__version__",
           "generate_input", "parse_shape"]

# Loaded on first use, so `import mla_tune` stays cheap for code that never dispatches.
_LAZY = {"Dispatcher": "mla_tune.runtime.dispatcher", "MLADecodeWrapper": "mla_tune.runtime.wrapper"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mla_tune' has no attribute {name!r}")

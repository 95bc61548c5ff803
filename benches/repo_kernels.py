"""Import ``ddtree.kernels`` modules from this checkout, for the GPU benchmark scripts beside this file.

The kernels need only torch and Triton, but ``ddtree/__init__`` imports the Rust extension: where
``ddtree._core`` is not built (a bare checkout on a GPU host), a bare package object stands in for ``ddtree``.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Callable, List

REPO = Path(__file__).resolve().parents[1]


def import_kernels(*names: str, log: Callable[[str], None] = print) -> List[types.ModuleType]:
    """``ddtree.kernels.<name>`` for each name, from this checkout's ``python/`` (not an installed copy)."""
    sys.path.insert(0, str(REPO / "python"))
    try:
        import ddtree  # noqa: F401
    except ImportError as error:
        log(f"note: `import ddtree` failed ({error}); loading ddtree.kernels without the Rust extension")
        package = types.ModuleType("ddtree")
        package.__path__ = [str(REPO / "python" / "ddtree")]
        sys.modules["ddtree"] = package
    return [importlib.import_module(f"ddtree.kernels.{name}") for name in names]

"""Test-only fixes for Triton 3.6's CPU interpreter (TRITON_INTERPRET=1), shared by the kernel tests."""

from __future__ import annotations


def patch_triton_interpreter_for_numpy2() -> None:
    """Interpreter-only fixes for Triton 3.6 to 3.9 (no effect on compiled kernels):

    * scalar tensors (1-element arrays) become Python ints via ``int(array)``, which NumPy 2.4
      rejects for 1-D arrays, so data-dependent loop bounds (``range(0, num_nodes)``) fail;
    * ``tl.dot`` on bf16 operands multiplies their raw uint16 bit patterns (NumPy has no bf16);
      widen them to fp32 first, which is exact and what the tensor cores compute;
    * (Triton 3.9) ``block & scalar`` of int1 operands (``mask & is_tree``, ``is_tree`` a loaded scalar
      compared to 0) is computed on int32 0/1 data, which masked loads and stores reject ("mask has
      unsupported dtype"); hand them boolean masks.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original_patch = interpreter._patch_lang_tensor
    if getattr(original_patch, "_ddtree_patched", False):
        return

    def patched(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._ddtree_patched = True
    interpreter._patch_lang_tensor = patched

    builder = interpreter.InterpreterBuilder
    original_dot = builder.create_dot

    def widened(handle):
        if handle.dtype.scalar == tl.bfloat16 or handle.dtype == tl.bfloat16:
            data = (handle.data.astype(np.uint32) << 16).view(np.float32)
            return interpreter.TensorHandle(data, tl.float32)
        return handle

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original_dot(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot

    def boolean(mask):
        if mask.data.dtype != np.bool_:
            return interpreter.TensorHandle(mask.data != 0, tl.int1)
        return mask

    original_load, original_store = builder.create_masked_load, builder.create_masked_store

    def create_masked_load(self, ptrs, mask, *rest):  # the cache/eviction arguments differ across versions
        return original_load(self, ptrs, boolean(mask), *rest)

    def create_masked_store(self, ptrs, value, mask, *rest):
        return original_store(self, ptrs, value, boolean(mask), *rest)

    builder.create_masked_load = create_masked_load
    builder.create_masked_store = create_masked_store


def child_env(*module_dirs, interpret: bool) -> dict:
    """Environment for a kernel check run in a child process (``TRITON_INTERPRET`` is read once, at import).

    The child must import the ddtree this process imported: the source tree during development, but an
    installed wheel on a GPU host, where ``python/ddtree`` lacks the compiled ``_core``. So that package's
    folder comes first, then ``module_dirs`` (the test helpers), then whatever ``PYTHONPATH`` already held
    (vLLM's packages on the GPU host).
    """
    import importlib.util
    import os
    from pathlib import Path

    spec = importlib.util.find_spec("ddtree")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("ddtree is not importable here: install it (pip install -e .) before the kernel tests")
    package_root = Path(list(spec.submodule_search_locations)[0]).resolve().parent
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(package_root), *map(str, module_dirs), *inherited]))
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def check_in_interpreter(tests_dir, module: str, check: str, timeout: float = 600) -> None:
    """Runs ``module.check('cpu')`` (a test module beside this one) in a child process under Triton's interpreter,
    with :func:`patch_triton_interpreter_for_numpy2` applied; fails with the child's stderr."""
    import subprocess
    import sys

    script = (
        "import _triton_interpreter; _triton_interpreter.patch_triton_interpreter_for_numpy2(); "
        f"import torch; torch.set_num_threads(1); import {module} as t; t.{check}('cpu')"
    )
    env = child_env(tests_dir, interpret=True)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]

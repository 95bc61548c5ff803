"""The `.pyi` stubs of the extension module match what it exports at runtime."""

from __future__ import annotations

import subprocess
import sys


def test_stubtest_finds_no_mismatch():
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "ddtree._core"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr

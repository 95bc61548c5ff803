"""Crash fuzzing of the Python API: a child process runs hypothesis over malformed input
(``_api_fuzz_child.py``); it must end normally, not by a signal or an undocumented exception."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("hypothesis")

CHILD = Path(__file__).with_name("_api_fuzz_child.py")


def test_no_input_kills_the_process_or_escapes_the_documented_errors(tmp_path):
    last = tmp_path / "last_call.txt"
    result = subprocess.run([sys.executable, str(CHILD), "400", str(last)], capture_output=True, text=True, timeout=600)
    if result.returncode < 0:
        pytest.fail(
            f"the API killed the process with {signal.Signals(-result.returncode).name} in "
            f"{last.read_text() if last.exists() else '?'}"
        )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "every call returned or raised a documented error" in result.stdout

"""Test modules need distinct file names: pytest imports them by basename (rootdir-relative
"prepend" mode, no __init__.py in test folders), so a second `test_x.py` in another folder
fails collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def test_test_module_names_are_unique():
    tests = Path(__file__).parent
    names = Counter(p.name for p in tests.rglob("*.py") if p.name != "conftest.py")
    assert [n for n, c in names.items() if c > 1] == []

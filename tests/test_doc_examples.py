"""The Python examples of the README and docs/ run as written."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = [(path, block) for path in DOCS for block in re.findall(r"```python\n(.*?)```", path.read_text(), re.S)]


def test_the_docs_have_examples():
    assert any(path.name == "core.md" for path, _ in EXAMPLES)


@pytest.mark.parametrize("path, code", EXAMPLES, ids=[f"{p.name}:{i}" for i, (p, _) in enumerate(EXAMPLES)])
def test_example_runs(path, code):
    exec(compile(code, str(path), "exec"), {})

"""The command-line demo runs end to end and reports what it claims."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ddtree.cli import main


def test_demo_on_synthetic_drafter(capsys):
    assert main(["demo", "--budget", "32", "--seed", "3", "--show", "5"]) == 0
    out = capsys.readouterr().out
    assert "tree: 32 draft nodes (budget 32)" in out
    assert "... 27 more nodes" in out
    tree_len, chain_len = map(float, re.search(r"distribution\): ([\d.]+); a chain of the same depth: ([\d.]+)", out).groups())
    assert tree_len >= chain_len >= 1.0


def test_demo_reads_a_file(tmp_path, capsys):
    path = tmp_path / "dist.npz"
    log_probs = np.log(np.array([[0.7, 0.2], [0.9, 0.05]], dtype=np.float32))
    np.savez(path, log_probs=log_probs, token_ids=np.array([[3, 4], [5, 6]]))
    assert main(["demo", "--input", str(path), "--budget", "3"]) == 0
    out = capsys.readouterr().out
    assert "tree: 3 draft nodes" in out
    # 1 + 0.7 + 0.63 + 0.2 (the three best prefixes)
    assert "expected acceptance length (accepted + bonus, under the drafter's distribution): 2.530" in out


def test_demo_rejects_a_file_without_arrays(tmp_path):
    path = tmp_path / "bad.npz"
    np.savez(path, something=np.zeros(3))
    with pytest.raises(SystemExit, match="missing arrays"):
        main(["demo", "--input", str(path)])

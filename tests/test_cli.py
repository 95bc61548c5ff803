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
    tree_len, chain_len = map(
        float, re.search(r"distribution\): ([\d.]+); a chain of the same depth: ([\d.]+)", out).groups()
    )
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


def test_demo_rejects_a_file_without_arrays(tmp_path, capsys):
    path = tmp_path / "bad.npz"
    np.savez(path, something=np.zeros(3))
    assert main(["demo", "--input", str(path)]) == 2
    assert "missing arrays ['log_probs', 'token_ids']" in capsys.readouterr().err


def _malformed_inputs(folder):
    np.save(folder / "single.npy", np.zeros(3))
    (folder / "garbage.npz").write_bytes(b"\x00not an archive" * 20)
    np.savez(
        folder / "good.npz", log_probs=np.log(np.full((3, 4), 0.25, np.float32)), token_ids=np.arange(12).reshape(3, 4)
    )
    whole = (folder / "good.npz").read_bytes()
    (folder / "truncated.npz").write_bytes(whole[: len(whole) // 2])
    np.savez(folder / "strings.npz", log_probs=np.array(["a", "b"]), token_ids=np.arange(2))
    return {
        "single.npy": "not an .npz archive",
        "garbage.npz": "cannot read it as an .npz archive",
        "truncated.npz": "cannot read it as an .npz archive",
        "strings.npz": "log_probs must hold floats",
        "absent.npz": "No such file",
    }


def test_every_malformed_input_file_gets_one_line(tmp_path, capsys):
    for name, words in _malformed_inputs(tmp_path).items():
        assert main(["demo", "--input", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("ddtree demo: ") and words in err and "\n" not in err, (name, err)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--window", "1000000000"], "window: must be at most 64"),
        (["--budget", "100000000"], "budget: must be at most 65536"),
        (["--budget", str(2**63)], "does not fit in a 64-bit integer"),
        (["--start", str(2**63 - 1)], "start + depth overflows"),
        (["--depth", "1000000000"], "--depth x --vocab must be at most"),
        (["--vocab", "-3"], "--vocab must be >= 0"),
    ],
)
def test_absurd_demo_sizes_get_one_line(capsys, argv, words):
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err, err


def test_demo_serves_every_input_the_core_accepts(tmp_path, capsys):
    """No candidates (K = 0) and all -inf rows are legal for the core; the demo runs them through."""
    np.savez(tmp_path / "k0.npz", log_probs=np.zeros((3, 0), np.float32), token_ids=np.zeros((3, 0), np.int64))
    np.savez(
        tmp_path / "inf.npz", log_probs=np.full((3, 4), -np.inf, np.float32), token_ids=np.arange(12).reshape(3, 4)
    )
    for name in ("k0.npz", "inf.npz"):
        assert main(["demo", "--input", str(tmp_path / name)]) == 0
        assert "accepted 0 draft tokens" in capsys.readouterr().out

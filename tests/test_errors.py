"""Bad input raises an error that names the argument and what was expected."""

from __future__ import annotations

import numpy as np
import pytest

import ddtree

LP = np.log(np.array([[0.6, 0.3, 0.1], [0.5, 0.4, 0.1]], dtype=np.float32))
IDS = np.array([[5, 6, 7], [8, 9, 10]], dtype=np.int64)


@pytest.mark.parametrize(
    "log_probs, token_ids, budget, error, words",
    [
        (LP[0], IDS, 4, ValueError, ["log_probs", "[L, K]", "[3]"]),
        (LP, IDS[:, :2], 4, ValueError, ["token_ids", "[2, 3]", "[2, 2]"]),
        (LP.astype(np.float64), IDS, 4, TypeError, ["log_probs", "float32", "float64"]),
        (LP, IDS.astype(np.float32), 4, TypeError, ["token_ids", "int32 or int64"]),
        (LP.tolist(), IDS, 4, TypeError, ["log_probs", "numpy.ndarray", "list"]),
        (LP, IDS, -1, ValueError, ["budget", ">= 0", "-1"]),
        (LP, IDS, 2.5, TypeError, ["budget", "int", "float"]),
        (
            np.where(np.eye(2, 3, dtype=bool), np.nan, LP).astype(np.float32),
            IDS,
            4,
            ValueError,
            ["log_probs[0, 0]", "NaN"],
        ),
        (LP[:, ::-1].copy(), IDS, 4, ValueError, ["row 0", "non-increasing"]),
        (LP + 1, IDS, 4, ValueError, ["log_probs[0, 0]", "positive"]),
        (LP, np.array([[5, 6, 5], [8, 9, 10]]), 8, ValueError, ["token_ids", "row 0", "token 5", "ranks 0 and 2"]),
        (LP, np.array([[5, 6, 7], [8, -9, 10]]), 4, ValueError, ["token_ids[1, 1]", "negative"]),
    ],
)
def test_build_tree_rejects(log_probs, token_ids, budget, error, words):
    with pytest.raises(error) as info:
        ddtree.build_tree(log_probs, token_ids, budget)
    for word in words:
        assert word in str(info.value)


def test_duplicates_are_checked_among_the_candidates_the_tree_reaches():
    """Siblings must differ; candidates no node reaches cannot make the tree wrong,
    and checking whole rows would cost O(L * K), more than building the tree."""
    ids = np.array([[5, 6, 7], [8, 9, 8]])
    # Budget 4 reaches ranks 0-1 of row 1: the duplicate at rank 2 is never a node.
    assert ddtree.build_tree(LP, ids, 4).tokens.tolist() == [5, 8, 6, 9]
    with pytest.raises(ValueError, match="row 1 has token 8 twice"):
        ddtree.build_tree(LP, ids, 12)
    negative = np.array([[5, 6, 7], [8, 9, -1]])
    assert ddtree.build_tree(LP, negative, 4).tokens.tolist() == [5, 8, 6, 9]
    with pytest.raises(ValueError, match=r"token_ids\[1, 2\] = -1 is negative"):
        ddtree.build_tree(LP, negative, 12)


def test_batch_errors_name_the_request():
    lp = np.stack([LP, LP[:, ::-1].copy()])
    ids = np.stack([IDS, IDS])
    with pytest.raises(ValueError, match="request 1: row 0 is not sorted"):
        ddtree.build_trees(lp, ids, 4)
    with pytest.raises(ValueError, match=r"budgets: expected shape an int or \[2\]"):
        ddtree.build_trees(np.stack([LP, LP]), ids, [1, 2, 3])
    with pytest.raises(ValueError, match="budgets: must be >= 0"):
        ddtree.build_trees(np.stack([LP, LP]), ids, [1, -2])
    with pytest.raises(ValueError, match=r"log_probs: expected shape \[R, L, K\]"):
        ddtree.build_trees(LP, IDS, 4)


def test_accept_checks_target_length_and_dtype():
    tree = ddtree.build_tree(LP, IDS, 4)
    with pytest.raises(ValueError, match=r"target_tokens: expected shape \[5\]"):
        ddtree.accept(tree, np.zeros(4, dtype=np.int64))
    with pytest.raises(TypeError, match="target_tokens: expected int32 or int64"):
        ddtree.accept(tree, np.zeros(5, dtype=np.float64))
    batch = ddtree.build_trees(np.stack([LP, LP]), np.stack([IDS, IDS]), [1, 2])
    with pytest.raises(ValueError, match=r"target_tokens: expected shape \[5\]"):
        ddtree.accept_trees(batch, np.zeros(6, dtype=np.int64))


def test_compile_and_plan_arguments():
    tree = ddtree.build_tree(LP, IDS, 4)
    with pytest.raises(ValueError, match="window: must be >= 0"):
        ddtree.compile_tree(tree, 0, -1)
    batch = ddtree.build_trees(np.stack([LP, LP]), np.stack([IDS, IDS]), 2)
    with pytest.raises(ValueError, match=r"starts: expected shape an int or \[2\]"):
        ddtree.compile_trees(batch, [1, 2, 3])
    with pytest.raises(ValueError, match="path: must start with the root"):
        ddtree.kv_move_plan(np.array([1, 2], dtype=np.int32))
    with pytest.raises(ValueError, match="path: node indices must be strictly increasing"):
        ddtree.kv_move_plan(np.array([0, 2, 2], dtype=np.int32))
    with pytest.raises(ValueError, match="num_threads: must be at least 1"):
        ddtree.Executor(0)


# ---- documented limits: absurd sizes are refused, never attempted (an allocation failure aborts the process)
L15 = np.tile(-np.arange(1, 65, dtype=np.float32)[None, :], (15, 1))
IDS15 = np.tile(np.arange(64, dtype=np.int64)[None, :], (15, 1))
ABSURD_CALLS = {
    "budget": (
        "ddtree.build_tree(L15, IDS15, 10**9)",
        ValueError,
        ["budget", f"at most {ddtree.MAX_BUDGET}", "1000000000"],
    ),
    "budgets": (
        "ddtree.build_trees(L15[None], IDS15[None], 10**9)",
        ValueError,
        ["budgets", f"at most {ddtree.MAX_BUDGET}", "1000000000"],
    ),
    "budget 2**63": ("ddtree.build_tree(L15, IDS15, 2**63)", ValueError, ["budget", "9223372036854775808", "64-bit"]),
    "budgets 2**63": ("ddtree.build_trees(L15[None], IDS15[None], 2**63)", ValueError, ["budgets", "64-bit"]),
    "window": (
        "ddtree.compile_tree(ddtree.build_tree(L15, IDS15, 8), 0, 10**9)",
        ValueError,
        ["window", f"at most {ddtree.MAX_WINDOW}", "1000000000"],
    ),
    "batch window": (
        "ddtree.compile_trees(ddtree.build_trees(L15[None], IDS15[None], 8), 0, 10**9)",
        ValueError,
        ["window", f"at most {ddtree.MAX_WINDOW}"],
    ),
    "start overflow": (
        "ddtree.compile_tree(ddtree.build_tree(L15, IDS15, 8), 2**63 - 1, 3)",
        ValueError,
        ["start", "overflows", "9223372036854775807"],
    ),
    "starts overflow": (
        "ddtree.compile_trees(ddtree.build_trees(L15[None], IDS15[None], 8), 2**63 - 1, 3)",
        ValueError,
        ["start", "overflows"],
    ),
    "starts 2**63": (
        "ddtree.compile_trees(ddtree.build_trees(L15[None], IDS15[None], 8), 2**63, 3)",
        ValueError,
        ["starts", "64-bit"],
    ),
    "threads": ("ddtree.Executor(100000)", ValueError, ["num_threads", f"at most {ddtree.MAX_THREADS}", "100000"]),
    "batch nodes": (
        "ddtree.build_trees(np.repeat(L15[None], 300, 0), np.repeat(IDS15[None], 300, 0), 60000)",
        ValueError,
        ["tree nodes", f"at most {ddtree.MAX_BATCH_NODES}"],
    ),
    "dense mask": (
        "ddtree.compile_tree(ddtree.build_tree(L15, IDS15, 9000)).dense_mask()",
        ValueError,
        ["dense mask", f"at most {ddtree.MAX_DENSE_NODES}", "9001"],
    ),
}


@pytest.mark.parametrize("name", sorted(ABSURD_CALLS))
def test_absurd_sizes_raise_a_documented_limit(name):
    call, error, words = ABSURD_CALLS[name]
    with pytest.raises(error) as info:
        eval(call)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_the_limits_are_reachable():
    """At the limits themselves the calls succeed (the limits refuse only what is past them)."""
    tree = ddtree.build_tree(L15, IDS15, 4096)
    assert (
        len(tree) == 4097 and ddtree.compile_tree(tree, 2**63 - 1 - 15, ddtree.MAX_WINDOW).positions.max() <= 2**63 - 1
    )
    assert ddtree.Executor(ddtree.MAX_THREADS).num_threads == ddtree.MAX_THREADS
    small = ddtree.compile_tree(ddtree.build_tree(L15, IDS15, 100))
    assert small.dense_mask().shape == (101, 101)


def test_no_absurd_size_kills_the_process():
    """Every call above in a child process: it must exit normally (a signal such as SIGABRT fails this)."""
    import subprocess
    import sys

    script = "\n".join(
        [
            "import numpy as np, ddtree",
            "L15 = np.tile(-np.arange(1, 65, dtype=np.float32)[None, :], (15, 1))",
            "IDS15 = np.tile(np.arange(64, dtype=np.int64)[None, :], (15, 1))",
        ]
        + [
            f"try:\n    {call}\nexcept (ValueError, TypeError, MemoryError):\n    pass"
            for call, _, _ in ABSURD_CALLS.values()
        ]
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])


def test_the_package_exceptions_share_one_base_and_keep_their_builtin_class():
    from ddtree.cli import DemoInputError
    from ddtree.engine.target import UnsupportedModelError
    from ddtree.engine.validation import EngineInputError

    for error, builtin in (
        (DemoInputError, ValueError),
        (UnsupportedModelError, ValueError),
        (EngineInputError, ValueError),
    ):
        assert issubclass(error, ddtree.DDTreeError) and issubclass(error, builtin)
    pytest.importorskip("vllm")
    from ddtree.vllm.config import DDTreeConfigError
    from ddtree.vllm.patches import UnsupportedVLLMVersion
    from ddtree.vllm.step import DraftMismatchError

    for error, builtin in (
        (DDTreeConfigError, ValueError),
        (UnsupportedVLLMVersion, RuntimeError),
        (DraftMismatchError, RuntimeError),
    ):
        assert issubclass(error, ddtree.DDTreeError) and issubclass(error, builtin)

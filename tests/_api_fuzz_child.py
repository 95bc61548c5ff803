"""The Python API under random, often malformed input (run in a child process by test_api_fuzz.py).

Every call must return or raise one of the documented exception types (ValueError, TypeError; MemoryError for
an allocation the machine refuses). A RuntimeError is ddtree's own bug and fails the run; a signal (an abort)
kills this process, and the parent then reports the example this process was running, which it writes to
``argv[2]`` before each call.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ddtree

DOCUMENTED = (ValueError, TypeError, MemoryError)
LOG = sys.argv[2] if len(sys.argv) > 2 else None

FLOAT_DTYPES = [np.float32, np.float32, np.float32, np.float64, np.float16, np.dtype(">f4"), np.int32]
INT_DTYPES = [np.int64, np.int64, np.int32, np.uint8, np.dtype(">i8"), np.float32, np.bool_]
SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, 1e30, -1e30, 1e-45]
SIZES = st.one_of(
    st.integers(-3, 40),
    st.sampled_from([2**31, 2**62, 2**63 - 1, 2**63, 2**70, -(2**63)]),
    st.sampled_from([1.5, None, "8", [4]]),
)


@st.composite
def distributions(draw, batched: bool):
    requests = draw(st.integers(0, 3))
    depth, width = draw(st.integers(0, 5)), draw(st.integers(0, 6))
    shape = (requests, depth, width) if batched else (depth, width)
    if draw(st.booleans()):  # well-formed half the time, so the calls after the build run too
        n = int(np.prod(shape))
        magnitudes = np.array(draw(st.lists(st.floats(0, 30, width=32), min_size=n, max_size=n)), np.float32)
        log_probs = -np.sort(magnitudes.reshape(shape), axis=-1)  # non-increasing rows of log-probabilities
        ids = np.argsort(np.random.default_rng(n).random(shape), axis=-1).astype(np.int64)  # distinct per row
        return np.ascontiguousarray(log_probs, np.float32), ids
    values = draw(
        st.lists(
            st.one_of(st.floats(-20, 0, width=32), st.sampled_from(SPECIAL)),
            min_size=int(np.prod(shape)),
            max_size=int(np.prod(shape)),
        )
    )
    log_probs = np.array(values, dtype=np.float64).reshape(shape)
    if draw(st.booleans()):
        log_probs = -np.sort(-log_probs, axis=-1)  # rows non-increasing, as a drafter's top-K is
    ids = np.array(
        draw(
            st.lists(
                st.one_of(st.integers(0, 12), st.integers(-(2**63), 2**63 - 1)),
                min_size=int(np.prod(shape)),
                max_size=int(np.prod(shape)),
            )
        ),
        dtype=np.int64,
    )
    ids = ids.reshape(shape)
    log_probs = log_probs.astype(draw(st.sampled_from(FLOAT_DTYPES)))
    ids = ids.astype(draw(st.sampled_from(INT_DTYPES)))
    layout = draw(st.sampled_from(["plain", "strided", "transposed", "fortran", "extra-dim", "list"]))
    if layout == "strided":
        log_probs, ids = np.repeat(log_probs, 2, axis=-1)[..., ::2], np.repeat(ids, 2, axis=-1)[..., ::2]
    elif layout == "transposed":
        log_probs, ids = np.swapaxes(log_probs, -1, -2), np.swapaxes(ids, -1, -2)
    elif layout == "fortran":
        log_probs, ids = np.asfortranarray(log_probs), np.asfortranarray(ids)
    elif layout == "extra-dim":
        log_probs, ids = log_probs[None], ids[None]
    elif layout == "list":
        log_probs = log_probs.tolist()
    return log_probs, ids


def guarded(label, call, *args):
    if LOG:
        with open(LOG, "w") as f:
            f.write(f"{label}{tuple(repr(a)[:300] for a in args)}\n")
    try:
        return call(*args)
    except DOCUMENTED:
        return None


def targets(draw_list, n):
    return np.array(draw_list[:n] if draw_list else [], dtype=np.int64)


MOSTLY_VALID = st.one_of(st.integers(0, 40), st.integers(0, 5), SIZES)


@settings(
    max_examples=int(sys.argv[1]) if len(sys.argv) > 1 else 300,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(
    single=distributions(False),
    batch=distributions(True),
    budget=MOSTLY_VALID,
    start=MOSTLY_VALID,
    window=MOSTLY_VALID,
    target=st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300),
    threads=SIZES,
)
def run(single, batch, budget, start, window, target, threads):
    tree = guarded("build_tree", ddtree.build_tree, single[0], single[1], budget)
    if tree is not None:
        guarded("compile_tree", ddtree.compile_tree, tree, start, window)
        compiled = guarded("compile_tree", ddtree.compile_tree, tree)
        if compiled is not None:
            guarded("dense_mask", compiled.dense_mask)
        accepted = guarded("accept", ddtree.accept, tree, targets(target, len(tree)))
        guarded("accept", ddtree.accept, tree, np.array(target, dtype=np.int64))
        if accepted is not None:
            guarded("kv_move_plan", ddtree.kv_move_plan, accepted[0])
        guarded("kv_move_plan", ddtree.kv_move_plan, np.array(target[:8], dtype=np.int64).astype(np.int32))
    executor = guarded("Executor", ddtree.Executor, threads)
    trees = guarded("build_trees", ddtree.build_trees, batch[0], batch[1], budget, executor)
    if trees is not None:
        guarded("compile_trees", ddtree.compile_trees, trees, start, window)
        guarded("accept_trees", ddtree.accept_trees, trees, targets(target, len(trees.tokens) + len(trees)))
        accepted = guarded("accept_trees", ddtree.accept_trees, trees, np.array(target, dtype=np.int64))
        lay_out(trees, accepted, start, window, len(target) % 4)


def lay_out(trees, accepted, start, window, sizing):
    """The step layouts with outputs sized right (sizing 0), one too long, empty, or of another dtype."""
    total, requests = len(trees.tokens) + len(trees), len(trees)
    w = window if isinstance(window, int) and 0 <= window <= 70 else 3
    firsts = trees.node_offsets[:-1]

    def out(shape, dtype):
        shape = {0: shape, 1: (shape[0] + 1,) + shape[1:], 2: (0,) + shape[1:], 3: shape}[sizing]
        return np.zeros(shape, dtype=np.float32 if sizing == 3 else dtype)

    verify = dict(
        token_index=out((total,), np.int64),
        logit_rows=out((total,), np.int64),
        positions=out((total,), np.int64),
        ancestor_bits=out((total, 1 + total // 32), np.uint32),
        row_start=out((requests,), np.int32),
        node_offsets=out((requests + 1,), np.int32),
        conv_index=out((total, w + 1), np.int64) if w else None,
    )
    rows = np.arange(requests)
    guarded("verify_layout_into", lambda: ddtree.verify_layout_into(trees, rows, start, firsts, firsts, **verify))
    if accepted is None:
        return
    moves = len(accepted.kv_src)
    after = dict(
        output_tokens=out((requests, accepted.paths.shape[1]), np.int32),
        kv_src=out((moves,), np.int64),
        kv_dst=out((moves,), np.int64),
        context_order=out((total,), np.int64),
        paths=out(tuple(accepted.paths.shape), np.int32),
        path_lengths=out((requests,), np.int32),
        commit_conv_index=out((requests, w), np.int64) if w else None,
    )
    guarded("acceptance_layout_into", lambda: ddtree.acceptance_layout_into(trees, accepted, firsts, **after))


if __name__ == "__main__":
    warnings.simplefilter("ignore", RuntimeWarning)  # numpy's casts of the malformed inputs
    run()
    print("fuzz: every call returned or raised a documented error")

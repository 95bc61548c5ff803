"""Hypothesis strategies for the tests of the Rust core against ddtree.reference.

(A module of its own with a unique name: every test folder has a conftest.py,
so `from conftest import ...` would pick whichever was imported first.)
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

# Few distinct values so that score ties (and -inf) are common.
_LOG_PROB = st.one_of(
    st.sampled_from([0.0, -0.5, -1.0, -1.5, -2.0, -float("inf")]),
    st.floats(min_value=-8.0, max_value=0.0, width=32),
)


@st.composite
def distributions(draw, max_depth: int = 5, max_width: int = 5, dtype=np.int64):
    """(log_probs float32 [L, K] rows non-increasing, token_ids [L, K] distinct per row)."""
    depth = draw(st.integers(0, max_depth))
    width = draw(st.integers(0, max_width))
    rows = [sorted(draw(st.lists(_LOG_PROB, min_size=width, max_size=width)), reverse=True) for _ in range(depth)]
    log_probs = np.array(rows, dtype=np.float32).reshape(depth, width)
    ids = [draw(st.permutations(range(3 * width)))[:width] for _ in range(depth)]
    token_ids = np.array(ids, dtype=dtype).reshape(depth, width)
    return log_probs, token_ids


# Log-probs that make the search's pop order differ from a plain sort by score:
# positive values up to the core's tolerance (a child can score above its
# parent), and magnitudes far apart (sums round to equal scores that the
# rank tuples must then order).
_AWKWARD_LOG_PROB = st.one_of(
    st.sampled_from([1e-3, 5e-4, 0.0, -0.0, -1e-30, -1e-8, -0.5, -1e6, -float("inf")]),
    st.floats(min_value=-8.0, max_value=float(np.float32(1e-3)), width=32),
)


@st.composite
def awkward_distributions(draw, max_depth: int = 5, max_width: int = 5):
    """Like distributions(), with _AWKWARD_LOG_PROB values."""
    depth = draw(st.integers(1, max_depth))
    width = draw(st.integers(1, max_width))
    rows = [
        sorted(draw(st.lists(_AWKWARD_LOG_PROB, min_size=width, max_size=width)), reverse=True) for _ in range(depth)
    ]
    log_probs = np.array(rows, dtype=np.float32).reshape(depth, width)
    ids = [draw(st.permutations(range(3 * width)))[:width] for _ in range(depth)]
    return log_probs, np.array(ids, dtype=np.int64).reshape(depth, width)

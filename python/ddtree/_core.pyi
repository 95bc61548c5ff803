"""Type stubs for the Rust extension module (rust/src/python/), with the API reference in their docstrings."""

from typing import Optional, Sequence, Tuple, Union, final

import numpy as np
import numpy.typing as npt

__version__: str

# The documented limits of the inputs (rust/src/limits.rs): past them a call raises ValueError naming the
# argument, the limit and the value, instead of attempting an allocation that cannot succeed.
MAX_BUDGET: int
"""Largest tree budget (draft nodes per tree, root excluded): 65536."""
MAX_BATCH_NODES: int
"""Largest number of nodes in one batch of trees, roots included: 2**24."""
MAX_WINDOW: int
"""Largest conv window of ``compile_tree``/``compile_trees``: 64."""
MAX_THREADS: int
"""Most threads of an ``Executor``: 1024."""
MAX_BIT_WORDS: int
"""Largest ancestor-bit matrix of one compile call, in 32-bit words: 2**28 (1 GiB)."""
MAX_DENSE_NODES: int
"""Largest tree given a dense mask or attention bias: 8192 nodes."""

__all__ = [
    "MAX_BUDGET",
    "MAX_BATCH_NODES",
    "MAX_WINDOW",
    "MAX_THREADS",
    "MAX_BIT_WORDS",
    "MAX_DENSE_NODES",
    "Tree",
    "TreeBatch",
    "CompiledTree",
    "CompiledBatch",
    "AcceptedBatch",
    "Executor",
    "build_tree",
    "build_trees",
    "compile_tree",
    "compile_trees",
    "accept",
    "accept_trees",
    "kv_move_plan",
    "verify_layout_into",
    "acceptance_layout_into",
    "__version__",
]

_Ints = Union[int, Sequence[int], npt.NDArray[np.integer]]
_TokenArray = Union[npt.NDArray[np.int32], npt.NDArray[np.int64]]

@final
class Executor:
    """A thread pool for the batched calls (``build_trees``), created on first use and anew after a fork.

    ``num_threads`` counts the calling thread, which builds trees too (1 <= num_threads <= MAX_THREADS); small
    batches run on the calling thread alone.
    """

    def __new__(cls, num_threads: int) -> Executor: ...
    @property
    def num_threads(self) -> int:
        """Threads that build a batch, the calling thread included."""

@final
class Tree:
    """A draft tree in pop order: node 0 is the root (the last committed token), node ``i``'s parent comes
    before it, and nodes pop in non-increasing prefix probability."""

    @property
    def tokens(self) -> npt.NDArray[np.int64]:
        """int64 ``[n]``: the draft token of nodes ``1..n`` (the root has none): ``tokens[i - 1]`` is node i's."""
    @property
    def parents(self) -> npt.NDArray[np.int32]:
        """int32 ``[n + 1]``: each node's parent (``parents[i] < i``); the root's is -1."""
    @property
    def depths(self) -> npt.NDArray[np.int32]:
        """int32 ``[n + 1]``: each node's depth (root 0, at most the drafter's L)."""
    @property
    def scores(self) -> npt.NDArray[np.float32]:
        """float32 ``[n + 1]``: each node's prefix log-probability under the factorised draft (root 0)."""
    @property
    def num_draft_nodes(self) -> int:
        """n, the draft nodes (root excluded): min(budget, the number of distinct prefixes)."""
    @property
    def max_depth(self) -> int:
        """The deepest node's depth."""
    def expected_acceptance(self) -> float:
        """Expected accepted tokens plus the bonus if the target followed the draft distribution:
        1 + the sum of the draft nodes' prefix probabilities."""
    def __len__(self) -> int:
        """n + 1, the nodes with the root."""

@final
class TreeBatch:
    """The trees of one step in flat (CSR) buffers: request r owns nodes ``node_offsets[r]..node_offsets[r+1]``
    of the root-included arrays and tokens ``token_offsets[r]..token_offsets[r+1]``."""

    @property
    def tokens(self) -> npt.NDArray[np.int64]:
        """int64 ``[sum n_r]``: every tree's draft tokens, request after request (see :attr:`Tree.tokens`)."""
    @property
    def parents(self) -> npt.NDArray[np.int32]:
        """int32 ``[sum (n_r + 1)]``: tree-local parents, -1 for each root."""
    @property
    def depths(self) -> npt.NDArray[np.int32]:
        """int32 ``[sum (n_r + 1)]``: node depths."""
    @property
    def scores(self) -> npt.NDArray[np.float32]:
        """float32 ``[sum (n_r + 1)]``: prefix log-probabilities."""
    @property
    def node_offsets(self) -> npt.NDArray[np.int64]:
        """int64 ``[R + 1]``: each request's first node in the root-included arrays."""
    @property
    def token_offsets(self) -> npt.NDArray[np.int64]:
        """int64 ``[R + 1]``: each request's first token in :attr:`tokens`."""
    @property
    def draft_depth(self) -> int:
        """L, the drafter's positions; no tree is deeper."""
    def expected_acceptance(self) -> npt.NDArray[np.float64]:
        """float64 ``[R]``: :meth:`Tree.expected_acceptance` of every tree."""
    def __len__(self) -> int:
        """R, the requests."""
    def __getitem__(self, request: int, /) -> Tree:
        """Request ``request``'s tree, copied out (negative indices count from the end)."""

@final
class CompiledTree:
    """What a tree-verification forward pass needs of one tree."""

    @property
    def positions(self) -> npt.NDArray[np.int64]:
        """int64 ``[n + 1]``: ``start + depth`` (siblings share a rotary position)."""
    @property
    def ancestor_bits(self) -> npt.NDArray[np.uint32]:
        """uint32 ``[n + 1, words]``, ``words = ceil((n + 1) / 32)``: bit j of row i is set when node j is node i
        or one of its ancestors (what node i attends to within the tree)."""
    @property
    def windows(self) -> npt.NDArray[np.int32]:
        """int32 ``[n + 1, window]``: each node's last ``window`` ancestors, oldest first, as tree-local indices;
        ``-1 .. -window`` name the newest .. oldest committed conv-history entries (hybrid GDN layers)."""
    def dense_mask(self) -> npt.NDArray[np.bool_]:
        """bool ``[n + 1, n + 1]``: ``mask[i, j]`` when node i sees node j (trees of at most MAX_DENSE_NODES)."""
    def attention_bias(self) -> npt.NDArray[np.float32]:
        """float32 ``[n + 1, n + 1]``: 0 where :meth:`dense_mask` is set, -inf elsewhere (an additive bias)."""
    def __len__(self) -> int:
        """n + 1."""

@final
class CompiledBatch:
    """:class:`CompiledTree` for every tree of a batch, in the batch's flat node layout."""

    @property
    def positions(self) -> npt.NDArray[np.int64]:
        """int64 ``[T]``: ``starts[r] + depth`` of every node."""
    @property
    def ancestor_bits(self) -> npt.NDArray[np.uint32]:
        """uint32 ``[T, words]``, tree-local bits; ``words`` fits the largest tree."""
    @property
    def windows(self) -> npt.NDArray[np.int32]:
        """int32 ``[T, window]``: tree-local conv-window ancestors (negative: committed history)."""
    def dense_masks(self) -> npt.NDArray[np.bool_]:
        """bool ``[R, N, N]`` (N: the largest tree): ``masks[r, i, j]`` when node i of request r sees its node j;
        padding is False."""

@final
class AcceptedBatch:
    """The outcome of walking every tree of a batch with the target's tokens."""

    @property
    def paths(self) -> npt.NDArray[np.int32]:
        """int32 ``[R, L + 1]``: each accepted path, tree-local node indices from the root, padded with -1."""
    @property
    def output_tokens(self) -> npt.NDArray[np.int64]:
        """int64 ``[R, L + 1]``: accepted draft tokens then the bonus token, padded with -1 (vLLM's
        ``sampled_token_ids`` rows)."""
    @property
    def accepted(self) -> npt.NDArray[np.int32]:
        """int32 ``[R]``: accepted draft tokens per request (the bonus not counted)."""
    @property
    def bonus(self) -> npt.NDArray[np.int64]:
        """int64 ``[R]``: the target's token at each path's last node."""
    @property
    def kv_src(self) -> npt.NDArray[np.int64]:
        """int64 ``[M]``: batch-flat node indices whose K/V moves ..."""
    @property
    def kv_dst(self) -> npt.NDArray[np.int64]:
        """int64 ``[M]``: ... to these batch-flat indices (accepted node ``path[i]`` to position ``i``; all
        sources are read before any write)."""

def build_tree(log_probs: npt.NDArray[np.float32], token_ids: _TokenArray, budget: int) -> Tree:
    """The tree of the ``budget`` most probable draft prefixes (prefix-closed, optimal for the factorised draft).

    Args:
        log_probs: float32 ``[L, K]``, each row the drafter's top-K log-probabilities at one position, sorted
            non-increasing; values <= 0, ``-inf`` allowed, NaN refused.
        token_ids: int32 or int64 ``[L, K]``, the candidates' token ids: non-negative, distinct within a row
            among the candidates the tree reaches.
        budget: draft nodes, 0 <= budget <= MAX_BUDGET (0, or L = 0 or K = 0: a root-only tree).

    Raises:
        ValueError, TypeError: naming the argument, what was expected and what was given.
    """

def build_trees(
    log_probs: npt.NDArray[np.float32],
    token_ids: _TokenArray,
    budgets: _Ints,
    executor: Optional[Executor] = None,
) -> TreeBatch:
    """Every request's tree in one call: ``log_probs``/``token_ids`` ``[R, L, K]``, ``budgets`` an int or
    ``[R]`` ints (each <= MAX_BUDGET, MAX_BATCH_NODES nodes in all); an ``Executor`` builds large batches on
    several threads. Errors name the first failing request."""

def compile_tree(tree: Tree, start: Optional[int] = None, window: Optional[int] = None) -> CompiledTree:
    """Positions ``start + depth`` (start defaults to 0; overflow is a ValueError), ancestor bits and, with
    ``window`` (a hybrid target's conv width - 1, at most MAX_WINDOW), each node's conv-window ancestors."""

def compile_trees(batch: TreeBatch, starts: Optional[_Ints] = None, window: Optional[int] = None) -> CompiledBatch:
    """:func:`compile_tree` for every tree; ``starts`` an int or ``[R]`` ints (default 0)."""

def accept(tree: Tree, target_tokens: _TokenArray) -> Tuple[npt.NDArray[np.int32], int]:
    """Walks the tree with the target's token at every node (``[n + 1]``: its argmax, or one sample under the
    request's settings): from the root, while the target's token is a child's draft token.

    Returns ``(path, bonus)``: int32 tree-local path from the root, and the target's token at its last node.
    The output is distributed exactly as the target's own sampling (sample-then-walk is lossless).
    """

def accept_trees(batch: TreeBatch, target_tokens: _TokenArray) -> AcceptedBatch:
    """:func:`accept` for every tree, with ``target_tokens`` ``[T]`` in the batch's flat node layout."""

def kv_move_plan(path: npt.NDArray[np.int32]) -> Tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """``(src, dst)``: accepted node ``path[i]`` moves to position ``i`` wherever ``path[i] != i``, so the
    accepted path's K/V ends up in consecutive slots; every source is read before any write."""

def verify_layout_into(
    batch: TreeBatch,
    rows: _Ints,
    starts: _Ints,
    query_starts: _Ints,
    logit_starts: _Ints,
    *,
    token_index: npt.NDArray[np.int64],
    logit_rows: npt.NDArray[np.int64],
    positions: npt.NDArray[np.int64],
    ancestor_bits: Union[npt.NDArray[np.uint32], npt.NDArray[np.int32]],
    row_start: npt.NDArray[np.int32],
    node_offsets: npt.NDArray[np.int32],
    conv_index: Optional[npt.NDArray[np.int64]] = None,
    depths: Optional[npt.NDArray[np.int64]] = None,
    root_index: Optional[npt.NDArray[np.int64]] = None,
    node_parents: Optional[npt.NDArray[np.int64]] = None,
    node_tree: Optional[npt.NDArray[np.int64]] = None,
    node_local: Optional[npt.NDArray[np.int64]] = None,
    node_tokens: Optional[npt.NDArray[np.int64]] = None,
    draft_step_index: Optional[npt.NDArray[np.int64]] = None,
    draft_tokens: Optional[npt.NDArray[np.int32]] = None,
) -> None:
    """One engine step's verification layout of ``batch``, written into the caller's arrays (e.g. views of
    one reused pinned buffer, copied to the GPU in one transfer); every element is written.

    Tree ``r`` is verified as the step's flat query tokens ``query_starts[r] ..`` (root first), reads its
    logits from row ``logit_starts[r] ..``, sits in row ``rows[r]`` of the engine's batch and has its root at
    position ``starts[r]`` (all ``[R]``). Outputs, T = the batch's nodes: ``token_index``, ``logit_rows``,
    ``positions`` (``start + depth``) ``[T]``; ``ancestor_bits`` ``[T, words]`` (any ``words`` enough for the
    largest tree; extra words zeroed); ``row_start`` ``[num_rows]`` (each batch row's first bits row, -1 for
    rows without a tree); ``node_offsets`` ``[R + 1]``; ``conv_index`` ``[T, w + 1]`` for hybrid targets (conv
    window ``w``): rows of ``cat(histories [R*w], tree inputs [T])`` forming each node's window, itself last.

    Optional per-node outputs, each written when given (int64 ``[T]``): ``depths``; ``root_index`` (the step
    index of the node's root, ``query_starts[r]``); ``node_parents`` (the parent as a node of the batch, a root
    itself); ``node_tree``; ``node_local`` (index within its tree); ``node_tokens`` (the draft token, a root 0).
    Per draft node (``[T - R]``, pop order, tree by tree): ``draft_step_index`` (int64, its index among the
    step's tokens) and ``draft_tokens`` (int32), for an engine that scheduled placeholders in their place.

    Raises:
        ValueError: a wrong-sized or shared output (naming it), a row outside ``row_start`` or given twice.
        TypeError: an output of the wrong dtype.
    """

def acceptance_layout_into(
    batch: TreeBatch,
    accepted: AcceptedBatch,
    query_starts: _Ints,
    *,
    output_tokens: npt.NDArray[np.int32],
    kv_src: npt.NDArray[np.int64],
    kv_dst: npt.NDArray[np.int64],
    context_order: npt.NDArray[np.int64],
    paths: npt.NDArray[np.int32],
    path_lengths: npt.NDArray[np.int32],
    commit_conv_index: Optional[npt.NDArray[np.int64]] = None,
) -> None:
    """What follows the acceptance ``accepted`` of ``batch`` (placed as in :func:`verify_layout_into`),
    written into the caller's arrays.

    ``output_tokens`` ``[R, width]``: accepted draft tokens, then the bonus, then -1 (an emitted token past
    ``width`` is a ValueError); ``kv_src``/``kv_dst`` ``[M]`` (``M = len(accepted.kv_src)``): the moves in step
    token indices; ``context_order`` ``[num_tokens]``: the step's tokens with each tree's accepted path first
    (path order) and its other nodes after (node order); ``paths`` ``[R, P]`` 0-padded and ``path_lengths``
    ``[R]``; ``commit_conv_index`` ``[R, w]``: conv rows of each request's new history (its old history
    followed by its accepted path, the last ``w`` entries).
    """

"""Type stubs for the Rust extension module (rust/src/python.rs)."""

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
    "__version__",
]

_Ints = Union[int, Sequence[int], npt.NDArray[np.integer]]
_TokenArray = Union[npt.NDArray[np.int32], npt.NDArray[np.int64]]

@final
class Executor:
    """A thread pool for batched calls, created on first use and anew after fork."""

    def __new__(cls, num_threads: int) -> Executor: ...
    @property
    def num_threads(self) -> int: ...

@final
class Tree:
    @property
    def tokens(self) -> npt.NDArray[np.int64]: ...
    @property
    def parents(self) -> npt.NDArray[np.int32]: ...
    @property
    def depths(self) -> npt.NDArray[np.int32]: ...
    @property
    def scores(self) -> npt.NDArray[np.float32]: ...
    @property
    def num_draft_nodes(self) -> int: ...
    @property
    def max_depth(self) -> int: ...
    def expected_acceptance(self) -> float: ...
    def __len__(self) -> int: ...

@final
class TreeBatch:
    @property
    def tokens(self) -> npt.NDArray[np.int64]: ...
    @property
    def parents(self) -> npt.NDArray[np.int32]: ...
    @property
    def depths(self) -> npt.NDArray[np.int32]: ...
    @property
    def scores(self) -> npt.NDArray[np.float32]: ...
    @property
    def node_offsets(self) -> npt.NDArray[np.int64]: ...
    @property
    def token_offsets(self) -> npt.NDArray[np.int64]: ...
    @property
    def draft_depth(self) -> int: ...
    def expected_acceptance(self) -> npt.NDArray[np.float64]: ...
    def __len__(self) -> int: ...
    def __getitem__(self, request: int, /) -> Tree: ...

@final
class CompiledTree:
    @property
    def positions(self) -> npt.NDArray[np.int64]: ...
    @property
    def ancestor_bits(self) -> npt.NDArray[np.uint32]: ...
    @property
    def windows(self) -> npt.NDArray[np.int32]: ...
    def dense_mask(self) -> npt.NDArray[np.bool_]: ...
    def attention_bias(self) -> npt.NDArray[np.float32]: ...
    def __len__(self) -> int: ...

@final
class CompiledBatch:
    @property
    def positions(self) -> npt.NDArray[np.int64]: ...
    @property
    def ancestor_bits(self) -> npt.NDArray[np.uint32]: ...
    @property
    def windows(self) -> npt.NDArray[np.int32]: ...
    def dense_masks(self) -> npt.NDArray[np.bool_]: ...

@final
class AcceptedBatch:
    @property
    def paths(self) -> npt.NDArray[np.int32]: ...
    @property
    def output_tokens(self) -> npt.NDArray[np.int64]: ...
    @property
    def accepted(self) -> npt.NDArray[np.int32]: ...
    @property
    def bonus(self) -> npt.NDArray[np.int64]: ...
    @property
    def kv_src(self) -> npt.NDArray[np.int64]: ...
    @property
    def kv_dst(self) -> npt.NDArray[np.int64]: ...

def build_tree(log_probs: npt.NDArray[np.float32], token_ids: _TokenArray, budget: int) -> Tree: ...
def build_trees(
    log_probs: npt.NDArray[np.float32],
    token_ids: _TokenArray,
    budgets: _Ints,
    executor: Optional[Executor] = None,
) -> TreeBatch: ...
def compile_tree(tree: Tree, start: Optional[int] = None, window: Optional[int] = None) -> CompiledTree: ...
def compile_trees(batch: TreeBatch, starts: Optional[_Ints] = None, window: Optional[int] = None) -> CompiledBatch: ...
def accept(tree: Tree, target_tokens: _TokenArray) -> Tuple[npt.NDArray[np.int32], int]: ...
def accept_trees(batch: TreeBatch, target_tokens: _TokenArray) -> AcceptedBatch: ...
def kv_move_plan(path: npt.NDArray[np.int32]) -> Tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]: ...

"""Reference DDTree engine on transformers: autoregressive, DFlash-chain and DDTree generation.

    from ddtree.engine import DFlashDraftModel, SpeculativeEngine, GenerationConfig, SamplingSettings
    engine = SpeculativeEngine(target_model, DFlashDraftModel.from_pretrained(drafter_dir))
    results = engine.generate([prompt_ids], GenerationConfig(mode="ddtree", budget=64, max_new_tokens=128))

It runs on CPU with tiny models and is the executable specification the vLLM
integration is checked against; see ``target.py`` for the tree verification
and commit, ``drafter.py`` for the DFlash drafter and its checkpoint format.
"""

from .constraints import GrammarConstraint
from .drafter import DFlashDraftModel, DrafterContext
from .drafting import MODES, DFlashDraftProposer, DraftProposer, draft_tree, draft_tree_with_ranks, empty_tree
from .engine import DepthTrials, GenerationConfig, GenerationResult, RequestStats, SpeculativeEngine, generate
from .sampling import SamplingSettings, processed_probs, target_tokens
from .target import RequestState, TargetModel, TreeForwardOutput, TreeInput, UnsupportedModelError
from .validation import EngineInputError

__all__ = [
    "MODES",
    "DFlashDraftModel",
    "DepthTrials",
    "DFlashDraftProposer",
    "DraftProposer",
    "DrafterContext",
    "EngineInputError",
    "GenerationConfig",
    "GenerationResult",
    "GrammarConstraint",
    "RequestState",
    "RequestStats",
    "SamplingSettings",
    "SpeculativeEngine",
    "TargetModel",
    "TreeForwardOutput",
    "TreeInput",
    "UnsupportedModelError",
    "draft_tree",
    "draft_tree_with_ranks",
    "empty_tree",
    "generate",
    "processed_probs",
    "target_tokens",
]

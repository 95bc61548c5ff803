"""Bad input is refused before any compute, with an error that says what is wrong."""

import pytest

from ddtree.engine import DFlashDraftModel, EngineInputError, GenerationConfig, SpeculativeEngine, TargetModel
from ddtree.engine.tiny import tiny_target, tiny_target_config


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3", max_position_embeddings=32)


@pytest.fixture
def no_compute(monkeypatch):
    """Fail the test if the target runs a forward pass."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the target ran before the input was checked")

    monkeypatch.setattr(TargetModel, "forward_trees", forbidden)


def drafter_for(target, **overrides):
    return DFlashDraftModel.random(target.config, **overrides)


def test_vocab_mismatch(target):
    other = tiny_target_config("qwen3", vocab_size=100)
    with pytest.raises(EngineInputError, match="vocab_size 100 != target vocab size 128"):
        SpeculativeEngine(target, DFlashDraftModel.random(other, mask_token_id=5))


def test_hidden_size_mismatch(target):
    other = tiny_target_config("qwen3", hidden_size=64)
    with pytest.raises(EngineInputError, match="hidden_size 64 != target hidden_size 32"):
        SpeculativeEngine(target, DFlashDraftModel.random(other))


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("layer_ids", [[0, 4], [-1], []])
def test_target_layer_ids_out_of_range(target, layer_ids):
    with pytest.raises(EngineInputError, match=r"target_layer_ids .* \[0, 4\)"):
        SpeculativeEngine(target, drafter_for(target, target_layer_ids=layer_ids))


def test_mask_token_outside_vocabulary(target):
    with pytest.raises(EngineInputError, match="mask_token_id 500"):
        SpeculativeEngine(target, drafter_for(target, mask_token_id=500))


def test_negative_budget(target, no_compute):
    engine = SpeculativeEngine(target, drafter_for(target))
    with pytest.raises(EngineInputError, match="budget must be >= 0"):
        engine.generate([[1, 2]], GenerationConfig(budget=-1))


def test_prompt_longer_than_the_model_allows(target, no_compute):
    engine = SpeculativeEngine(target, drafter_for(target))
    with pytest.raises(EngineInputError, match="prompt 1 has 32 tokens; the target allows 32 positions"):
        engine.generate([[1, 2], [3] * 32], GenerationConfig())


@pytest.mark.parametrize(
    "config, message",
    [
        (GenerationConfig(mode="beam"), "mode must be one of"),
        (GenerationConfig(max_new_tokens=0), "max_new_tokens must be >= 1"),
    ],
)
def test_bad_settings(target, no_compute, config, message):
    with pytest.raises(EngineInputError, match=message):
        SpeculativeEngine(target, drafter_for(target)).generate([[1, 2]], config)


@pytest.mark.parametrize("prompts, message", [([[]], "prompt 0 is empty"), ([[1, 128]], "outside"), ([], "no prompts")])
def test_bad_prompts(target, no_compute, prompts, message):
    with pytest.raises(EngineInputError, match=message):
        SpeculativeEngine(target, drafter_for(target)).generate(prompts, GenerationConfig())


def test_drafting_modes_need_a_drafter(target, no_compute):
    with pytest.raises(EngineInputError, match="needs a drafter"):
        SpeculativeEngine(target).generate([[1, 2]], GenerationConfig(mode="chain"))


def test_bad_sampling_parameters(target, no_compute):
    from ddtree.engine import SamplingSettings

    with pytest.raises(ValueError, match="top_p must be in"):
        SpeculativeEngine(target).generate([[1]], GenerationConfig(mode="ar", sampling=SamplingSettings(1.0, top_p=0)))


def test_generation_stops_at_max_position_embeddings(target):
    results = SpeculativeEngine(target, drafter_for(target, block_size=6)).generate(
        [[1] * 28], GenerationConfig(mode="ddtree", budget=8, max_new_tokens=50)
    )
    assert len(results[0].output_ids) == 4 and results[0].finish_reason == "max_position_embeddings"


def test_old_transformers_is_refused_with_the_reason(monkeypatch):
    import transformers

    from ddtree.engine.target import require_supported_transformers

    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    with pytest.raises(RuntimeError, match=r"needs transformers >= 5\.24, found 5\.17\.0"):
        require_supported_transformers()
    monkeypatch.setattr(transformers, "__version__", "5.24.1")
    require_supported_transformers()

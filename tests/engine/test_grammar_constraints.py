"""Grammars in the reference engine with the trained pair: every tree node masked by the grammar after its root
path gives exactly what decoding one token at a time under the grammar gives (greedy), the trees still accept
several tokens a step, and every output is ended by its grammar and valid under it."""

import json
import os
import re

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
transformers = pytest.importorskip("transformers")

from ddtree.engine import GenerationConfig, SpeculativeEngine  # noqa: E402
from ddtree.engine.constraints import GrammarConstraint, masked_logits  # noqa: E402
from ddtree.engine.drafter import DFlashDraftModel  # noqa: E402
from ddtree.engine.pair_demo import load_pair_prompts  # noqa: E402
from ddtree.engine.validation import EngineInputError  # noqa: E402

PAIR = os.path.join(os.path.dirname(__file__), "..", "fixtures", "models")
REGEX = r"[a-z]{1,8}( [a-z]{1,8}){3,6}\."
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "count": {"type": "integer", "maximum": 9999}},
    "required": ["name", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def pair():
    from ddtree.engine.target import load_causal_lm

    torch.manual_seed(0)
    target = load_causal_lm(os.path.join(PAIR, "target"), torch.float32)
    drafter = DFlashDraftModel.from_pretrained(os.path.join(PAIR, "drafter"), dtype=torch.float32, device="cpu")
    tokenizer = transformers.AutoTokenizer.from_pretrained(os.path.join(PAIR, "target"))
    engine = SpeculativeEngine(target, drafter)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=engine.target.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    # Without free whitespace in the JSON: this pair's greedy choice is a newline and spaces, for as long as allowed.
    schema = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    grammars = {"regex": compiler.compile_regex(REGEX), "json": schema}
    return engine, tokenizer, grammars, load_pair_prompts(PAIR)["prompts"][:3], int(info.stop_token_ids[0])


def _generate(pair, kind, mode, budget=64):
    engine, _, grammars, prompts, eos = pair
    constraints = [GrammarConstraint(grammars[kind]) for _ in prompts]
    config = GenerationConfig(
        mode=mode, budget=budget, max_new_tokens=80, stop_token_ids=[eos], constraints=constraints
    )
    return engine.generate(prompts, config), constraints


@pytest.mark.parametrize("kind", ["regex", "json"])
def test_trees_under_a_grammar_give_what_one_token_at_a_time_gives(pair, kind):
    _, tokenizer, _, _, eos = pair
    expected, _ = _generate(pair, kind, "ar")
    for mode, budget in (("chain", 15), ("ddtree", 16), ("ddtree", 64)):
        got, constraints = _generate(pair, kind, mode, budget)
        assert [r.output_ids for r in got] == [r.output_ids for r in expected], (mode, budget)
        assert all(c.matcher.is_terminated() for c in constraints)  # each grammar advanced to its end
    for result in expected:
        assert result.finish_reason == "stop" and result.output_ids[-1] == eos  # ended by the grammar
        text = tokenizer.decode(result.output_ids[:-1])
        if kind == "regex":
            assert re.fullmatch(REGEX, text), text
        else:
            value = json.loads(text)
            assert set(value) == {"name", "count"} and isinstance(value["count"], int), text


def test_trees_still_accept_several_tokens_a_step_under_a_grammar(pair):
    """Not plain decoding in disguise: the verified trees accept nodes below their roots under the masks."""
    got, _ = _generate(pair, "regex", "ddtree", 64)
    taus = [r.stats.mean_acceptance_length for r in got]
    assert min(taus) > 1.3, taus


def test_without_the_masks_the_output_leaves_the_grammar(pair):
    """The oracle can fail: the same prompts unconstrained do not follow the regex."""
    engine, tokenizer, _, prompts, eos = pair
    free = engine.generate(prompts, GenerationConfig(mode="ddtree", budget=16, max_new_tokens=40, stop_token_ids=[eos]))
    assert not any(re.fullmatch(REGEX, tokenizer.decode(r.output_ids)) for r in free)


def test_a_node_refused_by_the_grammar_gets_an_all_allowed_row_and_its_parent_refuses_it(pair):
    engine, tokenizer, grammars, _, _ = pair
    vocab = engine.target.vocab_size
    constraint = GrammarConstraint(grammars["regex"])
    (letter,), (stop,) = tokenizer.encode("a"), tokenizer.encode(".")  # a letter first; a full stop is refused
    masks = constraint.node_masks([-1, 0, 0], [letter, stop])
    assert masks[0, letter] and not masks[0, stop]
    assert masks[1].any() and not masks[1].all()  # after "a": the grammar's own row
    assert masks[2].all()  # a refused node's row: never read, all-allowed
    logits = masked_logits(torch.zeros((3, vocab)), masks)
    assert torch.isinf(logits[0, stop]) and torch.isfinite(logits[2]).all()


def test_constraints_must_match_the_prompts_and_the_vocabulary(pair):
    engine, _, grammars, prompts, _ = pair
    one = [GrammarConstraint(grammars["regex"])]
    with pytest.raises(EngineInputError, match="1 constraints for 3 prompts"):
        engine.generate(prompts, GenerationConfig(mode="ar", max_new_tokens=4, constraints=one))
    _, tokenizer, _, _, _ = pair
    wider_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=engine.target.vocab_size + 64)
    wider = GrammarConstraint(xgr.GrammarCompiler(wider_info).compile_regex(REGEX))
    with pytest.raises(EngineInputError, match="the target's logits width"):
        engine.generate(prompts[:1], GenerationConfig(mode="ar", max_new_tokens=4, constraints=[wider]))

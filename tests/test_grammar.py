"""Grammar masks for a draft tree (``ddtree.grammar``) against a matcher forked per node."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

xgr = pytest.importorskip("xgrammar")

from ddtree.grammar import ALL_ALLOWED, fill_tree_bitmask, first_child_next_sibling  # noqa: E402

VOCAB = ["a", "b", "c", "d", "ab", "bc", "cd", "x", '"', "{", "}", ":", "1", "2", "<eos>"]
EOS = len(VOCAB) - 1
GRAMMARS = {
    "ebnf": 'root ::= "a" ("b" | "c")* "d"',
    "choice": 'root ::= "ab" | "abc" | "x"',
    "json-ish": 'root ::= "{" "\\"" [a-d]+ "\\"" ":" [12]+ "}"',
}


def _compiled(name):
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return info, xgr.GrammarCompiler(info).compile_grammar(GRAMMARS[name])


def reference_rows(matcher, parents, tokens, words):
    """Each node's row from its own fork of the matcher, advanced along the node's path (all-allowed where the path
    is refused or the grammar has ended)."""
    n = len(parents)
    rows = torch.zeros((n, words), dtype=torch.int32)
    for j in range(n):
        path, node = [], j
        while node > 0:
            path.append(int(tokens[node - 1]))
            node = parents[node]
        fork = matcher.fork()
        if not all(fork.accept_token(t) for t in reversed(path)) or fork.is_terminated():
            rows[j] = ALL_ALLOWED
        else:
            fork.fill_next_token_bitmask(rows, j)
    return rows


@st.composite
def trees(draw):
    n = draw(st.integers(min_value=1, max_value=40))
    parents = [-1] + [draw(st.integers(min_value=0, max_value=j - 1)) for j in range(1, n)]
    tokens = draw(st.lists(st.integers(0, len(VOCAB) - 1), min_size=n - 1, max_size=n - 1))
    return parents, tokens


@settings(max_examples=60, deadline=None)
@given(tree=trees(), grammar=st.sampled_from(sorted(GRAMMARS)), committed=st.integers(0, 2))
def test_every_nodes_row_is_the_mask_after_its_path_and_the_matcher_is_left_as_it_was(tree, grammar, committed):
    parents, tokens = tree
    info, compiled = _compiled(grammar)
    matcher = xgr.GrammarMatcher(compiled)
    for token in {"ebnf": [0, 1], "choice": [], "json-ish": [9, 8]}[grammar][:committed]:
        assert matcher.accept_token(token)  # some committed text before the tree
    words = xgr.get_bitmask_shape(1, info.vocab_size)[1]
    before = torch.zeros((1, words), dtype=torch.int32)
    matcher.fill_next_token_bitmask(before, 0)
    out = np.zeros((len(parents), words), dtype=np.int32)  # a numpy buffer, as vLLM's, written in place
    unmasked = fill_tree_bitmask(matcher, np.array(parents), np.array(tokens), out)
    expected = reference_rows(matcher, parents, tokens, words)
    assert torch.equal(torch.from_numpy(out), expected)
    # (no node of these grammars allows every token: an all-allowed row is one the grammar gave no mask)
    assert unmasked == int((expected == ALL_ALLOWED).all(dim=1).sum())
    after = torch.zeros((1, words), dtype=torch.int32)
    matcher.fill_next_token_bitmask(after, 0)
    assert torch.equal(before, after)


def test_a_refused_node_and_its_subtree_get_all_allowed_rows_and_a_live_path_its_mask():
    info, compiled = _compiled("ebnf")
    matcher = xgr.GrammarMatcher(compiled)
    # root -> "a" (1) -> "b" (2) -> "d" (4); root -> "x" (3, refused) -> "b" (5, below a refused node)
    parents = np.array([-1, 0, 1, 0, 2, 3])
    tokens = np.array([0, 1, 7, 3, 1])
    words = xgr.get_bitmask_shape(1, info.vocab_size)[1]
    out = torch.zeros((6, words), dtype=torch.int32)
    assert fill_tree_bitmask(matcher, parents, tokens, out) == 2  # the refused "x" and the node below it

    def allowed(row):
        return {t for t in range(len(VOCAB)) if (int(out[row, t // 32]) >> (t % 32)) & 1}

    assert allowed(0) == {0, 4}  # "a" or "ab" starts the grammar
    assert allowed(1) == {1, 2, 3, 5, 6}  # after "a": b, c, d, bc, cd
    assert allowed(4) == {EOS}  # after "abd": only the end
    assert bool((out[3] == ALL_ALLOWED).all()) and bool((out[5] == ALL_ALLOWED).all())


def test_a_terminated_grammar_allows_everything_in_every_row():
    info, compiled = _compiled("choice")
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_token(7) and matcher.accept_token(EOS) and matcher.is_terminated()
    out = torch.zeros((3, xgr.get_bitmask_shape(1, info.vocab_size)[1]), dtype=torch.int32)
    fill_tree_bitmask(matcher, np.array([-1, 0, 0]), np.array([1, 2]), out)
    assert bool((out == ALL_ALLOWED).all())


def test_first_child_and_next_sibling_links_follow_node_order():
    first_child, next_sibling = first_child_next_sibling(np.array([-1, 0, 0, 1, 0, 1, 3]))
    assert first_child.tolist() == [1, 3, -1, 6, -1, -1, -1]
    assert next_sibling.tolist() == [-1, 2, 4, 5, -1, -1, -1]
    assert [x.tolist() for x in first_child_next_sibling(np.array([-1]))] == [[-1], [-1]]


@pytest.mark.parametrize(
    "parents", [[0, 0], [-1, 1], [-1, 0, 3, 1], [-1, -1]], ids=["root-parent", "self", "later", "two-roots"]
)
def test_parents_not_in_pop_order_are_refused(parents):
    with pytest.raises(ValueError, match="parents must be in pop order"):
        first_child_next_sibling(np.array(parents))


def test_mismatched_tokens_or_rows_are_refused_by_name():
    info, compiled = _compiled("ebnf")
    matcher = xgr.GrammarMatcher(compiled)
    words = xgr.get_bitmask_shape(1, info.vocab_size)[1]
    with pytest.raises(ValueError, match="2 draft tokens for a tree of 2 nodes"):
        fill_tree_bitmask(matcher, np.array([-1, 0]), np.array([0, 1]), torch.zeros((2, words), dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be int32"):
        fill_tree_bitmask(matcher, np.array([-1, 0]), np.array([0]), torch.zeros((2, words), dtype=torch.int64))


@settings(max_examples=40, deadline=None)
@given(tree=trees(), grammar=st.sampled_from(sorted(GRAMMARS)), width=st.sampled_from([15, 32, 40, 70]))
def test_the_engines_node_masks_are_the_rows_bits_over_the_logits_width(tree, grammar, width):
    """``GrammarConstraint.node_masks``: one bool per logits column, bit ``t % 32`` of word ``t // 32`` of the node's
    row, for vocabularies that fill no whole word and that span several (the tokenizer info's vocabulary padded to
    ``width`` columns, as a model's logits often are)."""
    from ddtree.engine.constraints import GrammarConstraint

    parents, tokens = tree
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS], vocab_size=width)
    constraint = GrammarConstraint(xgr.GrammarCompiler(info).compile_grammar(GRAMMARS[grammar]))
    masks = constraint.node_masks(parents, tokens)
    words = xgr.get_bitmask_shape(1, width)[1]
    expected = reference_rows(constraint.matcher, parents, tokens, words)
    assert masks.shape == (len(parents), width)
    for j in range(len(parents)):
        bits = [(int(expected[j, t // 32]) >> (t % 32)) & 1 for t in range(width)]
        assert masks[j].tolist() == [bool(b) for b in bits], j

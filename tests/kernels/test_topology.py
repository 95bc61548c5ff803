"""Tree topology helpers: masks, depths, validation."""

import pytest
import torch

from ddtree.kernels.topology import (
    ancestor_or_self_mask,
    root_path,
    tree_depths,
    validate_accepted_path,
    validate_node_offsets,
    validate_parents,
)


def test_ancestor_mask_and_depths_of_a_small_tree():
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    parents = torch.tensor([-1, 0, 0, 1, 1, 2])
    mask = ancestor_or_self_mask(parents)
    expected_rows = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 1, 3], 4: [0, 1, 4], 5: [0, 2, 5]}
    for node, ancestors in expected_rows.items():
        assert torch.nonzero(mask[node]).flatten().tolist() == ancestors
        assert root_path(parents, node) == ancestors
    assert tree_depths(parents).tolist() == [0, 1, 1, 2, 2, 2]
    assert torch.equal(mask, mask.tril())


@pytest.mark.parametrize(
    "parents, message",
    [
        ([0, 0], r"parents\[0\] must be -1"),
        ([-1, 0, 2], r"got parents\[2\] = 2"),
        ([-1, 0, 3, 1], r"got parents\[2\] = 3"),
        ([-1, -1], r"got parents\[1\] = -1"),
        ([], r"N >= 1"),
        ([[-1, 0]], r"shape \[N\]"),
        ([-1.0, 0.0], r"integer tensor of shape \[N\]"),
    ],
)
def test_bad_parents_raise_value_error(parents, message):
    with pytest.raises(ValueError, match=message):
        validate_parents(torch.tensor(parents) if parents else torch.tensor([], dtype=torch.int64))


@pytest.mark.parametrize(
    "offsets, message",
    [
        ([0, 3], r"end at the number of nodes \(4\)"),
        ([1, 4], "start at 0"),
        ([0, 0, 4], "strictly increasing"),
        ([4], r"\[R \+ 1\]"),
    ],
)
def test_bad_node_offsets_raise_value_error(offsets, message):
    with pytest.raises(ValueError, match=message):
        validate_node_offsets(torch.tensor(offsets), total_nodes=4)


def test_accepted_path_must_follow_parent_links():
    parents = torch.tensor([-1, 0, 0, 1])
    assert validate_accepted_path([0, 1, 3], parents).tolist() == [0, 1, 3]
    with pytest.raises(ValueError, match="follow parent links"):
        validate_accepted_path([0, 2, 3], parents)
    with pytest.raises(ValueError, match="start at the root"):
        validate_accepted_path([1, 3], parents)
    with pytest.raises(ValueError, match="< N = 4"):
        validate_accepted_path([0, 7], parents)

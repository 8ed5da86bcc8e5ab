"""Tests for specdec.draft: structure, tree attention mask, positions, paths, Medusa templates."""

import pytest
import torch

from specdec.draft import Draft, tree_template_from_choices

# Crafted tree (node: token)        depth
#   root -> 0:10 -> 2:12             1, 2
#                -> 3:13 -> 5:15     2, 3
#        -> 1:11 -> 4:14             1, 2
CRAFTED_PARENTS = [-1, -1, 0, 0, 1, 3]


def crafted() -> Draft:
    return Draft(tokens=torch.tensor([10, 11, 12, 13, 14, 15]), parents=torch.tensor(CRAFTED_PARENTS))


def test_crafted_tree_structure():
    draft = crafted()
    assert len(draft) == draft.num_nodes == 6
    assert draft.depths.tolist() == [1, 1, 2, 2, 2, 3]
    assert not draft.is_chain
    assert draft.children(-1) == [0, 1]
    assert draft.children(0) == [2, 3]
    assert draft.children(1) == [4]
    assert draft.children(3) == [5]
    assert draft.children(2) == [] and draft.children(5) == []
    assert draft.path_to(5) == [0, 3, 5]
    assert draft.leaf_paths() == [[0, 2], [1, 4], [0, 3, 5]]
    assert draft.positions(start=7).tolist() == [7, 8, 8, 9, 9, 9, 10]


def test_crafted_tree_attention_mask():
    # rows/cols: root, nodes 0..5; each row = root + ancestors + itself
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],  # root (last committed token)
            [1, 1, 0, 0, 0, 0, 0],  # node 0
            [1, 0, 1, 0, 0, 0, 0],  # node 1
            [1, 1, 0, 1, 0, 0, 0],  # node 2: root, 0, 2
            [1, 1, 0, 0, 1, 0, 0],  # node 3: root, 0, 3
            [1, 0, 1, 0, 0, 1, 0],  # node 4: root, 1, 4
            [1, 1, 0, 0, 1, 0, 1],  # node 5: root, 0, 3, 5
        ],
        dtype=torch.bool,
    )
    draft = crafted()
    mask = draft.tree_attention_mask()
    assert mask.dtype == torch.bool and torch.equal(mask, expected)
    assert torch.equal(draft.tree_attention_mask(include_root=False), expected[1:, 1:])


def test_chain_is_causal():
    draft = Draft.chain([4, 8, 15, 16])
    assert draft.parents.tolist() == [-1, 0, 1, 2]
    assert draft.is_chain and draft.depths.tolist() == [1, 2, 3, 4]
    assert torch.equal(draft.tree_attention_mask(), torch.ones(5, 5, dtype=torch.bool).tril())
    assert draft.positions(100).tolist() == [100, 101, 102, 103, 104]
    assert draft.leaf_paths() == [[0, 1, 2, 3]]
    assert draft.draft_probs is None
    probs = torch.full((4, 20), 0.05)
    assert Draft.chain(torch.tensor([4, 8, 15, 16]), probs).draft_probs is probs


def test_empty_draft():
    draft = Draft.empty()
    assert len(draft) == 0 and draft.is_chain
    assert torch.equal(draft.tree_attention_mask(), torch.ones(1, 1, dtype=torch.bool))
    assert draft.tree_attention_mask(include_root=False).shape == (0, 0)
    assert draft.positions(9).tolist() == [9]
    assert draft.leaf_paths() == [] and draft.children(-1) == []


def test_random_trees_mask_agrees_with_paths_and_positions():
    source = torch.Generator().manual_seed(0)
    for num_nodes in range(1, 25):
        parents = [int(torch.randint(-1, node, (1,), generator=source)) for node in range(num_nodes)]
        draft = Draft(torch.arange(num_nodes), torch.tensor(parents))
        mask = draft.tree_attention_mask()
        positions = draft.positions(3)
        for node in range(num_nodes):
            path = draft.path_to(node)
            assert mask[node + 1, 1:].nonzero().squeeze(1).tolist() == path  # ancestors + itself
            assert positions[node + 1] == 3 + len(path)
            assert all(draft.parents[child] == node for child in draft.children(node))
        leaves = {path[-1] for path in draft.leaf_paths()}
        assert leaves == {node for node in range(num_nodes) if not draft.children(node)}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1, 1])), r"parents\[1\] = 1"),
        (dict(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1, -2])), r"parents\[1\] = -2"),
        (dict(tokens=torch.tensor([1, 2]), parents=torch.tensor([0, -1])), r"parents\[0\] = 0"),
        (dict(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1])), "one entry per token"),
        (dict(tokens=torch.tensor([1.0, 2.0]), parents=torch.tensor([-1, 0])), "integers"),
        (dict(tokens=torch.tensor([[1, 2]]), parents=torch.tensor([-1, 0])), "1-D"),
        (dict(tokens=torch.tensor([-3]), parents=torch.tensor([-1])), "non-negative"),
        (dict(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1, 0]), draft_probs=torch.rand(3, 5)), r"shape \[N=2, V\]"),
        (dict(tokens=torch.tensor([1, 7]), parents=torch.tensor([-1, 0]), draft_probs=torch.rand(2, 5)), "outside the draft vocabulary"),
        (dict(tokens=torch.tensor([1]), parents=torch.tensor([-1]), draft_probs=torch.ones(1, 5, dtype=torch.long)), "floating-point"),
        (dict(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1, 0]), confidences=[0.5]), r"confidences must have shape \[N=2\]"),
        (dict(tokens=torch.tensor([1, 2]), parents=torch.tensor([-1, 0]), confidences=[0.5, 1.5]), r"probabilities in \[0, 1\]"),
        (dict(tokens=torch.tensor([1]), parents=torch.tensor([-1]), confidences=[float("nan")]), r"probabilities in \[0, 1\]"),
    ],
)
def test_invalid_drafts_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Draft(**kwargs)


def test_prefix_slices_every_per_node_field():
    probs = torch.softmax(torch.randn(6, 20, generator=torch.Generator().manual_seed(0)), dim=-1)
    draft = Draft(torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor(CRAFTED_PARENTS), probs,
                  confidences=[0.9, 0.8, 0.7, 0.6, 0.5, 0.4])
    assert draft.confidences.dtype.is_floating_point and draft.confidences.shape == (6,)
    head = draft.prefix(4)
    assert head.tokens.tolist() == [10, 11, 12, 13] and head.parents.tolist() == CRAFTED_PARENTS[:4]
    assert torch.equal(head.draft_probs, probs[:4])
    assert torch.allclose(head.confidences, torch.tensor([0.9, 0.8, 0.7, 0.6]))
    assert head.depths.tolist() == [1, 1, 2, 2]
    assert draft.prefix(6) is draft and len(draft.prefix(0)) == 0
    chain = Draft.chain([4, 8, 15], confidences=[1.0, 0.5, 0.0]).prefix(2)
    assert chain.is_chain and chain.tokens.tolist() == [4, 8] and chain.draft_probs is None
    for bad in (-1, 7, 2.0, True):
        with pytest.raises(ValueError, match="prefix length"):
            draft.prefix(bad)


def test_children_rejects_unknown_node():
    with pytest.raises(ValueError, match="node must be"):
        crafted().children(6)


def test_tree_template_from_medusa_choices():
    template = tree_template_from_choices([(1, 0), (0,), (0, 1), (1,), (0, 0), (0, 0, 2)])
    assert template.choices == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 2))
    assert template.parents == (-1, -1, 0, 0, 1, 2)
    assert template.ranks == (0, 1, 0, 1, 0, 2)
    assert template.depths == (1, 1, 2, 2, 2, 3)
    assert template.num_nodes == 6 and template.max_depth == 3
    assert template.topk_per_depth == (2, 2, 3)
    draft = Draft(torch.arange(6), template.parents_tensor())
    assert draft.depths.tolist() == list(template.depths)
    assert draft.children(0) == [2, 3]  # best rank first among siblings


@pytest.mark.parametrize(
    "choices, message",
    [
        ([(0,), (0, 1, 0)], r"needs its parent \(0, 1\)"),
        ([(0,), (0,)], "unique"),
        ([()], "non-empty"),
        ([(0,), (-1,)], "ranks >= 0"),
    ],
)
def test_tree_template_rejects_bad_choices(choices, message):
    with pytest.raises(ValueError, match=message):
        tree_template_from_choices(choices)

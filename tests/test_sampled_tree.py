"""Sampled dynamic trees (draft.ScoredTree at temperature > 0, shared by EAGLE and small-model):
children drawn from q without replacement, each carrying the exact row it was drawn from, slots
scored before their draw, and the emitted tokens distributed exactly like the target through the
real verifier, while two deliberately wrong variants fail the same test:
  (a) siblings' rows without the earlier siblings removed (`rows_ignoring_earlier_siblings`),
  (b) the final top-n chosen by each node's own sampled draft probability, EAGLE-2's greedy
      rerank (`select_by_own_value`).
The variants are installed with monkeypatch on ScoredTree itself, so the drafters' tests
(test_eagle.py, test_model_drafters.py) run them through the real loop too.
"""

import math

import pytest
import torch
from conftest import make_tiny_hf_dir
from scipy.stats import chisquare
from test_model_drafters import _drafted_pair_pvalue

from specdec.draft import ScoredTree
from specdec.drafters.small_model import SmallModelDrafter
from specdec.models.llama import load_native
from specdec.sampling import SamplingParams, make_generator
from specdec.verify import verify_tree

# A crafted Markov drafter q(. | last token) and target p(. | last token) over 4 tokens.
# From token 0 the first draft (mostly 1) is usually rejected and the second sibling decides
# the outcome: variant (a) shows. From token 3 the first draft (mostly 1) is accepted and,
# after 1, the drafter prefers 1 (q 0.55) where the target almost never emits it: a selection
# that keeps the grandchild for its own value shows (variant (b)).
DRAFT_PROBS = torch.tensor([[0.05, 0.6, 0.3, 0.05], [0.01, 0.55, 0.43, 0.01], [0.25, 0.25, 0.25, 0.25],
                            [0.05, 0.6, 0.3, 0.05]])
TARGET_PROBS = torch.tensor([[0.25, 0.1, 0.45, 0.2], [0.3, 0.02, 0.38, 0.3], [0.3, 0.3, 0.2, 0.2],
                             [0.1, 0.55, 0.25, 0.1]])
SAMPLING = SamplingParams(temperature=1.0)


# ---------------------------------------------------------------------------- the wrong variants
def rows_ignoring_earlier_siblings(tree: ScoredTree, node: int) -> torch.Tensor:
    """WRONG on purpose: every sibling reports its parent's full q, as if drawn with replacement."""
    probs, _, _ = tree.sources[node]
    row = probs / probs.sum()
    return row if tree.full_probs is None else tree.full_probs(row)


def select_by_own_value(monkeypatch) -> None:
    """WRONG on purpose: the final top-n ranks each node by its path's own sampled draft
    probabilities (EAGLE-2's rerank), which looks at the node's own value."""
    best_subtree = ScoredTree.best_subtree

    def by_own_value(tree: ScoredTree, budget: int):
        own: list[float] = []
        for node, parent in enumerate(tree.parents):
            probs, _, index = tree.sources[node]
            own.append((0.0 if parent < 0 else own[parent]) + math.log(float(probs[index] / probs.sum())))
        tree.scores = own
        return best_subtree(tree, budget)

    monkeypatch.setattr(ScoredTree, "best_subtree", by_own_value)


def install_variant(monkeypatch, variant: str) -> None:
    """Install wrong variant "rows" (a) or "own-value" (b) on ScoredTree for the rest of the test."""
    if variant == "rows":
        monkeypatch.setattr(ScoredTree, "draft_row", rows_ignoring_earlier_siblings)
    else:
        select_by_own_value(monkeypatch)


# ---------------------------------------------------------------------------- a crafted drafter
def _grow(last: int, generator, budget: int, topk: int, beam: int, depth: int):
    """EAGLE-2's growth over the crafted q: expand the best `beam` nodes of each depth, keep `budget`."""
    tree = ScoredTree(topk, SAMPLING, generator)
    level = tree.expand(-1, DRAFT_PROBS[last].log())
    for _ in range(2, depth + 1):
        frontier = tree.best(level, beam)
        if not frontier or tree.cannot_improve(frontier, budget):
            break
        level = [child for node in frontier for child in tree.expand(node, DRAFT_PROBS[tree.tokens[node]].log())]
    return tree.best_subtree(budget)


def _emitted_pair_pvalue(root: int, runs: int, budget=2, topk=2, beam=1, depth=2) -> float:
    """Chi-square p-value of the first two emitted tokens after `root` (draft, verify_tree, repeat)
    against the target's exact joint p(t1 | root) p(t2 | t1); cells expected < 5 are pooled."""
    counts = torch.zeros(4, 4)
    for seed in range(runs):
        generator = make_generator(seed)
        emitted: list[int] = []
        while len(emitted) < 2:
            last = emitted[-1] if emitted else root
            draft = _grow(last, generator, budget, topk, beam, depth)
            target_rows = TARGET_PROBS[[last] + draft.tokens.tolist()]  # [N + 1, V]: after the root, after each node
            emitted += verify_tree(draft, target_rows, generator).tokens
        counts[emitted[0], emitted[1]] += 1
    expected = (TARGET_PROBS[root][:, None] * TARGET_PROBS).double().flatten() * runs  # [16]
    observed = counts.double().flatten()
    big = expected >= 5
    if not big.all():
        observed = torch.cat([observed[big], observed[~big].sum()[None]])
        expected = torch.cat([expected[big], expected[~big].sum()[None]])
    return float(chisquare(observed.numpy(), expected.numpy() * float(observed.sum() / expected.sum())).pvalue)


@pytest.mark.parametrize("root", [0, 3])
def test_sampled_tree_emits_the_target_distribution(root):
    assert _emitted_pair_pvalue(root, runs=2000) > 1e-3
    # a larger tree (3 children per node, 2 expanded per depth, 4 of 9+ nodes kept) as well
    assert _emitted_pair_pvalue(root, runs=1000, budget=4, topk=3, beam=2, depth=3) > 1e-3


@pytest.mark.parametrize("variant, root", [("rows", 0), ("own-value", 3)])
def test_wrong_sampled_trees_fail_the_same_test(monkeypatch, variant, root):
    install_variant(monkeypatch, variant)
    assert _emitted_pair_pvalue(root, runs=2000) < 1e-6


# ---------------------------------------------------------------------------- the real loop
FIRST = 3  # crafted token i is id FIRST + i in the tiny 8-token tokenizer (0, 1, 2: <s>, </s>, space)
LEAD_IN = {0: [7], 3: [2]}  # a prompt whose next token is certainly crafted token 0 / 3: the first draft's root


def make_markov_llama(path, probs: torch.Tensor, vocab_size: int = 8):
    """A tiny real Llama whose next-token distribution after crafted token i is probs[i] (every other
    id ~e^-40; after a LEAD_IN prompt the next token is certain): orthonormal embeddings, blocks that
    write nothing to the residual stream, and an LM head that reads the log-probability table off
    the normed embedding."""
    _, model = make_tiny_hf_dir(path, "llama", seed=0, vocab_size=vocab_size)
    hidden = model.config.hidden_size
    codes = torch.linalg.qr(torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(0)))[0][:vocab_size]
    table = torch.full((vocab_size, vocab_size), -40.0)  # [last token, next token] log-probabilities
    size = probs.shape[0]
    table[FIRST : FIRST + size, FIRST : FIRST + size] = probs.log()
    for root, (lead_in,) in LEAD_IN.items():
        table[lead_in, FIRST + root] = 0.0
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(codes)  # [V, H]
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight.copy_(table.T @ codes / hidden**0.5)  # the final norm scales a code by sqrt(H)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(path)
    return load_native(path, name=path.name)


@pytest.fixture(scope="module")
def markov_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("markov")
    return make_markov_llama(root / "target", TARGET_PROBS), make_markov_llama(root / "draft", DRAFT_PROBS)


def test_small_model_sampled_tree_keeps_the_target_distribution(markov_pair, monkeypatch):
    """Through the real loop (generate_batch, the drafter's own KV cache, verify_tree): the first
    draft (a 2-node tree) decides output tokens 2 and 3, compared with the target's exact joint by
    test_model_drafters' chi-square test; the wrong variants fail it."""
    target, draft = markov_pair
    drafter = SmallModelDrafter(target, draft_target=draft, tree=True, tree_nodes=2, tree_topk=2, tree_depth=2)
    for root in (0, 3):
        assert _drafted_pair_pvalue(target, drafter, LEAD_IN[root], runs=1500) > 1e-3
    for variant, root in (("rows", 0), ("own-value", 3)):
        with monkeypatch.context() as patch:
            install_variant(patch, variant)
            assert _drafted_pair_pvalue(target, drafter, LEAD_IN[root], runs=1500) < 1e-6, variant


# ---------------------------------------------------------------------------- structure
def _sampled_tree(seed: int, vocab: int = 12, topk: int = 3, levels: int = 3) -> ScoredTree:
    """A sampled tree over random draft distributions: every node of each level is expanded."""
    logits = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * 2
    tree = ScoredTree(topk, SAMPLING, make_generator(seed))
    level = tree.expand(-1, logits[0])
    for _ in range(levels - 1):
        level = [child for node in level for child in tree.expand(node, logits[tree.tokens[node]])]
    return tree


def test_sampled_children_carry_q_without_their_earlier_siblings():
    tree = _sampled_tree(seed=1)
    for parent in [-1, *range(len(tree.tokens))]:
        children = [n for n, p in enumerate(tree.parents) if p == parent]
        for rank, child in enumerate(children):
            probs, earlier, index = tree.sources[child]
            assert list(earlier) == [tree.tokens[c] for c in children[:rank]]  # drawn without replacement
            assert tree.tokens[child] == index and tree.tokens[child] not in earlier
            expected = probs.clone()
            expected[list(earlier)] = 0
            row = tree.draft_row(child)
            assert torch.allclose(row, expected / expected.sum(), atol=1e-6) and float(row[index]) > 0


def test_sampled_scores_never_rise_so_the_best_n_is_closed():
    """Heap order (a slot never outscores its parent or an earlier sibling) is what makes the
    top-n a function of the nodes ranked ahead: it must hold for every node, and the kept tree
    holds every kept node's ancestors and earlier siblings, siblings in draw order."""
    for seed in range(5):
        tree = _sampled_tree(seed)
        for node, parent in enumerate(tree.parents):
            if parent >= 0:
                assert tree.scores[node] <= tree.scores[parent]
            if node and tree.parents[node - 1] == parent:
                assert tree.scores[node] <= tree.scores[node - 1]
        for budget in (1, 4, 7, 11):
            draft = tree.best_subtree(budget)
            assert len(draft) == budget and draft.draft_probs.shape == (budget, 12)
            for node in range(budget):
                siblings = draft.children(int(draft.parents[node]))
                for earlier in siblings[: siblings.index(node)]:  # drawn before: probability 0 in this row
                    assert float(draft.draft_probs[node, draft.tokens[earlier]]) == 0.0
            # a sibling is kept only with all its earlier siblings: its row removes exactly those
            for node in range(budget):
                removed = int((draft.draft_probs[node] == 0).sum())
                position = draft.children(int(draft.parents[node])).index(node)
                assert removed == position


def test_greedy_and_unsampled_trees_stay_deterministic():
    logits = torch.randn(12, generator=torch.Generator().manual_seed(0))
    for sampling, sample in ((SamplingParams(), True), (SamplingParams(temperature=1.0), False)):
        tree = ScoredTree(3, sampling, make_generator(0), sample=sample)
        children = tree.expand(-1, logits)
        assert [tree.tokens[c] for c in children] == logits.topk(3).indices.tolist()
        assert tree.best_subtree(3).draft_probs is None

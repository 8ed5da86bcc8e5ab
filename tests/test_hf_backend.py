"""HFTarget (transformers fallback backend) against plain transformers forwards without a cache.

Tiny random models only (no download): Llama / Qwen2 from conftest's `tiny_dirs`, a tiny
Gemma 3 text model (4-token sliding window on all layers but one) from `tiny_gemma3_dir`, so
sequences longer than the window exercise the per-layer-type masks, and a tiny Mistral whose
4-token window applies to every layer (no layer_types in its config).
"""

import pytest
import torch

from specdec import SamplingParams, generate, make_drafter
from specdec.loop import SpecBatch, run
from specdec.models.hf import HFTarget, parse_dtype

from conftest import assert_close_to_scale, make_tiny_hf_dir


def full_logits(model, token_ids):
    """Reference: one forward over the whole sequence, no cache. [T, V]"""
    with torch.no_grad():
        return model(input_ids=torch.tensor([token_ids])).logits[0].float()


def step(target, cache, token_ids, first_position, attn_mask=None, positions=None, hidden_layers=()):
    tokens = torch.tensor([token_ids])
    if positions is None:
        positions = torch.arange(first_position, first_position + len(token_ids))[None]
    return target.forward(tokens, positions, cache, attn_mask=attn_mask, hidden_layers=hidden_layers)


@pytest.fixture(scope="module")
def tiny_mistral_dir(tmp_path_factory):
    return make_tiny_hf_dir(tmp_path_factory.mktemp("tiny") / "mistral", "mistral", seed=4, sliding_window=4)


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3", "mistral"])
def hf_target(request, tiny_dirs, tiny_gemma3_dir, tiny_mistral_dir):
    dirs = {**tiny_dirs, "gemma3": tiny_gemma3_dir, "mistral": tiny_mistral_dir}
    model_dir, reference = dirs[request.param]
    return HFTarget.from_dir(model_dir, name=f"tiny-{request.param}"), reference


def test_contract_attributes(hf_target):
    target, reference = hf_target
    assert target.vocab_size == reference.config.vocab_size
    assert target.num_layers == reference.config.num_hidden_layers
    assert target.hidden_size == reference.config.hidden_size
    assert target.dtype == torch.float32
    assert target.tokenizer is not None and target.tokenizer.eos_token_id in target.eos_token_ids


def test_tiny_models_have_the_windows_the_tests_rely_on(tiny_gemma3_dir, tiny_mistral_dir):
    gemma3, mistral = tiny_gemma3_dir[1].config, tiny_mistral_dir[1].config
    assert set(gemma3.layer_types) == {"sliding_attention", "full_attention"} and gemma3.sliding_window == 4
    assert getattr(mistral, "layer_types", None) is None and mistral.sliding_window == 4


def test_incremental_decoding_equals_full_recompute(hf_target):
    target, reference = hf_target
    sequence = [5, 17, 3, 44, 9, 60, 2, 31, 8, 12]  # longer than the tiny Gemma's window
    expected = full_logits(reference, sequence)  # [T, V]
    cache = target.new_cache(batch_size=1, max_len=64)
    prefill, _ = step(target, cache, sequence[:4], 0)
    got = [prefill[0]]
    for position in range(4, len(sequence)):
        logits, _ = step(target, cache, [sequence[position]], position)
        got.append(logits[0])
    assert int(cache.lengths[0]) == len(sequence)
    assert_close_to_scale(torch.cat(got), expected, what="incremental")
    assert got[0].dtype == torch.float32


def test_truncate_then_continue_equals_fresh(hf_target):
    target, reference = hf_target
    prefix, rejected, continuation = [7, 1, 22, 40], [11, 12, 13], [50, 51]
    cache = target.new_cache()
    step(target, cache, prefix + rejected, 0)
    cache.truncate(len(prefix))
    assert cache.lengths.tolist() == [len(prefix)]
    logits, _ = step(target, cache, continuation, len(prefix))
    expected = full_logits(reference, prefix + continuation)[len(prefix):]
    assert_close_to_scale(logits[0], expected, what="after truncate")
    cache.truncate(torch.tensor([2]))  # LongTensor[B] form
    assert cache.lengths.tolist() == [2]


def tree_inputs(parents, prefix_len, tokens):
    """Node tokens, bool mask [N, N] (each node sees its ancestors and itself), positions [N]."""
    size = len(parents)
    mask = torch.zeros(size, size, dtype=torch.bool)
    depth = []
    for node, parent in enumerate(parents):
        mask[node, node] = True
        if parent >= 0:
            mask[node] |= mask[parent]
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return tokens, mask, torch.tensor(depth) + prefix_len


def ancestors_path(node, parents):
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


TREE_PARENTS = [-1, 0, 0, 1, 2]  # 0 -> {1, 2}, 1 -> {3}, 2 -> {4}


def test_tree_mask_and_keep_compaction(hf_target):
    target, reference = hf_target
    prefix = [4, 8, 15, 16, 23, 42, 9]  # prefix 7 + tree depth 3 > Gemma window 4: masks use positions
    tokens, mask, positions = tree_inputs(TREE_PARENTS, len(prefix), [30, 31, 32, 33, 34])
    cache = target.new_cache()
    step(target, cache, prefix, 0)
    tree_logits, _ = step(target, cache, tokens, len(prefix), attn_mask=mask[None], positions=positions[None])
    # every node's logits = a plain sequential run over prefix + its root-to-node path
    for node in range(len(tokens)):
        path_tokens = [tokens[i] for i in ancestors_path(node, TREE_PARENTS)]
        assert_close_to_scale(tree_logits[0, node], full_logits(reference, prefix + path_tokens)[-1], what=f"node {node}")
    # accept path 0 -> 2 -> 4, compact it, continue: same as a fresh run over the kept tokens
    accepted = [0, 2, 4]
    cache.keep(0, len(prefix), accepted)
    assert cache.lengths.tolist() == [len(prefix) + len(accepted)]
    kept_tokens = prefix + [tokens[i] for i in accepted]
    logits, _ = step(target, cache, [55, 56], len(kept_tokens))
    assert_close_to_scale(logits[0], full_logits(reference, kept_tokens + [55, 56])[-2:], what="after keep")


def test_ragged_batch_with_tree_masks_equals_each_row_alone(hf_target):
    """What the loop does with B = 2: right-padded prefill of unequal prompts, one verify forward
    with a tree in one row and a short chain plus padding in the other, per-row keep, a decode."""
    target, reference = hf_target
    prompts = [[4, 8, 15, 16, 23, 42, 9, 11, 3], [50, 60, 70, 5, 6]]  # 9 and 5 tokens (window 4)
    lengths = torch.tensor([len(p) for p in prompts])
    width = int(lengths.max())
    cache = target.new_cache(batch_size=2, max_len=32)
    padded = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompts])  # [2, 9]
    prefill, _ = target.forward(padded, torch.arange(width).expand(2, -1), cache)
    cache.truncate(lengths)
    for row, prompt in enumerate(prompts):
        assert_close_to_scale(prefill[row, : len(prompt)], full_logits(reference, prompt), what=f"prefill row {row}")
    # verify block: row 0 a 5-node tree, row 1 a 3-node chain + 2 padding slots (see loop._batch_inputs)
    chain_parents = [-1, 0, 1]
    tree = tree_inputs(TREE_PARENTS, len(prompts[0]), [30, 31, 32, 33, 34])
    chain = tree_inputs(chain_parents, len(prompts[1]), [40, 41, 42])
    tokens = torch.zeros(2, 5, dtype=torch.long)
    positions = lengths[:, None].repeat(1, 5)
    mask = torch.eye(5, dtype=torch.bool).repeat(2, 1, 1)
    for row, (node_tokens, node_mask, node_positions) in enumerate((tree, chain)):
        n = len(node_tokens)
        tokens[row, :n], positions[row, :n], mask[row, :n, :n] = torch.tensor(node_tokens), node_positions, node_mask
    logits, _ = target.forward(tokens, positions, cache, attn_mask=mask)
    assert cache.lengths.tolist() == [14, 10]
    for row, ((node_tokens, _, _), parents) in enumerate(zip((tree, chain), (TREE_PARENTS, chain_parents))):
        for node in range(len(node_tokens)):
            path = [node_tokens[i] for i in ancestors_path(node, parents)]
            expected = full_logits(reference, prompts[row] + path)[-1]
            assert_close_to_scale(logits[row, node], expected, what=f"row {row} node {node}")
    # keep different paths per row (the loop's step 6), then one causal 2-token step for both rows
    kept_paths = [[0, 1, 3], [0, 1]]
    sequences = []
    for row, (kept, (node_tokens, _, _)) in enumerate(zip(kept_paths, (tree, chain))):
        cache.keep(row, len(prompts[row]), kept)
        sequences.append(prompts[row] + [node_tokens[i] for i in kept])
    assert cache.lengths.tolist() == [len(s) for s in sequences]
    nxt = torch.tensor([[7, 8], [9, 10]])
    logits, _ = target.forward(nxt, cache.lengths[:, None] + torch.arange(2), cache)
    for row, sequence in enumerate(sequences):
        expected = full_logits(reference, sequence + nxt[row].tolist())[-2:]
        assert_close_to_scale(logits[row], expected, what=f"decode row {row}")


def test_row_views_and_move_row(hf_target):
    """A view over rows [1, 3) writes into the parent cache; move_row copies a sequence to a free row."""
    target, reference = hf_target
    cache = target.new_cache(batch_size=3, max_len=32)
    view = cache.rows(1, 3)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [6, 5, 3, 5, 8]]
    width = len(prompts[0])
    padded = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompts])
    target.forward(padded, torch.arange(width).expand(2, -1), view)
    view.truncate(torch.tensor([len(p) for p in prompts]))
    assert cache.lengths.tolist() == [0, 7, 5]
    cache.move_row(2, 0)  # the sequence in row 2 now also lives in row 0
    cache.rows(2, 3).truncate(0)
    first = cache.rows(0, 2)
    logits, _ = target.forward(torch.tensor([[7], [8]]), first.lengths[:, None].clone(), first)
    assert cache.lengths.tolist() == [6, 8, 0]
    assert_close_to_scale(logits[0, 0], full_logits(reference, prompts[1] + [7])[-1], what="moved row")
    assert_close_to_scale(logits[1, 0], full_logits(reference, prompts[0] + [8])[-1], what="row 1")


def test_hidden_layers_follow_output_hidden_states(hf_target):
    target, reference = hf_target
    sequence = [3, 1, 4, 1, 5, 9]
    with torch.no_grad():
        ref = reference(input_ids=torch.tensor([sequence]), output_hidden_states=True)
    cache = target.new_cache()
    layers = (0, 1, target.num_layers)
    _, hidden = step(target, cache, sequence, 0, hidden_layers=layers)
    assert set(hidden) == set(layers)
    for layer in layers:
        assert hidden[layer].shape == (1, len(sequence), target.hidden_size)
        assert_close_to_scale(hidden[layer], ref.hidden_states[layer], what=f"hidden {layer}")
    with torch.no_grad():
        final = reference.model(input_ids=torch.tensor([sequence])).last_hidden_state
    assert_close_to_scale(hidden[target.num_layers], final, what="after the final norm")


REPETITIVE_PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [20, 21, 22, 20, 21]]  # pld (1-grams too) finds matches


@pytest.mark.parametrize("drafter_name,options", [("pld", {"min_ngram": 1}), ("random", {"gamma": 5, "tree": True})],
                         ids=["pld", "random-tree"])
def test_loop_batch_of_ragged_prompts_equals_each_alone(hf_target, drafter_name, options):
    target, _ = hf_target
    alone = [generate(target, prompt, max_new_tokens=12).tokens for prompt in REPETITIVE_PROMPTS]
    batch = run(target, REPETITIVE_PROMPTS, make_drafter(drafter_name, target, **options), max_new_tokens=12).finish()
    assert [result.tokens for result in batch] == alone
    assert sum(result.stats.drafted_tokens for result in batch) > 0  # the drafter did propose


def test_sequences_join_and_leave_a_running_batch(hf_target):
    """Continuous batching on the transformers backend: rows move when a sequence leaves."""
    target, _ = hf_target
    prompts = [[5, 6, 7], [30, 31, 32, 33, 34], [60, 61]]
    alone = [generate(target, p, max_new_tokens=10).tokens for p in prompts]
    batch = SpecBatch(target, make_drafter("random", target, gamma=3, tree=True), max_batch=3, max_len=64)
    greedy = SamplingParams()
    first, second = batch.add(prompts[:2], [greedy] * 2, [10, 10], [(), ()])
    batch.step()
    (third,) = batch.add([prompts[2]], [greedy], [10], [()])
    batch.step()
    batch.remove(first)
    while batch.seqs:
        batch.step()
    assert second.ctx.output_tokens == alone[1]
    assert third.ctx.output_tokens == alone[2]
    assert first.ctx.output_tokens == alone[0][: len(first.ctx.output_tokens)]


def test_unsupported_features_say_what_to_use_instead(tiny_dirs):
    model_dir, _ = tiny_dirs["llama"]
    target = HFTarget.from_dir(model_dir)
    with pytest.raises(ValueError, match="layer_ids"):
        make_drafter("layer-skip", target)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.layer_types = ["chunked_attention"] * config.num_hidden_layers
    with pytest.raises(NotImplementedError, match="full and sliding-window attention"):
        HFTarget(AutoModelForCausalLM.from_config(config), tokenizer=None)


def test_bad_inputs_raise_clear_errors(hf_target):
    target, _ = hf_target
    cache = target.new_cache(max_len=8)
    with pytest.raises(ValueError, match="bool tensor"):
        step(target, cache, [1, 2], 0, attn_mask=torch.ones(1, 2, 2))
    with pytest.raises(ValueError, match="out of range"):
        step(target, cache, [1, 2], 0, hidden_layers=(target.num_layers + 1,))
    with pytest.raises(ValueError, match="overflow"):
        step(target, cache, list(range(1, 10)), 0)
    with pytest.raises(ValueError, match="batch size"):
        target.forward(torch.ones(2, 1, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long), cache)
    with pytest.raises(TypeError, match="new_cache"):
        step(target, object(), [1], 0)
    assert cache.lengths.tolist() == [0]  # failed calls wrote nothing
    step(target, cache, [1, 2, 3], 0)
    with pytest.raises(ValueError, match="can only shorten"):
        cache.truncate(5)
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.keep(0, 0, [2, 1])
    with pytest.raises(ValueError, match="past sequence length"):
        cache.keep(0, 1, [0, 5])
    with pytest.raises(ValueError, match="unsupported dtype"):
        parse_dtype("int8")

"""DSpark: the sequential head conditions on the previous token, training (the target's logsumexp
precomputed, the feature term), and (with a DFlash backbone) the drafter is lossless greedy and
distributed like the target when sampling. The loss and calibration functions: test_dspark_loss.py."""

import json

import pytest
import torch
from conftest import assert_close_to_scale
from safetensors.torch import load_file
from test_eagle import WrongQ
from train_support import counter_selfdistill_data, first_proposal, token_marginal_pvalues

from specdec import SamplingParams, generate
from specdec.api import generate_batch
from specdec.budget import AutoBudget
from specdec.cost import CostTable
from specdec.draft import Draft
from specdec.drafters.base import Drafter
from specdec.drafters.dflash import DFlashDrafter
from specdec.drafters.dspark import DSparkDrafter
from specdec.heads import FrozenTargetParts, target_description
from specdec.heads.dspark_module import SequentialParts
from specdec.heads.export import export_dspark, load_dspark_export
from specdec.kernels import FastLinear, make_backend
from specdec.loop import run
from specdec.sampling import warp_logits_to_probs
from specdec.train import TrainSettings, build_heads, load_samples, train
from specdec.train.dspark_calibration import calibrate_checkpoint
from specdec.train.trainer import split_samples

V, H, K = 11, 8, 4


@pytest.mark.parametrize("head", ["markov", "rnn"])
@torch.no_grad()
def test_sequential_bias_depends_on_the_previous_token(head):
    torch.manual_seed(0)
    parts = SequentialParts(V, H, K, rank=3, head=head)
    torch.nn.init.normal_(parts.markov_head.markov_w2.weight)  # zero-initialised: give it a bias to show
    hidden = torch.randn(1, H)
    state = parts.markov_head.initial_state(1, hidden)
    _, bias_a = parts.markov_head.step(state, torch.tensor([2]), hidden)
    _, bias_b = parts.markov_head.step(state, torch.tensor([5]), hidden)
    _, bias_a_again = parts.markov_head.step(state, torch.tensor([2]), hidden)
    assert float((bias_a - bias_b).abs().max()) > 0.1 * float(bias_a.abs().max())
    torch.testing.assert_close(bias_a, bias_a_again)
    if head == "markov":  # exactly the rank-r bigram: W2 W1[x]
        w1, w2 = parts.markov_head.markov_w1.weight, parts.markov_head.markov_w2.weight
        torch.testing.assert_close(bias_a[0], w2 @ w1[2])


@torch.no_grad()
def test_rnn_state_carries_tokens_before_the_previous_one():
    torch.manual_seed(0)
    parts = SequentialParts(V, H, K, rank=3, head="rnn")
    torch.nn.init.normal_(parts.markov_head.markov_w2.weight)
    hidden = torch.randn(2, 3, H).expand(2, 3, H).clone()
    hidden[1] = hidden[0]
    previous = torch.tensor([[1, 4, 7], [2, 4, 7]])  # same x_{k-1} at positions 1 and 2, different x_0
    bias = parts.markov_head.block_bias(previous, hidden)  # [2, 3, V]
    assert float((bias[0, 2] - bias[1, 2]).abs().max()) > 1e-4  # the RNN remembers x_0
    markov = SequentialParts(V, H, K, rank=3, head="markov")
    torch.nn.init.normal_(markov.markov_head.markov_w2.weight)
    bigram = markov.markov_head.block_bias(previous, hidden)
    torch.testing.assert_close(bigram[0, 2], bigram[1, 2])  # the Markov head does not


def test_block_bias_equals_step_by_step():
    torch.manual_seed(1)
    for head in ("markov", "rnn"):
        parts = SequentialParts(V, H, K, rank=3, head=head)
        torch.nn.init.normal_(parts.markov_head.markov_w2.weight)
        hidden, previous = torch.randn(2, K, H), torch.randint(0, V, (2, K))
        block = parts.markov_head.block_bias(previous, hidden)
        state = parts.markov_head.initial_state(2, hidden)
        for k in range(K):
            state, bias = parts.markov_head.step(state, previous[:, k], hidden[:, k])
            torch.testing.assert_close(bias, block[:, k])


def test_the_trainer_precomputes_the_targets_logsumexp_at_every_label_position(counter, dspark_data):
    from specdec.train.batches import attach_target_log_normalisers, label_positions, make_batch

    _, samples = load_samples(dspark_data, [counter.num_layers], counter)
    parts = FrozenTargetParts.from_target(counter).to(dtype=torch.float32)
    attach_target_log_normalisers(samples, parts, counter.num_layers, "cpu", bf16=False, progress=False, chunk_rows=7)
    for sample in samples:
        wanted = label_positions(sample)
        assert wanted.any() and not wanted[: sample.num_prompt_tokens - 1].any()
        assert torch.isfinite(sample.target_log_normaliser).equal(wanted)
        reference = torch.logsumexp(parts.lm_head(sample.hidden[counter.num_layers].float()), dim=-1)  # [T]
        assert_close_to_scale(sample.target_log_normaliser[wanted], reference[wanted], rel=1e-5, what="logsumexp")
    batch = make_batch(samples[:2], counter.num_layers, 10_000, torch.Generator().manual_seed(0), "cpu")
    assert batch.target_log_normaliser.shape == batch.tokens.shape
    torch.testing.assert_close(batch.target_log_normaliser[0, : samples[0].tokens.shape[0]], samples[0].target_log_normaliser,
                               equal_nan=True)


def test_feature_weight_adds_the_rows_regression_to_the_targets_states(counter, dspark_data):
    """--feature-weight (EAGLE-1's regression) reaches DSpark's own loss: it adds w x a positive term, linear in w."""
    from specdec.train.batches import attach_target_log_normalisers, make_batch
    from specdec.train.trainer import heads_loss

    heads = build_heads("dspark", counter, BLOCK, block_size=BLOCK, num_draft_layers=1, markov_rank=8)
    _, samples = load_samples(dspark_data, sorted({*heads.input_layers, counter.num_layers}), counter)
    parts = FrozenTargetParts.from_target(counter).to(dtype=torch.float32)
    heads.fit_vocabulary(list(range(counter.vocab_size)), counter)
    attach_target_log_normalisers(samples[:2], parts, counter.num_layers, "cpu", bf16=False, progress=False)
    batch = make_batch(samples[:2], heads.input_layers, 10_000, torch.Generator().manual_seed(0), "cpu",
                       top_layer=counter.num_layers)
    losses = [heads_loss(heads, batch, parts, _settings(feature_weight=weight), torch.Generator().manual_seed(1))[0].item()
              for weight in (0.0, 1.0, 2.0)]
    assert losses[1] - losses[0] > 1e-4
    assert losses[2] - losses[0] == pytest.approx(2 * (losses[1] - losses[0]), rel=1e-4)


BLOCK = 4  # DSpark drafts all BLOCK rows (the anchor row is the first prediction)


@pytest.fixture(scope="module")
def dspark_data(counter, tmp_path_factory):
    return counter_selfdistill_data(counter, tmp_path_factory.mktemp("dspark_data") / "data", layers=[0, 1, 2, 3])


def _settings(**changes):
    return TrainSettings(**{"steps": 120, "lr": 3e-3, "batch_size": 4, "loss_rows": 256, "warmup_steps": 10,
                            "eval_every": 60, "save_every": 100, "anchors_per_row": 8, "eval_fraction": 0.25, **changes})


@pytest.fixture(scope="module")
def trained(counter, dspark_data, tmp_path_factory):
    """(checkpoint dir, TrainResult, module, calibration report) of a Markov DSpark trained on the counter."""
    out = tmp_path_factory.mktemp("dspark") / "ckpt"
    heads = build_heads("dspark", counter, BLOCK, block_size=BLOCK, num_draft_layers=2, markov_rank=8)
    _, samples = load_samples(dspark_data, sorted({*heads.input_layers, counter.num_layers}), counter)
    settings = _settings()
    result = train(heads, counter, samples, out, settings, target_description(counter), progress=False, log=lambda _: None)
    parts = FrozenTargetParts.from_target(counter).to(dtype=torch.float32)
    report = calibrate_checkpoint(heads, split_samples(samples, settings.eval_fraction)[1], parts, settings, out)
    return out, result, heads, report


def _perturbed(module, seed=0, scale=0.05):
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn_like(param) * scale)
    return module.eval()


def test_dspark_backbone_drafts_from_the_anchor_row(counter):
    module = build_heads("dspark", counter, BLOCK, block_size=BLOCK)
    assert module.block_size == module.num_positions == BLOCK and module.prediction_offset == 0
    assert module.head_config()["kind"] == "dspark"
    # a DSpark module is a DFlash module, but the dflash drafter would draft it without its
    # sequential head (the wrong q): refused, with the drafter to use instead
    with pytest.raises(ValueError, match="dspark drafter"):
        DFlashDrafter.from_module(counter, module)


@torch.no_grad()
@pytest.mark.parametrize("draft_weights", ["fp32", "int8"])
def test_drafted_q_is_the_trained_computation(smollm2, draft_weights):
    """On SmolLM2 with random weights: the drafter's exact q rows (backbone + sequential bias given
    the token it drafted before) equal the teacher-forced training logits of the same tokens — to
    float rounding with fp32 draft weights, to int8 weight rounding with the default int8 ones."""
    kernel = make_backend("auto").backend.name  # "torch" where the kernel is off: draft_weights is then moot
    for head, anchor_feature in (("markov", False), ("rnn", False), ("markov", True)):
        module = _perturbed(build_heads("dspark", smollm2, 5, block_size=5, markov_rank=16, sequential_head=head,
                                        anchor_feature=anchor_feature), scale=0.02)
        torch.nn.init.normal_(module.sequential.markov_head.markov_w2.weight, std=0.5)
        drafter = DSparkDrafter.from_module(smollm2, module, draft_weights=draft_weights)
        expected_backend = "torch" if kernel == "torch" else {"fp32": kernel, "int8": "int8"}[draft_weights]
        assert drafter.linear_backend == expected_backend
        assert {linear.backend.name for linear in module.modules() if isinstance(linear, FastLinear)} == {expected_backend}
        prompt = smollm2.tokenizer.encode("The capital of France is")
        draft = first_proposal(drafter, smollm2, prompt, 5, SamplingParams(temperature=1.0, seed=1))
        assert draft.confidences is not None and draft.confidences.shape == (5,)
        parts = FrozenTargetParts.from_target(smollm2)
        cached = prompt[:-1]
        _, hiddens = smollm2.forward(torch.tensor([cached]), torch.arange(len(cached))[None], smollm2.new_cache(1, 64),
                                     hidden_layers=module.input_layers)
        context = torch.cat([hiddens[layer] for layer in module.input_layers], dim=-1)  # [1, T, F*H]
        hidden = module.block_hidden(context, torch.tensor([prompt[-1]]), parts)  # [1, K, H]
        previous = torch.tensor([[prompt[-1], *draft.tokens[:-1].tolist()]])
        logits, confidence = module.block_logits({"hidden": hidden, "previous": previous}, parts)
        rel = 1e-4 if expected_backend != "int8" else 0.1  # int8: every weight rounded to 1/254 of its row's max |w|
        assert_close_to_scale(draft.draft_probs, torch.softmax(logits[0].float(), -1), rel=rel, what=f"{head}: q")
        assert_close_to_scale(draft.confidences, module.sequential.calibrated(confidence)[0], rel=rel,
                              what=f"{head}: confidences")


@torch.no_grad()
def test_block_logits_on_the_draft_vocabulary_are_the_full_ones_at_its_ids(smollm2):
    """fit_vocabulary restricts training's q to the ranked label ids: the logits (backbone + Markov
    bias) are the full-vocabulary ones read at those ids, and argmax indices map back to token ids."""
    module = _perturbed(build_heads("dspark", smollm2, 4, block_size=4, markov_rank=8), scale=0.02)
    torch.nn.init.normal_(module.sequential.markov_head.markov_w2.weight, std=0.5)
    parts = FrozenTargetParts.from_target(smollm2).to(dtype=torch.float32)
    hidden = torch.randn(4, 2, smollm2.config.hidden_size).transpose(0, 1)  # a strided [N, K, H] view, as in training
    blocks = {"hidden": hidden, "previous": torch.randint(0, smollm2.config.vocab_size, (4, 2)).t()}
    full, full_confidence = module.block_logits(blocks, parts)  # [N, K, V]
    ranked = torch.randperm(smollm2.config.vocab_size, generator=torch.Generator().manual_seed(0))[:300].tolist()
    module.fit_vocabulary(ranked, smollm2)
    assert module.draft_ids.tolist() == ranked
    restricted, confidence = module.block_logits(blocks, parts)  # [N, K, 300]
    assert_close_to_scale(restricted, full[..., module.draft_ids], what="logits over the draft vocabulary")
    torch.testing.assert_close(confidence, full_confidence)
    empty, _ = module.block_logits({"hidden": hidden[:0], "previous": blocks["previous"][:0]}, parts)  # a step without blocks
    assert empty.shape == (0, 4, 300)
    assert module.to_target_ids(torch.tensor([0, 299])).tolist() == [ranked[0], ranked[299]]
    assert module.to_draft_indices(torch.tensor([ranked[5], next(i for i in range(10**6) if i not in set(ranked))])).tolist() == [5, -100]


def test_greedy_on_smollm2_through_the_loop_equals_plain(smollm2):
    """An untrained (random) DSpark is still lossless: a batch of two prompts, greedy."""
    module = _perturbed(build_heads("dspark", smollm2, 4, block_size=4, markov_rank=16), scale=0.02)
    drafter = DSparkDrafter.from_module(smollm2, module)
    prompts = [smollm2.tokenizer.encode("def add(a, b):"), smollm2.tokenizer.encode("One, two, three,")]
    results = generate_batch(smollm2, prompts, drafter, max_new_tokens=12)
    for prompt, result in zip(prompts, results):
        assert result.tokens == generate(smollm2, prompt, max_new_tokens=12).tokens


class LazyAgainstEager(Drafter):
    """Drafts on some steps only, from a drafter that holds the target's rows until it drafts, and
    checks each draft against a twin that absorbs every step's rows as they come."""

    name = "lazy-against-eager"

    def __init__(self, drafter: DSparkDrafter, draft_on=lambda step: step % 3 == 2):
        self.drafter, self.draft_on, self.drafts = drafter, draft_on, []
        self.hidden_layers, self.cost = drafter.hidden_layers, drafter.cost

    def for_sequence(self):
        twin = LazyAgainstEager(self.drafter, self.draft_on)
        twin.drafts = self.drafts  # one record for every sequence of the batch
        return twin

    def begin(self, prompt_ids, target):
        self.lazy, self.eager, self.steps = self.drafter.for_sequence(), self.drafter.for_sequence(), 0
        self.lazy.begin(prompt_ids, target)
        self.eager.begin(prompt_ids, target)

    def on_verified(self, result, ctx):
        self.lazy.on_verified(result, ctx)
        self.eager.on_verified(result, ctx)
        with torch.inference_mode():
            self.eager.runner.catch_up()  # absorbed now, as before the rows were held
        assert self.eager.catch_up_tokens(ctx) == 0

    def propose(self, ctx, budget):
        self.steps += 1
        if not self.draft_on(self.steps):
            return Draft.empty()
        held = self.lazy.catch_up_tokens(ctx)
        lazy, eager = self.lazy.propose(ctx, budget), self.eager.propose(ctx, budget)
        self.drafts.append((held, lazy, eager))
        assert self.lazy.catch_up_tokens(ctx) == 0
        return lazy


def test_held_rows_caught_up_when_drafting_give_the_draft_of_absorbing_every_step(smollm2):
    """A step that does not draft leaves the target's rows with the runner (no draft-model work);
    the next block absorbs all of them in one forward and drafts exactly what absorbing each step's
    rows as they came would have: the same tokens and, with the batch-invariant kernel, the same
    confidences to the bit (torch's BLAS adds in another order for other row counts: to rounding)."""
    module = _perturbed(build_heads("dspark", smollm2, 5, block_size=5, markov_rank=16), scale=0.02)
    torch.nn.init.normal_(module.sequential.markov_head.markov_w2.weight, std=0.5)
    drafter = DSparkDrafter.from_module(smollm2, module)
    checked = LazyAgainstEager(drafter)
    prompts = [smollm2.tokenizer.encode("def add(a, b):"), smollm2.tokenizer.encode("One, two, three,")]
    results = generate_batch(smollm2, prompts, checked, max_new_tokens=16)
    for prompt, result in zip(prompts, results):
        assert result.tokens == generate(smollm2, prompt, max_new_tokens=16).tokens
    assert len(checked.drafts) >= 6 and all(held >= 2 for held, _, _ in checked.drafts)  # two idle steps' rows, at least
    assert checked.drafts[0][0] > len(prompts[1])  # the first block also catches up the prompt
    bitwise = drafter.linear_backend != "torch"
    for held, lazy, eager in checked.drafts:
        assert lazy.tokens.tolist() == eager.tokens.tolist(), held
        if bitwise:
            assert torch.equal(lazy.confidences, eager.confidences), held
        else:
            assert_close_to_scale(lazy.confidences, eager.confidences, what="confidences")


def test_training_learns_blocks_and_calibration_is_stored(trained):
    checkpoint, result, module, report = trained
    first, last = result.history["eval"][0], result.history["eval"][-1]  # the trainer's eval reads the exact q too
    assert last["loss"] < 0.5 * first["loss"], (first["loss"], last["loss"])
    assert last["tau"] > 3.0 and report["tau"] > 3.0  # of at most BLOCK + 1 per verify, with the sequential head
    assert len(report["temperatures"]) == BLOCK and min(report["temperatures"]) > 0
    assert len(report["ece_before"]) == len(report["ece_after"]) == BLOCK
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["calibration"]["temperatures"] == report["temperatures"]
    stored = load_file(str(checkpoint / "model.safetensors"))["sequential.confidence_temperatures"]
    assert stored.tolist() == pytest.approx(report["temperatures"])
    assert (checkpoint / "calibration.json").is_file()


def test_greedy_batch_through_the_loop_equals_plain(counter, trained):
    drafter = DSparkDrafter(counter, checkpoint=str(trained[0]))
    prompts = [[5, 6, 7, 8], [20, 21], [13, 3, 22, 9]]
    results = generate_batch(counter, prompts, drafter, max_new_tokens=30)
    for prompt, result in zip(prompts, results):
        assert result.tokens == generate(counter, prompt, max_new_tokens=30).tokens
        assert result.stats.tau > 2.5


def test_auto_budget_batch_equals_plain(counter, trained):
    """--gamma auto: the cost model (and the confidence scheduler, which reads Draft.confidences)
    decides how much of each block is verified; greedy output stays plain decoding's."""
    table = CostTable({}, [1, 2, 4, 8, 13, 256], [1000.0, 1040.0, 1100.0, 1250.0, 1400.0, 14000.0])
    drafter = DSparkDrafter(counter, checkpoint=str(trained[0]))
    prompts = [[5, 6, 7, 8], [20, 21]]
    results = run(counter, prompts, drafter, 30, SamplingParams(), (), AutoBudget(table, max_budget=BLOCK)).finish()
    for prompt, result in zip(prompts, results):
        assert result.tokens == generate(counter, prompt, max_new_tokens=30).tokens
        assert result.stats.tau > 1.5


def test_sampled_blocks_cut_by_the_scheduler_keep_the_target_distribution(counter, trained):
    """Temperature 1 under --gamma auto: each chain is cut to the prefix schedule.admit picks from the
    drafter's confidences (tempered here so they vary) before verification; outputs still follow
    the target exactly. All runs share one batch, so the cost table's slope (~0.29 ms per token on
    ~1000 ms) puts the cut near survival 0.3: blocks are really cut, not verified whole."""
    module = build_heads("dspark", counter, BLOCK, block_size=BLOCK, num_draft_layers=2, markov_rank=8)
    module.load_state_dict(trained[2].state_dict())
    module.sequential.confidence_temperatures.fill_(8.0)
    drafter = DSparkDrafter.from_module(counter, module)
    table = CostTable({}, [1, 2048], [1000.0, 1585.0])
    prompt, runs = [5, 6, 7, 8], 1500
    sampling = [SamplingParams(1.0, seed=seed) for seed in range(runs)]
    # drafting priced at zero: in a batch of 1500 a block that costs anything cannot raise the whole
    # forward's throughput, and this test is about the cut, not about whether to draft
    policy = AutoBudget(table, max_budget=BLOCK, draft_ms_per_token=0.0)
    results = run(counter, [prompt] * runs, drafter, 4, sampling, (), policy).finish()
    drafted = sum(r.stats.drafted_tokens for r in results)
    assert sum(r.stats.accepted_tokens for r in results) > 0.1 * runs
    assert 0 < drafted < 0.75 * BLOCK * sum(r.stats.steps for r in results)  # the scheduler cut blocks
    assert min(token_marginal_pvalues(counter, prompt, results)) > 1e-3


class BackboneQ(WrongQ):
    """Samples tokens from the exact q but reports the backbone's q WITHOUT the sequential bias."""

    def for_sequence(self):
        return BackboneQ(self.inner.for_sequence())

    @torch.inference_mode()
    def propose(self, ctx, budget):
        draft = self.inner.propose(ctx, budget)
        if draft.draft_probs is None:
            return draft
        inner = self.inner
        hidden = inner.runner.block_rows(ctx.tokens[-1], len(draft))
        base = warp_logits_to_probs(inner.heads.project(hidden, inner.vocab.parts).float(), ctx.sampling)
        return Draft.chain(draft.tokens, torch.stack([inner.vocab.full_probs(row) for row in base]), draft.confidences)


def test_sampled_blocks_keep_the_target_distribution(counter, trained):
    """Temperature 1: tokens are sampled left to right from the exact q (the bias given the token
    sampled before); outputs follow the target exactly. The same test fails a drafter that reports
    the backbone's q without the sequential bias (a module with a strong bias, so the two differ)."""
    drafter = DSparkDrafter(counter, checkpoint=str(trained[0]))
    prompt, runs = [5, 6, 7, 8], 1500
    sampling = [SamplingParams(1.0, seed=seed) for seed in range(runs)]
    results = generate_batch(counter, [prompt] * runs, drafter, max_new_tokens=4, sampling=sampling)
    assert sum(r.stats.accepted_tokens for r in results) > 0.1 * runs
    assert min(token_marginal_pvalues(counter, prompt, results)) > 1e-3
    strong = build_heads("dspark", counter, BLOCK, block_size=BLOCK, num_draft_layers=2, markov_rank=8)
    strong.load_state_dict(trained[2].state_dict())
    with torch.no_grad():
        strong.sequential.markov_head.markov_w2.weight.normal_(0, 3.0)
    wrong = generate_batch(counter, [prompt] * 500, BackboneQ(DSparkDrafter.from_module(counter, strong)), max_new_tokens=4,
                           sampling=sampling[:500])
    assert min(token_marginal_pvalues(counter, prompt, wrong)) < 1e-6


def test_export_is_deepspec_layout_and_loads_back(counter, trained, tmp_path):
    """DeepSpec's Qwen3DSparkModel checkpoints: the DFlash backbone names, markov_head.markov_w1 [V, r],
    markov_head.markov_w2 [V, r], confidence_head.proj [1, H + r] (+ bias), embed_tokens / lm_head,
    and config keys block_size, mask_token_id, target_layer_ids, markov_rank, markov_head_type,
    enable_confidence_head, confidence_head_with_markov (read in their modeling/dspark code)."""
    checkpoint, _, module, report = trained
    export_dspark(module, counter, tmp_path / "fp32", dtype="float32")
    tensors = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    hidden, vocab, rank = counter.hidden_size, counter.vocab_size, 8
    assert tuple(tensors["markov_head.markov_w1.weight"].shape) == (vocab, rank)
    assert tuple(tensors["markov_head.markov_w2.weight"].shape) == (vocab, rank)
    assert tuple(tensors["confidence_head.proj.weight"].shape) == (1, hidden + rank)
    assert tuple(tensors["confidence_head.proj.bias"].shape) == (1,)
    assert tuple(tensors["embed_tokens.weight"].shape) == tuple(tensors["lm_head.weight"].shape) == (vocab, hidden)
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight"} <= set(tensors)
    assert not any(name.startswith("sequential.") for name in tensors)
    config = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["block_size"] == BLOCK
    assert config["target_layer_ids"] == [layer - 1 for layer in module.input_layers]
    assert (config["markov_rank"], config["markov_head_type"]) == (rank, "vanilla")
    assert config["enable_confidence_head"] is True and config["confidence_head_with_markov"] is True
    assert config["mask_token_id"] == module.mask_token_id and config["num_target_layers"] == counter.num_layers
    assert config["confidence_temperatures"] == pytest.approx(report["temperatures"])

    loaded = load_dspark_export(tmp_path / "fp32", counter)
    for name, tensor in module.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    from_checkpoint = DSparkDrafter(counter, checkpoint=str(checkpoint), draft_vocab=0)
    from_export = DSparkDrafter(counter, checkpoint=str(tmp_path / "fp32"))
    for prompt in ([5, 6, 7, 8], [20, 21, 22]):
        for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
            a = first_proposal(from_checkpoint, counter, prompt, BLOCK, sampling)
            b = first_proposal(from_export, counter, prompt, BLOCK, sampling)
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.confidences, b.confidences)
            assert (a.draft_probs is None) == (b.draft_probs is None)
            if a.draft_probs is not None:
                assert torch.equal(a.draft_probs, b.draft_probs)
    export_dspark(module, counter, tmp_path / "bf16")
    bf16 = DSparkDrafter(counter, checkpoint=str(tmp_path / "bf16"))
    assert generate(counter, [5, 6, 7, 8], bf16, max_new_tokens=20).tokens == generate(counter, [5, 6, 7, 8], max_new_tokens=20).tokens


def test_bad_dspark_inputs_are_clear_errors(counter, trained, smollm2, tmp_path):
    export_dspark(trained[2], counter, tmp_path / "export", dtype="float32")
    with pytest.raises(ValueError, match="does not fit target"):
        DSparkDrafter(smollm2, checkpoint=str(tmp_path / "export"))
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    (tmp_path / "export" / "config.json").write_text(json.dumps({**config, "markov_head_type": "gated"}))
    with pytest.raises(ValueError, match="gated"):
        DSparkDrafter(counter, checkpoint=str(tmp_path / "export"))
    with pytest.raises(ValueError, match="checkpoint=DIR"):
        DSparkDrafter(counter)
    with pytest.raises(ValueError, match="unknown DSpark sequential head"):
        build_heads("dspark", counter, 4, sequential_head="lstm")
    with pytest.raises(ValueError, match="ce_weight"):
        build_heads("dspark", counter, 4, ce_weight=0)


def test_the_cross_entropy_weight_is_stored_and_read_back(counter, trained):
    """--ce-weight (DeepSpec's 0.1 by default) is stored in the checkpoint's head config and read back."""
    heads = build_heads("dspark", counter, 4, ce_weight=1.0)
    assert heads.head_config()["ce_weight"] == 1.0 and "ce_weight" not in trained[2].head_config()
    assert type(heads).from_config(heads.head_config(), counter.config).ce_weight == 1.0


def test_dspark_cli_end_to_end(counter, tmp_path, capsys):
    """train data --for dflash -> train dspark (killed and resumed; calibrated at the end) -> export ->
    generate with the checkpoint and the export, greedy output equal to plain."""
    from specdec.cli import main

    model_dir = str(counter.model_dir)
    data, ckpt, export = str(tmp_path / "data"), str(tmp_path / "ckpt"), str(tmp_path / "export")
    assert main(["train", "data", "--model", model_dir, "--out", data, "--num-prompts", "6", "--max-new-tokens", "24",
                 "--shard-size", "3", "--for", "dflash", "--draft-layers", "2", "--prompt-mix", "conversation=1",
                 "--no-progress"]) == 0
    train_args = ["train", "dspark", "--model", model_dir, "--data", data, "--out", ckpt, "--block-size", "3",
                  "--draft-layers", "2", "--markov-rank", "4", "--steps", "4", "--batch-size", "2", "--no-progress"]
    assert main(train_args) == 0
    train_args[train_args.index("--steps") + 1] = "6"
    assert main(train_args + ["--resume"]) == 0
    printed = capsys.readouterr().out
    assert "survival ECE per position before" in printed and "held-out tau" in printed
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["head"]["kind"] == "dspark" and config["training"]["steps"] == 6
    assert len(config["calibration"]["temperatures"]) == 3
    assert main(["export", ckpt, export]) == 0
    assert json.loads((tmp_path / "export" / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    capsys.readouterr()
    for checkpoint in (ckpt, export):
        assert main(["generate", "!#%'", "--model", model_dir, "--drafter", "dspark", "--drafter-arg",
                     f"checkpoint={checkpoint}", "--max-new-tokens", "12", "--temperature", "0"]) == 0
    assert main(["generate", "!#%'", "--model", model_dir, "--max-new-tokens", "12", "--temperature", "0"]) == 0
    outputs = capsys.readouterr().out.strip().splitlines()
    assert outputs[0] == outputs[1] == outputs[2]


def test_the_parts_script_reads_each_part_of_q(counter, dspark_data, trained, capsys):
    """scripts/dspark_parts.py: top-1 per position of the exact q, the backbone and the sequential bias."""
    import runpy
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "dspark_parts.py"
    main = runpy.run_path(str(script))["main"]
    main(["--checkpoint", str(trained[0]), "--data", str(dspark_data), "--model", str(counter.model_dir)])
    lines = {line.split("  ")[1].strip(): [float(x) for x in line.split()[-BLOCK:]]
             for line in capsys.readouterr().out.splitlines() if line.startswith("  ")}
    assert set(lines) == {"exact q", "backbone", "sequential bias"}
    assert lines["exact q"][0] > 0.8  # the counter's blocks are learnt (test_training_learns_blocks...)
    assert all(0.0 <= rate <= 1.0 for rates in lines.values() for rate in rates)


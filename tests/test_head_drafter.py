"""The head drafters' one base (specdec.drafters.head_drafter): one constructor for a checkpoint and
an in-memory module, and one check of the module a drafter runs."""

import pytest
import torch

from specdec import SamplingParams
from specdec.drafters import make_drafter, registered_drafters
from specdec.drafters.base import DraftContext
from specdec.drafters.head_drafter import HeadDrafter
from specdec.heads import HEAD_TYPES, build_heads, save_checkpoint, target_description
from specdec.verify import VerifyResult

# kind -> (head positions, build options); small modules on the tiny Llama (vocabulary 97)
MODULES = {
    "medusa": (3, {}),
    "mtp-parallel": (3, {}),
    "mtp-sequential": (3, {}),
    "eagle1": (3, {}),
    "eagle3": (3, {"draft_vocab_size": 50}),
    "dflash": (4, {"block_size": 5, "num_draft_layers": 2}),
    "dspark": (4, {"block_size": 4, "num_draft_layers": 2, "markov_rank": 8}),
}
RANKED = list(range(60, 10, -1))  # a label ranking: the draft vocabulary of a checkpoint
RANK_ACC = [[0.7 * 0.6**depth * 0.5**rank for rank in range(10)] for depth in range(3)]


def random_module(kind, target, seed=0):
    """A module with random weights around its initialisation (so drafts differ from token to token)."""
    positions, options = MODULES[kind]
    module = build_heads(kind, target, positions, **options)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return module.eval()


def proposals(drafter, target, prompt, sampling):
    """begin + the prompt's hidden rows -> three proposals of 4 nodes, each after the previous one's
    first token was committed (as the loop would drive it)."""
    drafter = drafter.for_sequence()
    drafter.begin(prompt[:-1], target)
    cache, tokens, drafts = target.new_cache(1, 64), list(prompt), []
    generator = torch.Generator().manual_seed(7)
    fed = tokens[:-1]  # the root is committed but not cached
    for _ in range(3):
        _, hiddens = target.forward(torch.tensor([fed]), torch.arange(len(tokens) - 1 - len(fed), len(tokens) - 1)[None],
                                    cache, hidden_layers=drafter.hidden_layers)
        ctx = DraftContext(list(tokens), len(prompt) - 1, sampling, generator)
        ctx.new_hidden = {layer: rows[0] for layer, rows in hiddens.items()}
        drafter.on_verified(VerifyResult([tokens[-1]], 0, []), ctx)
        draft = drafter.propose(ctx, 4)
        drafts.append(draft)
        fed = [tokens[-1]]
        tokens.append(int(draft.tokens[0]))
    return drafts


@pytest.mark.parametrize("kind", list(MODULES))
def test_a_checkpoint_and_the_same_module_in_memory_draft_alike(tiny_target, tmp_path, kind):
    """Both ways to build a head drafter end in one constructor: the same vocabulary, cost and drafts."""
    module = random_module(kind, tiny_target)
    extra = {"draft_vocab": {"ids": RANKED}, "eval": {"rank_acc": RANK_ACC}}
    checkpoint = save_checkpoint(tmp_path / kind, module, target_description(tiny_target), extra)
    name = HEAD_TYPES[kind].drafter
    options = {} if kind == "eagle3" else {"draft_vocab": 40}  # EAGLE-3 drafts over its own vocabulary
    loaded = make_drafter(name, tiny_target, checkpoint=str(checkpoint), **options)
    in_memory = registered_drafters()[name].from_module(tiny_target, module, rank_acc=RANK_ACC, draft_vocab_ids=RANKED,
                                                        **options)
    assert isinstance(loaded, HeadDrafter) and type(in_memory) is type(loaded)
    assert loaded.cost == in_memory.cost and loaded.hidden_layers == in_memory.hidden_layers
    assert torch.equal(loaded.vocab.ids, in_memory.vocab.ids)
    if options:
        assert loaded.vocab.ids.tolist() == RANKED[:40]
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0, seed=3)):
        for prompt in ([5, 6, 7, 8], [20, 21, 22, 40, 41]):
            for a, b in zip(proposals(loaded, tiny_target, prompt, sampling), proposals(in_memory, tiny_target, prompt, sampling)):
                assert a.num_nodes > 0 and torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
                assert (a.draft_probs is None) == (b.draft_probs is None) == (sampling.greedy or kind == "medusa")
                assert a.draft_probs is None or torch.equal(a.draft_probs, b.draft_probs)
                assert (a.confidences is None) == (kind != "dspark")
                assert a.confidences is None or torch.equal(a.confidences, b.confidences)


def test_a_module_of_another_drafter_is_refused_with_the_drafter_that_runs_it(tiny_target):
    drafters = registered_drafters()
    for kind, head_type in HEAD_TYPES.items():
        module = random_module(kind, tiny_target)
        runs_it = head_type.drafter
        assert type(drafters[runs_it].from_module(tiny_target, module, draft_weights="fp32")) is drafters[runs_it]
        for name in {head_type.drafter for head_type in HEAD_TYPES.values()} - {runs_it}:
            with pytest.raises(ValueError, match=f"the {name} drafter runs .* got '{kind}' \\(run it with the {runs_it} drafter\\)"):
                drafters[name].from_module(tiny_target, module)


def test_int8_draft_weights_are_made_at_load_not_in_the_first_draft(tiny_target, monkeypatch):
    """With int8 draft weights (the default) every linear of the module gets its int8 copy when the
    drafter is built: a request's first draft (on the 1.5B, 0.3-0.7 s of quantising EAGLE-3's
    106 M parameters) pays none of it. Greedy output stays plain's."""
    from specdec import generate
    from specdec.drafters.eagle import Eagle3Drafter
    from specdec.kernels import backends, make_backend

    if make_backend("auto").backend.name == "torch":
        pytest.skip("no compiled kernel here: draft weights stay fp32 in torch")
    made = []
    quantize = backends.quantize_int8
    monkeypatch.setattr(backends, "quantize_int8", lambda weight, *args: made.append(weight.shape) or quantize(weight, *args))
    model = Eagle3Drafter.from_module(tiny_target, random_module("eagle3", tiny_target), draft_vocab_ids=RANKED)
    linears = [module for module in model.heads.modules() if isinstance(module, torch.nn.Linear)]
    assert model.linear_backend == "int8" and sorted(made) == sorted(linear.weight.shape for linear in linears)
    prompt = [5, 6, 7, 8, 9]
    result = generate(tiny_target, prompt, model, max_new_tokens=8)
    assert result.tokens == generate(tiny_target, prompt, None, max_new_tokens=8).tokens
    assert result.stats.drafted_tokens > 0 and len(made) == len(linears)  # nothing quantised while drafting

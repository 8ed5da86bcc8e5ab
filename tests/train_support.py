"""Shared by the training tests (test_train.py, test_train_data.py) and the trained-drafter tests
(test_eagle.py, test_dflash.py, test_dspark.py, test_prompts.py): a tiny target whose greedy output
is known, its self-distilled data, one proposal as the loop would drive it, and the exact token
marginals a sampled drafter's outputs must follow.

The tiny target is a "counter": its embeddings / LM head are set so that greedy decoding walks
the cycle 3, 4, ..., V - 1, 3, ... (its blocks are random but small). Its self-distilled answers are
therefore a repetitive deterministic pattern that heads can learn in a few hundred steps, while
the blocks still make the hidden states (and the heads' job) non-trivial.
"""

import random

import torch
from conftest import make_tiny_hf_dir
from scipy.stats import chisquare

from specdec import SamplingParams
from specdec.drafters.base import DraftContext
from specdec.models.llama import load_native
from specdec.train import DataSettings, build_dataset
from specdec.train.prompts import PromptItem
from specdec.verify import VerifyResult

VOCAB = 24
FIRST_CYCLE_TOKEN = 3  # 0 = <s>, 1 and 2 are EOS ids of the tiny tokenizer / generation config
AGREEMENT_LIMIT = 0.9  # held-out top-1 agreement of head 1 after training
FLOAT16_REL = 2e-3  # stored hidden states are float16 (each value rounded to 2^-11 of itself) from batched forwards


def make_counter_target(path, seed: int = 0, logit_gap: float = 2.5, **overrides):
    """A tiny Llama whose greedy output is the cycle 3..V-1 (p(next in cycle) ~ 0.25 at temperature 1);
    `overrides`: config fields (e.g. a head_dim vLLM's CPU attention supports)."""
    _, model = make_tiny_hf_dir(path, "llama", seed=seed, vocab_size=VOCAB, **overrides)
    hidden_size = model.config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        codes = torch.linalg.qr(torch.randn(hidden_size, hidden_size, generator=generator))[0][:VOCAB]  # [V, H]
        successor = [FIRST_CYCLE_TOKEN if t < FIRST_CYCLE_TOKEN or t == VOCAB - 1 else t + 1 for t in range(VOCAB)]
        lm_head = torch.zeros(VOCAB, hidden_size)
        for token, following in enumerate(successor):
            lm_head[following] += codes[token]
        model.model.embed_tokens.weight.copy_(codes * 4)
        model.lm_head.weight.copy_(lm_head * logit_gap / hidden_size**0.5)
        for layer in model.model.layers:  # keep the blocks, but small: the cycle stays the argmax
            layer.self_attn.o_proj.weight.mul_(0.05)
            layer.mlp.down_proj.weight.mul_(0.05)
    model.save_pretrained(path)
    return load_native(path, name=f"counter-{seed}")


def text_prompts(count: int, seed: int) -> list[PromptItem]:
    """Short prompts in the tiny char tokenizer's alphabet (ids 3..V-1 are chr(33)..chr(30 + V - 1))."""
    rng = random.Random(seed)
    return [
        PromptItem("".join(chr(30 + rng.randrange(FIRST_CYCLE_TOKEN, VOCAB)) for _ in range(rng.randrange(2, 6))), "self-instruct")
        for _ in range(count)
    ]


def counter_selfdistill_data(counter, out, layers=None):
    """16 greedy self-distilled answers of the counter in shards of 8 (`layers`: the hidden layers
    to store, default the heads' own); the data every trainer test in this suite learns from."""
    settings = DataSettings(num_prompts=16, max_new_tokens=40, shard_size=8, sampled_fraction=0.0, layers=layers)
    build_dataset(counter, out, settings, prompts=text_prompts(16, seed=0), progress=False, log=lambda _: None)
    return out


def first_proposal(drafter, target, prompt: list[int], budget: int, sampling=SamplingParams()):
    """begin + prefill hidden rows -> propose, as the loop would drive it (root = prompt[-1])."""
    cached = prompt[:-1]
    _, hiddens = target.forward(torch.tensor([cached]), torch.arange(len(cached))[None], target.new_cache(1, 64),
                                hidden_layers=drafter.hidden_layers)
    ctx = DraftContext(list(prompt), len(prompt) - 1, sampling, torch.Generator().manual_seed(7))
    ctx.new_hidden = {layer: h[0] for layer, h in hiddens.items()}
    drafter.begin(cached, target)
    drafter.on_verified(VerifyResult([prompt[-1]], 0, []), ctx)
    return drafter.propose(ctx, budget)


def _exact_token_marginals(target, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact target distributions of output tokens 2 and 3 at temperature 1: [V + 1] each, last = ended (EOS before)."""
    eos = target.eos_token_ids

    def next_probs(contexts: torch.Tensor) -> torch.Tensor:  # [n, T] -> [n, V]
        rows, width = contexts.shape
        logits, _ = target.forward(contexts, torch.arange(width).expand(rows, -1), target.new_cache(rows, width))
        return torch.softmax(logits[:, -1].double(), -1)

    first = next_probs(torch.tensor([prompt]))[0]  # [V]
    tokens = torch.arange(VOCAB)
    second = next_probs(torch.cat([torch.tensor(prompt).expand(VOCAB, -1), tokens[:, None]], 1))  # [V(x1), V]
    pairs = torch.cartesian_prod(tokens, tokens)  # [V*V, 2] (x1, x2)
    third = next_probs(torch.cat([torch.tensor(prompt).expand(VOCAB * VOCAB, -1), pairs], 1)).view(VOCAB, VOCAB, VOCAB)
    alive1 = first.clone()
    alive1[eos] = 0.0  # runs whose token 1 is EOS have no token 2
    marginal2 = torch.cat([alive1 @ second, first[eos].sum()[None]])  # [V + 1]
    joint12 = alive1[:, None] * second  # [V, V]
    ended = first[eos].sum() + joint12[:, eos].sum()
    joint12[:, eos] = 0.0
    marginal3 = torch.cat([torch.einsum("ab,abc->c", joint12, third), ended[None]])  # [V + 1]
    return marginal2, marginal3


def token_marginal_pvalues(target, prompt: list[int], results) -> list[float]:
    """Chi-square p-values of output tokens 2 and 3 of `results` (runs of `prompt` at temperature 1)
    against the target's exact marginals; an outcome impossible under the target gives p = 0."""
    pvalues = []
    for position, expected in zip((1, 2), _exact_token_marginals(target, prompt)):
        observed = torch.zeros(VOCAB + 1)
        for result in results:
            observed[result.tokens[position] if len(result.tokens) > position else VOCAB] += 1
        expected = expected.float() * len(results)
        if observed[expected == 0].sum() > 0:  # something impossible under the target appeared
            pvalues.append(0.0)
            continue
        big = expected >= 5  # merge rare outcomes into one bin so the chi-square test is valid
        rare = expected[~big].sum()
        obs = torch.cat([observed[big], observed[~big].sum()[None]]) if rare > 0 else observed[big]
        exp = torch.cat([expected[big], rare[None]]) if rare > 0 else expected[big]
        pvalues.append(float(chisquare(obs.numpy(), exp.numpy() * float(obs.sum()) / float(exp.sum())).pvalue))
    return pvalues

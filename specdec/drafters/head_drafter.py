"""The base of the trained-head drafters: medusa, mtp, eagle1, eagle3, dflash, dspark.

Each runs a small trained module (specdec.heads) on the frozen target's hidden states, and they
share one skeleton, kept here:

* One way to build. `Drafter(target, checkpoint=DIR, **options)` loads the module from a
  checkpoint (or a public export layout the drafter reads); `Drafter.from_module(target, module,
  **options)` wraps a module already in memory (the trainers' evaluation, tests) in a
  `HeadCheckpoint` and calls the same constructor, so both end in `HeadDrafter.__init__`: the
  module's kind checked, the draft vocabulary chosen, the draft linears put on the CPU kernel.
  Each drafter's `__init__` names its options (`drafter_options` reads them from its signature).
* One runner protocol (`HeadRunner`): per sequence, what the module keeps of the committed
  positions (a KV cache, the newest state). The loop's hidden rows go to `receive`; `ready`
  says a draft can be made; `pending` counts rows held but not yet fed (the catch-up cost);
  `chain` drafts left to right. The runners are in `head_runners.py`, one per module family.
* One picks -> Draft path. A chain is picked token by token by `chain_chooser` (argmax, or a
  sample from the warped q whose full-vocabulary row goes to verification) through a
  `ChainPicks`, which turns its picks into the `Draft`; a static top-k tree (Medusa, MTP parallel)
  is `tree_draft`; EAGLE-2's dynamic tree is `draft.ScoredTree` (shared with small-model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Protocol

import torch
from torch import nn

from ..draft import Draft, TreeTemplate
from ..heads import DraftVocab, FrozenTargetParts, draft_linears, load_checkpoint
from ..sampling import sample_from_probs, warp_logits_to_probs
from .base import DraftContext, Drafter, registered_drafters

DEFAULT_DRAFT_VOCAB = 8192  # most frequent training labels whose LM-head rows drafting computes (0 = all)
CACHE_HEADROOM = 64  # positions a runner's cache grows by beyond what it needs now (fewer re-allocations)

Pick = tuple[int, "torch.Tensor | None"]  # (token id, the q row [V] it was drawn from; None = a deterministic pick)
Choose = Callable[[torch.Tensor], Pick]  # draft logits [V'] (over the draft vocabulary) -> the pick


def chain_chooser(vocab: DraftVocab, ctx: DraftContext, sample: bool) -> Choose:
    """How a chain drafter picks each token: argmax (greedy, or sample=False: a deterministic
    proposal) or a sample from the warped q, whose full-vocabulary row goes to verification."""
    if ctx.sampling.greedy or not sample:
        return lambda logits: (vocab.token(logits.argmax()), None)

    def sample_token(logits: torch.Tensor) -> Pick:
        draft_probs = warp_logits_to_probs(logits, ctx.sampling)  # [V']: q, the same warp as the target
        return vocab.token(sample_from_probs(draft_probs, ctx.generator)), vocab.full_probs(draft_probs)  # q over [V]

    return sample_token


class ChainPicks:
    """A chain's picks, in order, as a `Choose`: each call picks with `choose` and records the pick;
    `draft()` is the chain they make (draft_probs: the q rows, None for deterministic picks)."""

    def __init__(self, choose: Choose):
        self.choose = choose
        self.picks: list[Pick] = []

    def __call__(self, logits: torch.Tensor) -> Pick:
        pick = self.choose(logits)
        self.picks.append(pick)
        return pick

    def draft(self, confidences: torch.Tensor | None = None) -> Draft:
        """The chain [root ->] picks[0] -> picks[1] ...; confidences [K] when the drafter scores its positions."""
        tokens = torch.tensor([token for token, _ in self.picks], dtype=torch.long)
        if self.picks[0][1] is None:
            return Draft.chain(tokens, None, confidences)
        return Draft.chain(tokens, torch.stack([q for _, q in self.picks]), confidences)  # [K, V]


def tree_draft(template: TreeTemplate, logits: torch.Tensor, vocab: DraftVocab) -> Draft:
    """A static top-k tree: logits [D, V'] over the draft vocabulary, one row per depth; node i takes
    the rank_i-th best token of its depth. A deterministic proposal (draft_probs None)."""
    candidates = [vocab.tokens(logits[depth].topk(k).indices) for depth, k in enumerate(template.topk_per_depth)]
    tokens = [candidates[depth - 1][rank] for depth, rank in zip(template.depths, template.ranks)]
    return Draft(torch.tensor(tokens, dtype=torch.long), template.parents_tensor(), None)


def new_hidden_rows(ctx: DraftContext, layers: tuple[int, ...], cached: int) -> tuple[torch.Tensor | None, int]:
    """(the target rows [n, H * len(layers)] just cached, layers concatenated in order; their first
    position), checked against the drafter's cache."""
    parts = [ctx.new_hidden.get(layer) for layer in layers]
    if any(rows is None for rows in parts) or parts[0].shape[0] == 0:
        return None, cached
    start = len(ctx.tokens) - 1 - parts[0].shape[0]  # the root (last token) is not cached yet
    if start != cached:
        raise RuntimeError(f"drafter out of sync: {cached} positions cached, new target rows start at {start}")
    return torch.cat(parts, dim=-1), start


def cost_per_token(module: nn.Module, target, vocab: DraftVocab, tokens_per_module_read: int = 1,
                   own_lm_head: bool = False) -> float:
    """A drafted token's cost in target decode steps: the weights it reads / the target's weights.

    A token reads the module's weights once per `tokens_per_module_read` tokens (Medusa: one of K
    heads; DFlash: one forward for the whole block) and the LM-head rows of the draft vocabulary
    (none when the module has its own head: EAGLE-3)."""
    target_params = sum(p.numel() for p in target.model.parameters())
    module_params = sum(p.numel() for p in module.parameters())
    lm_rows = 0 if own_lm_head else vocab.rows * target.hidden_size
    return (module_params / tokens_per_module_read + lm_rows) / max(1, target_params)


def check_flag(name: str, value) -> bool:
    """`value` when it is a bool; a boolean drafter option given as anything else is an error."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


class HeadRunner(Protocol):
    """Per-sequence state of a head drafter's module over the committed positions (head_runners.py).

    Built at `begin` as runner_type(module, vocab, target, prompt_len); `vocab.parts` gives the
    target's embeddings and the draft vocabulary's LM-head rows."""

    def receive(self, ctx: DraftContext) -> None:
        """The target's hidden rows of the tokens that just entered its cache (`ctx.new_hidden`):
        fed through the module now, or held until the next draft."""

    def ready(self) -> bool:
        """Whether a draft can be made (the runner has the newest committed position)."""

    def pending(self) -> int:
        """Rows received but not yet fed through the module: the next draft's catch-up work."""

    def chain(self, ctx: DraftContext, length: int, choose: Choose) -> None:
        """Draft `length` tokens left to right rooted at ctx.tokens[-1]; `choose` picks each from its
        logits [V'] over the draft vocabulary (what it picks conditions the next, where the module
        reads it). Leaves the runner as it was: only verified positions stay cached."""


@dataclass
class HeadCheckpoint:
    """A drafter's module and its checkpoint config, loaded from a directory or handed over in memory."""

    module: nn.Module  # in the target's dtype and device, in eval mode
    config: dict = field(default_factory=dict)  # "draft_vocab": {"ids": ranked labels}, "eval": {"rank_acc": ...}


def held_out_top1(config: dict) -> float | None:
    """Depth-1 top-1 agreement with the target on held-out data, from a checkpoint's eval: on the
    target's greedy path when recorded (what greedy verification accepts), else over all rows."""
    held_out = config.get("eval") or {}
    if held_out.get("top1_greedy_path"):
        return float(held_out["top1_greedy_path"][0])
    rank_acc = held_out.get("rank_acc")
    return float(rank_acc[0][0]) if rank_acc and rank_acc[0] else None


class HeadDrafter(Drafter):
    """A trained module on the frozen target's hidden states, run per sequence by a `HeadRunner`.

    Subclasses name their options in `__init__` and call this one first; they set `cost` and, when
    they draft anything but a chain of `chain_length(budget)` tokens, override `draft`."""

    # module class -> the runner that runs it (the modules a drafter accepts, exactly these classes)
    runners: ClassVar[dict[type[nn.Module], type[HeadRunner]]] = {}
    reads_from_target: ClassVar[str] = "its LM head and hidden states"  # for the missing-target error
    # a public directory layout the drafter also reads (SGLang / vLLM / DeepSpec): recognise(path), load(path, target)
    is_export: ClassVar[Callable[[Path], bool] | None] = None
    load_export: ClassVar[Callable | None] = None

    def __init__(self, target, checkpoint: str | HeadCheckpoint | None, *, draft_vocab: int | None = None,
                 draft_weights: str = "int8", sample: bool = False):
        if target is None:
            raise ValueError(f"the {self.name} drafter needs the target ({self.reads_from_target})")
        loaded = checkpoint if isinstance(checkpoint, HeadCheckpoint) else self.load(target, checkpoint)
        self.check_module(loaded.module)
        self.sample = check_flag("sample", sample)
        self.target, self.heads, self.config = target, loaded.module, loaded.config
        self.held_out_acceptance = held_out_top1(self.config)
        self.vocab = self.draft_vocabulary(draft_vocab)
        self.linear_backend = draft_linears(self.heads, self.vocab, draft_weights)
        self.hidden_layers = tuple(self.heads.input_layers)
        self.runner: HeadRunner | None = None

    @classmethod
    def from_module(cls, target, module: nn.Module, rank_acc: list[list[float]] | None = None,
                    draft_vocab_ids: list[int] | None = None, **options) -> HeadDrafter:
        """A drafter around an in-memory module (e.g. right after training), without a checkpoint:
        `rank_acc` / `draft_vocab_ids` stand for the checkpoint's held-out hit rates and label ranking."""
        module = module.to(device=target.device, dtype=target.dtype).eval()
        config = {"eval": {"rank_acc": rank_acc}, "draft_vocab": {"ids": draft_vocab_ids}}
        return cls(target, checkpoint=HeadCheckpoint(module, config), **options)

    def load(self, target, checkpoint: str | None) -> HeadCheckpoint:
        if not checkpoint:
            raise ValueError(f"the {self.name} drafter needs checkpoint=DIR: train one with `specdec train {self.name}`")
        if self.is_export is not None and self.is_export(Path(checkpoint)):
            return HeadCheckpoint(self.load_export(checkpoint, target))
        return HeadCheckpoint(*load_checkpoint(checkpoint, target, drafter=self.name))

    def check_module(self, module: nn.Module) -> None:
        if type(module) in self.runners:
            return
        kinds = [kind.kind for kind in self.runners]
        kind = getattr(module, "kind", type(module).__name__)
        runs_it = [name for name, drafter in registered_drafters().items()
                   if issubclass(drafter, HeadDrafter) and type(module) in drafter.runners]
        hint = f" (run it with the {runs_it[0]} drafter)" if runs_it else ""
        raise ValueError(f"the {self.name} drafter runs {' or '.join(map(repr, kinds))} modules, got {kind!r}{hint}")

    def draft_vocabulary(self, size: int | None) -> DraftVocab:
        """The tokens drafts may hold: the first `size` of the checkpoint's label ranking (0: all)."""
        return DraftVocab.from_config(FrozenTargetParts.from_target(self.target), self.config, size)

    def begin(self, prompt_ids, target) -> None:
        self.runner = self.runners[type(self.heads)](self.heads, self.vocab, self.target, len(prompt_ids))

    @torch.inference_mode()
    def on_verified(self, result, ctx: DraftContext) -> None:
        self.runner.receive(ctx)

    def catch_up_tokens(self, ctx: DraftContext) -> int:
        return 0 if self.runner is None else self.runner.pending()

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        if self.runner is None or not self.runner.ready() or budget <= 0:
            return Draft.empty()
        return self.draft(ctx, budget)

    def draft(self, ctx: DraftContext, budget: int) -> Draft:
        """This step's draft (the runner is ready, budget >= 1); by default a chain."""
        picks = ChainPicks(chain_chooser(self.vocab, ctx, self.sample))
        self.runner.chain(ctx, self.chain_length(budget), picks)
        return picks.draft()

    def chain_length(self, budget: int) -> int:
        return budget

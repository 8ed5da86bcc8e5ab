"""`hybrid`: one draft tree per step from several sources, retrieval and a model drafter (SAMD's idea).

Each step the retrieval sources (`sources=suffix,pld,rest,bigram`, default suffix and pld: nearly free, deterministic proposals)
propose their candidates, which are merged on shared prefixes into one trie over token paths; the
optional model drafter (`model=small-model|eagle3|dspark|...`, its options in `model_options`)
then proposes into the budget the retrieval candidates leave, and the whole is ONE `Draft`
verified by the one tree verification (specdec.verify). Each node names its source
(`Draft.sources`), so `SpecStats` counts drafted and accepted nodes per source.

Scores and the cut. Every source has its own `AcceptanceTracker` (acceptance.py): per-depth acceptance
of the nodes it proposed, learnt from earlier steps' outcomes; a request's trackers start from each
source's outcomes over the drafter's earlier requests (`population`, shared by its copies), before any
from the model's checkpoint's held-out acceptance (`Drafter.held_out_acceptance`) when known. A node's score is its
source's path score at the node's depth (a merged node: the best of its sources'), which is
information from before this step's drafting. The step's candidates are ranked best first by score
(ties: shallower, then retrieval before the model): the retrieval nodes and the model's prospective
chain slots, a slot at depth d only when it could pay for its drafting, s_d > the model's price
(a drafted token's cost in target steps, against the ~one target step an accepted token saves:
`model_per_token` when given, else measured: the model's ms per node drafted in this hybrid,
decayed over its steps in this request, over the target's step ms that the cost model states,
`DraftContext.step_ms`; the model's own `cost.per_token` until both are known). A step holds a prefix of that ranking. Under `--gamma
auto` the policy sees the ranking before drafting (`offered_paths`: retrieval nodes at price 0,
model slots at the model's price) and keeps the prefix that earns the most tokens per ms with every
node's drafting and verify cost priced, so a model slot enters only when it pays for both, and a
model drafter that does not pay never switches the free matches off; with a fixed gamma the step
holds the first gamma. The model runs only when at least one of its slots is in the prefix, asked
for exactly that many nodes. Its catch-up (the rows or tokens its own cache has not fed: the
prompt before its first run) is the hybrid's `catch_up_tokens`: the policy drafts model slots only
when they repay it, else the free matches alone.

Why the merged tree stays exact (the rule of specdec.verify relied on): verify_tree tries a node's
children in node order against the current residual, and a child's `draft_probs` row must be the
distribution its token was drawn from given everything the verifier saw before trying it. A
deterministic proposal (a function of the committed context) carries a one-hot row (accept with
p(x), then remove x: the `draft_probs=None` rule), so it may stand before or after sampled
siblings. A sampled model node keeps the row it was drawn from, and the tree around it may not
depend on its value: the model's budget is fixed before it drafts, its sampled nodes are all kept
(its own tree is exact by ScoredTree's rules), and they are never merged with a retrieval node of
the same token (that would drop the node's q, or its presence would depend on its value:
tests/test_hybrid.py plants that merge and the distribution test catches it). Greedy or
`sample=false` model drafts are deterministic, so they merge on shared prefixes like retrieval.
"""

from __future__ import annotations

import copy
import re
import time
from dataclasses import dataclass, field

import torch

from ..acceptance import AcceptanceTracker
from ..checks import check_int
from ..draft import Draft
from .base import DraftContext, DraftCost, Drafter, drafter_class, drafter_options, register_drafter, retrieval_sources

# bigram (`sources=suffix,pld,bigram`) drafts one token where suffix and pld find no longer match: on
# the 1.5B dev subset it added ~2 % to the hybrid, but auto with it served 4 users at 0.96-0.98x plain
# (without it 0.98-1.01x): no gain under load, so it is opt-in (docs/architecture.md)
DEFAULT_SOURCES = ("suffix", "pld")


def sub_drafter_options(name: str, raw: str | dict | None) -> dict:
    """A source's options: a dict (the API: any values, e.g. a loaded `draft_target`) or one string
    of KEY=VALUE pairs separated by commas or semicolons (the CLI: `model_options=draft_model=x,gamma=3`;
    a bench method, whose list is comma-separated: `hybrid:model_options=gamma=3;tree=true`; a piece
    without `=` continues the previous value, so list values keep their commas), parsed like
    `--drafter-arg`s of that drafter."""
    if raw is None or raw == "":
        return {}
    if isinstance(raw, dict):
        return dict(raw)
    if not isinstance(raw, str):
        raise ValueError(f"{name} options must be KEY=VALUE,... or a dict, got {raw!r}")
    pairs: list[str] = []
    for piece in re.split("[,;]", raw):
        if "=" in piece or not pairs:
            pairs.append(piece)
        else:
            pairs[-1] += "," + piece
    return drafter_options(name, pairs)


@dataclass
class CandidateNode:
    token: int
    parent: int  # trie index of the parent, -1 = the root
    depth: int
    sources: list[int]  # indices of the sources that proposed it, first = the one it is credited to
    score: float  # the best of its sources' path scores at its depth (pre-draft information)
    row: torch.Tensor | None = None  # [V] q it was sampled from; None = deterministic


@dataclass
class CandidateTrie:
    """The step's candidates over token paths: deterministic drafts merge on shared prefixes, a
    sampled draft's nodes are appended as they are (never merged: see the module docstring)."""

    nodes: list[CandidateNode] = field(default_factory=list)
    index: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> deterministic node

    def add(self, draft: Draft, source: int, depth_scores: list[float]) -> list[int]:
        """Insert `draft`'s nodes credited to `source` (scores by depth); returns their trie indices."""
        sampled = draft.draft_probs is not None
        placed: list[int] = []
        for node, (token, parent) in enumerate(zip(draft.tokens.tolist(), draft.parents.tolist())):
            parent = -1 if parent < 0 else placed[parent]
            depth = 1 if parent < 0 else self.nodes[parent].depth + 1
            score = depth_scores[depth - 1]
            found = None if sampled else self.index.get((parent, token))
            if found is None:
                found = len(self.nodes)
                self.nodes.append(CandidateNode(token, parent, depth, [source], score,
                                                draft.draft_probs[node] if sampled else None))
                if not sampled:
                    self.index[(parent, token)] = found
            else:
                merged = self.nodes[found]
                merged.sources.append(source)
                merged.score = max(merged.score, score)
            placed.append(found)
        return placed

    def to_draft(self, kept: set[int], names: list[str]) -> tuple[Draft, list[int]]:
        """The kept nodes as one Draft, and the trie node of each draft node: deterministic nodes best
        first (score, then depth: parents before children, siblings best first), then the sampled
        nodes in their drafter's order."""
        fixed = sorted((n for n in kept if self.nodes[n].row is None),
                       key=lambda n: (-self.nodes[n].score, self.nodes[n].depth, n))
        order = fixed + sorted(n for n in kept if self.nodes[n].row is not None)
        position = {node: i for i, node in enumerate(order)}
        chosen = [self.nodes[n] for n in order]
        parents = [-1 if node.parent < 0 else position[node.parent] for node in chosen]
        rows = [node.row for node in chosen if node.row is not None]
        draft_probs = None
        if rows:  # a mixed tree: deterministic nodes carry one-hot rows (the same rule as draft_probs None)
            draft_probs = torch.zeros(len(chosen), rows[0].shape[-1], dtype=rows[0].dtype)  # [N, V]
            for i, node in enumerate(chosen):
                if node.row is None:
                    draft_probs[i, node.token] = 1.0
                else:
                    draft_probs[i] = node.row
        credited = tuple(names[node.sources[0]] for node in chosen)
        draft = Draft(torch.tensor([node.token for node in chosen], dtype=torch.long),
                      torch.tensor(parents, dtype=torch.long), draft_probs, sources=credited)
        return draft, order


@dataclass
class DraftTiming:
    """Decayed sums of a model drafter's measured drafting: wall ms and the nodes it drafted."""

    ms: float = 0.0
    nodes: float = 0.0

    def add(self, ms: float, nodes: int, decay: float = 0.9) -> None:
        self.ms = decay * self.ms + ms
        self.nodes = decay * self.nodes + nodes

    def ms_per_node(self) -> float | None:
        return self.ms / self.nodes if self.nodes > 0 else None


@register_drafter
class HybridDrafter(Drafter):
    """One tree per step from retrieval sources and an optional model drafter (module docstring).

    Options:
        sources: retrieval drafters (suffix, pld, rest) separated by `,` or `+` (`+` in a bench
            method list), tried in this order (a node several propose is credited to the first);
            empty: the model alone; (API) a list of retrieval drafters already built.
        model: a model drafter's name (small-model, eagle3, dspark, ...), or (API) one already
            built; empty: retrieval only.
        suffix_options / pld_options / rest_options / model_options: that drafter's options,
            KEY=VALUE pairs separated by `,` or `;` (rest needs datastore=DIR), or a dict (API).
            A source drafts at most its own block (`gamma`) per step.
        gamma: draft nodes per step when no cost model decides.
        model_per_token: a model-drafted token's price in target steps, fixed (default: measured,
            see the module docstring); a model slot is a candidate only when its estimated path
            acceptance exceeds it (under `--gamma auto` it must also pay for its verify).
    """

    name = "hybrid"
    composite = True
    cost = DraftCost(block=8, trees=True)

    def __init__(self, target=None, sources: str = ",".join(DEFAULT_SOURCES), model: str = "", gamma: int = 8,
                 suffix_options: str | dict | None = None, pld_options: str | dict | None = None,
                 rest_options: str | dict | None = None, model_options: str | dict | None = None,
                 model_per_token: float | None = None):
        given = {"suffix": suffix_options, "pld": pld_options, "rest": rest_options}
        self.retrieval = self._retrieval_sources(target, sources, given)
        names = [drafter.name for drafter in self.retrieval]
        built = model if isinstance(model, Drafter) else None  # the API: a model drafter already built (shared weights)
        if built is not None and model_options:
            raise ValueError("model_options go with a model drafter's name, not with a built model drafter")
        model = built.name if built is not None else model
        model_class = drafter_class(model) if isinstance(model, str) and model else None
        if not isinstance(model, str) or (model_class is not None and (model_class.composite or model_class.retrieval_source)):
            raise ValueError(f"model must be a model drafter's name (small-model, eagle3, dspark, ...), got {model!r}")
        if not names and not model:
            raise ValueError("the hybrid drafter needs at least one source or a model")
        if model_options and not model:
            raise ValueError("model_options given without a model")
        if built is None and model:
            built = drafter_class(model)(target=target, **sub_drafter_options(model, model_options))
        self.model = built
        self.source_names = names + ([model] if model else [])
        if model_per_token is not None and (isinstance(model_per_token, bool) or not isinstance(model_per_token, (int, float))
                                            or not model_per_token >= 0):
            raise ValueError(f"model_per_token must be a number >= 0 (target steps), got {model_per_token!r}")
        self.model_per_token = None if model_per_token is None else float(model_per_token)  # None: measured
        prior = self.model_per_token if self.model_per_token is not None else self.model.cost.per_token if self.model else 0.0
        self.hidden_layers = tuple(self.model.hidden_layers) if self.model is not None else ()
        self.wants_node_logits = any(d.wants_node_logits for d in self.parts())
        # the prior of the auto policy's draft-cost measurement: the model's price when there is one
        self.cost = DraftCost(block=check_int("gamma", gamma, 1, 1024), per_token=prior, trees=True)
        # each source's outcomes over every request this drafter and its for_sequence() copies served (one
        # list, shared): a request's trackers start from them, so a source that is rarely right (bigram)
        # does not start every request at the default prior and buy verify rows it does not repay
        self.population = [AcceptanceTracker(decay=0.99) for _ in self.source_names]
        self._reset()

    @staticmethod
    def _retrieval_sources(target, sources: str | list[Drafter], given: dict) -> list[Drafter]:
        """The retrieval drafters: built from names (`sources`, with their `given` options) or, from the
        API, already built (shared with their owner, e.g. the auto drafter's arms)."""
        allowed = retrieval_sources()
        if isinstance(sources, list) and all(isinstance(drafter, Drafter) for drafter in sources):
            names, built = [drafter.name for drafter in sources], sources
        elif isinstance(sources, str):
            names, built = [name.strip() for name in re.split("[,+]", sources) if name.strip()], None
        else:
            raise ValueError(f"sources must be drafter names separated by ',' or '+', got {sources!r}")
        if any(name not in allowed for name in names) or len(set(names)) != len(names):
            raise ValueError(f"sources must be distinct names among {', '.join(allowed)}, got {sources!r}")
        for name, raw in given.items():
            if raw and (built is not None or name not in names):
                raise ValueError(f"{name}_options given but {name} is not among the sources {names} built here")
        return built or [drafter_class(name)(target=target, **sub_drafter_options(name, given.get(name))) for name in names]

    def parts(self) -> list[Drafter]:
        return self.retrieval + ([self.model] if self.model is not None else [])

    def _reset(self) -> None:
        # fresh objects (never cleared in place): for_sequence() copies share attributes until begin()
        self.trackers = [AcceptanceTracker(prior=self._starting_estimate(source)) for source in range(len(self.population))]
        self.last_step: tuple[CandidateTrie, list[int]] | None = None  # (trie, the trie node of each draft node)
        self.found: tuple[int, int, CandidateTrie] | None = None  # (committed tokens, limit, retrieval trie) of this step
        self.model_slots = True  # whether this step's ranking holds the model's slots (offered_paths' `paid`)
        # the model's drafting time in this request (per request, like the trackers: a slow outlier that
        # priced the model out is forgotten by the next request)
        self.model_timing = DraftTiming()

    def _starting_estimate(self, source: int) -> float:
        """Where a request's tracker for `source` starts: the population's estimate once earlier
        requests saw the source's outcomes; before that the model's checkpoint's held-out acceptance
        when known, else the default prior."""
        population = self.population[source]
        held_out = self.model.held_out_acceptance if source == len(self.retrieval) else None
        if not population.reached_weight and held_out is not None:
            return held_out
        return population.probs(1)[0]

    def for_sequence(self) -> HybridDrafter:
        fresh = copy.copy(self)
        fresh.retrieval = [drafter.for_sequence() for drafter in self.retrieval]
        fresh.model = None if self.model is None else self.model.for_sequence()
        fresh._reset()
        return fresh

    def begin(self, prompt_ids: list[int], target) -> None:
        self._reset()
        for drafter in self.parts():
            drafter.begin(prompt_ids, target)

    def on_verified(self, result, ctx: DraftContext) -> None:
        self._learn(result)
        self.found = None
        for drafter in self.parts():
            drafter.on_verified(result, ctx)

    def on_finished(self, result, ctx: DraftContext) -> None:
        for drafter in self.parts():
            drafter.on_finished(result, ctx)

    def model_price(self, ctx: DraftContext) -> float:
        """A model slot's price in target steps: `model_per_token` when given, else the model's measured
        ms per node over the target's step ms (`ctx.step_ms`), its own `cost.per_token` until both are known."""
        if self.model_per_token is not None:
            return self.model_per_token
        measured = self.model_timing.ms_per_node()
        if measured is None or not ctx.step_ms:
            return self.model.cost.per_token if self.model is not None else 0.0
        return measured / ctx.step_ms

    def catch_up_tokens(self, ctx: DraftContext) -> int:
        """The model's (the retrieval sources keep no model cache), paid by a step with model slots."""
        return 0 if self.model is None else self.model.catch_up_tokens(ctx)

    # ------------------------------------------------------------------ drafting
    def offered_paths(self, ctx: DraftContext, limit: int, paid: bool = True) -> list[tuple[float, float]]:
        """The step's ranking (`_ranking`), each node at its price: a retrieval node is found already
        (price 0), a model slot costs `model_price`. The budget policy keeps the prefix worth its
        drafting and verify cost, and `propose` fills exactly that prefix (Drafter.offered_paths);
        `paid=False` leaves the model's slots out of the ranking, this one and the proposal's."""
        self.model_slots = paid
        price = self.model_price(ctx)
        return [(score, price if from_model else 0.0)
                for score, from_model, _ in self._ranking(self._retrieval_trie(ctx, limit), limit, price)]

    def _retrieval_trie(self, ctx: DraftContext, limit: int) -> CandidateTrie:
        """The retrieval sources' candidates, merged; found once per step (a deterministic function
        of the committed tokens: the budget policy's look and the proposal see the same trie)."""
        if self.found is not None and self.found[0] == len(ctx.tokens) and self.found[1] >= limit:
            return self.found[2]
        trie = CandidateTrie()
        for source, drafter in enumerate(self.retrieval):
            draft = drafter.propose(ctx, min(limit, drafter.cost.block))
            trie.add(draft, source, self.trackers[source].path_scores(limit))
        self.found = (len(ctx.tokens), limit, trie)
        return trie

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        if budget <= 0:
            return Draft.empty()
        trie, self.found = self._retrieval_trie(ctx, budget), None  # the model's nodes join it: used once
        kept, model_nodes = self._allocate(trie, budget, self.model_price(ctx))
        self.model_slots = True  # declined for one step at most
        if model_nodes:
            model = len(self.retrieval)
            pending = self.model.catch_up_tokens(ctx)
            start = time.perf_counter()
            draft = self.model.propose(ctx, model_nodes)
            if len(draft) and pending <= self.model.cost.block + 1:  # a longer catch-up is one-off work, priced apart
                self.model_timing.add(1000.0 * (time.perf_counter() - start), len(draft))
            kept.update(trie.add(draft, model, self.trackers[model].path_scores(model_nodes)))
        draft, order = trie.to_draft(kept, self.source_names)
        self.last_step = (trie, order)
        return draft

    def _ranking(self, trie: CandidateTrie, limit: int, price: float) -> list[tuple[float, bool, int]]:
        """The `limit` best candidates, (score, is a model slot, trie node or model depth): the retrieval
        nodes and the model's chain slots (at most its block) that could pay for their drafting
        (score > `price`, the model's), by pre-draft score (ties: shallower first, then retrieval).
        Scores never rise along a path, so every prefix of the ranking holds its nodes' ancestors."""
        ranked = [(-node.score, node.depth, False, index) for index, node in enumerate(trie.nodes)]
        if self.model is not None and self.model_slots:
            model_scores = self.trackers[len(self.retrieval)].path_scores(min(limit, self.model.cost.block))
            ranked += [(-score, depth, True, depth) for depth, score in enumerate(model_scores, start=1)
                       if score > price]
        return [(-negated, from_model, index) for negated, _, from_model, index in sorted(ranked)[:limit]]

    def _allocate(self, trie: CandidateTrie, budget: int, price: float) -> tuple[set[int], int]:
        """(the retrieval nodes kept, the model's node budget): the first `budget` of the ranking."""
        chosen = self._ranking(trie, budget, price)
        return {index for _, from_model, index in chosen if not from_model}, sum(from_model for _, from_model, _ in chosen)

    def _learn(self, result) -> None:
        """Each source's tracker learns from the last step as a chain would: the deepest node it
        proposed, and how far the accepted path ran through its nodes (they hang from the root). A
        source that drafted nothing forgets a little (AcceptanceTracker.forget): a model whose
        estimate fell below its price, or a match source ranked out of the budget, is tried again
        after some steps instead of never (a re-entering model still repays its catch-up first)."""
        step, self.last_step = self.last_step, None
        trie, order = step if step is not None else (None, [])
        path = [trie.nodes[order[node]] for node in result.path] if step is not None else []
        for source, tracker in enumerate(self.trackers):
            depths = [trie.nodes[n].depth for n in order if source in trie.nodes[n].sources]
            if not depths:
                tracker.forget()
                continue
            accepted = 0
            while accepted < len(path) and source in path[accepted].sources:
                accepted += 1
            tracker.update(max(depths), accepted)
            self.population[source].update(max(depths), accepted)

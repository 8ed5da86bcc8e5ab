"""Cost table T(k), its measurement with a fake clock, and the budget choosers vs brute force."""

import argparse
import io
import itertools
import json
import random

import pytest
import torch

from specdec.acceptance import AcceptanceTracker, chain_path_scores
from specdec.budget import allocate_batch_budget, choose_budget, tokens_per_ms
from specdec.cost import CostTable, default_cache_path, get_or_measure, measure_cost_table
from specdec.profile import add_profile_arguments, plot_cost_table, run_profile


# ---------------------------------------------------------------------------- fakes


class FakeClock:
    """A timer the fake target advances by a known amount per forward."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class LengthCache:
    """Tracks the committed length like a KV cache; truncate follows the KVCache contract."""

    def __init__(self, max_len):
        self.length, self.max_len, self.truncations = 0, max_len, []

    def truncate(self, new_lengths):
        new_length = int(new_lengths)
        assert 0 <= new_length <= self.length
        self.truncations.append(new_length)
        self.length = new_length


class ClockedTarget:
    """Target whose forward over T new tokens costs base_ms + per_token_ms * T on the fake clock."""

    name, dtype, vocab_size = "clocked-fake", torch.float32, 50

    def __init__(self, clock, base_ms, per_token_ms):
        self.clock, self.base_ms, self.per_token_ms = clock, base_ms, per_token_ms
        self.forwards = 0
        self.caches = []

    def new_cache(self, batch_size=1, max_len=128):
        assert batch_size == 1
        cache = LengthCache(max_len)
        self.caches.append(cache)
        return cache

    def forward(self, tokens, positions, cache, attn_mask=None, hidden_layers=()):
        batch, new = tokens.shape
        # positions must continue the cache; the cache must have room
        assert positions.tolist() == [list(range(cache.length, cache.length + new))]
        assert int(tokens.max()) < self.vocab_size
        assert cache.length + new <= cache.max_len
        cache.length += new
        self.forwards += 1
        self.clock.now += (self.base_ms + self.per_token_ms * new) / 1000.0
        return torch.zeros(batch, new, self.vocab_size), {}


class TinyRealTarget(torch.nn.Module):
    """A real (tiny) torch forward for the CLI test, timed with the real clock."""

    name, dtype, vocab_size = "tiny-real", torch.float32, 64

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(self.vocab_size, 32)
        self.head = torch.nn.Linear(32, self.vocab_size)

    def new_cache(self, batch_size=1, max_len=128):
        return LengthCache(max_len)

    def forward(self, tokens, positions, cache, attn_mask=None, hidden_layers=()):
        cache.length += tokens.shape[1]
        return self.head(self.embed(tokens)), {}


def _random_table(rng, ks=(1, 2, 3, 4, 6, 8, 12, 16)):
    ms = [rng.uniform(5.0, 20.0)]
    for _ in ks[1:]:
        ms.append(ms[-1] + rng.uniform(0.0, 6.0))
    return CostTable(key={"seed": "x"}, k=list(ks), ms=ms)


# ---------------------------------------------------------------------------- CostTable


def test_interpolation_and_extrapolation():
    table = CostTable(k=[1, 2, 4, 8], ms=[10.0, 20.0, 24.0, 40.0])
    assert table.t(1) == 10.0 and table.t(4) == 24.0
    assert table.t(3) == pytest.approx(22.0)
    assert table.t(6) == pytest.approx(32.0)
    assert table.t(16) == pytest.approx(40.0 + 4.0 * 8)  # last slope 16/4 = 4 ms per token
    assert table.ratio(4) == pytest.approx(2.4)
    # a noisy last segment that goes down is not extrapolated downwards
    noisy = CostTable(k=[1, 4, 8], ms=[10.0, 14.0, 13.0])
    assert noisy.t(32) == pytest.approx(13.0)
    assert CostTable(k=[4], ms=[7.0]).t(9) == 7.0


@pytest.mark.parametrize(
    "k, ms",
    [([], []), ([1, 2], [1.0]), ([2, 1], [1.0, 2.0]), ([1, 1], [1.0, 1.0]), ([0, 1], [1.0, 1.0]),
     ([1, 2], [1.0, -2.0])],
)
def test_invalid_tables_raise(k, ms):
    with pytest.raises(ValueError):
        CostTable(k=k, ms=ms)


def test_save_load_roundtrip_and_bare_profile_json(tmp_path):
    table = CostTable(key={"model": "m", "threads": 2}, k=[1, 2, 8], ms=[3.5, 6.25, 9.0])
    path = table.save(tmp_path / "sub" / "t.json")
    assert CostTable.load(path) == table
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"k": [1, 4], "ms": [2.0, 3.0]}))
    assert CostTable.load(bare).t(2) == pytest.approx(2 + 1 / 3)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        CostTable.load(tmp_path / "bad.json")


def test_default_cache_path_uses_env_and_hashes_key(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    first = default_cache_path({"model": "a", "threads": 2})
    assert first.parent == tmp_path / "cost" and first.suffix == ".json"
    assert default_cache_path({"threads": 2, "model": "a"}) == first  # key order irrelevant
    assert default_cache_path({"model": "a", "threads": 1}) != first


# ---------------------------------------------------------------------------- measuring


def test_measure_cost_table_with_fake_clock_gives_known_table():
    clock = FakeClock()
    target = ClockedTarget(clock, base_ms=8.0, per_token_ms=1.5)
    ks = (1, 2, 4, 8)
    table = measure_cost_table(target, ks=ks, prefix_len=16, repeats=3, timer=clock,
                               progress=False)
    assert table.k == list(ks)
    assert table.ms == pytest.approx([8.0 + 1.5 * k for k in ks], rel=1e-9)
    assert table.key["model"] == "clocked-fake" and table.key["dtype"] == "float32"
    assert table.key["prefix_len"] == 16
    # one cache per k; every timed forward starts from the prefix
    assert len(target.caches) == len(ks)
    assert all(cache.truncations == [16] * 4 for cache in target.caches)  # warmup + 3 repeats
    assert target.forwards == len(ks) * (1 + 4)  # prefill + warmup + repeats


def test_get_or_measure_uses_cache_until_refresh(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    clock = FakeClock()
    target = ClockedTarget(clock, base_ms=5.0, per_token_ms=1.0)
    first = get_or_measure(target, ks=(1, 2, 4), prefix_len=8, repeats=1, timer=clock,
                           progress=False)
    forwards = target.forwards
    assert default_cache_path(first.key).is_file()
    again = get_or_measure(target, ks=(1, 4), prefix_len=8, repeats=1, timer=clock,
                           progress=False)
    assert again == first and target.forwards == forwards  # loaded, not re-measured
    get_or_measure(target, ks=(1, 8), prefix_len=8, repeats=1, timer=clock, progress=False)
    assert target.forwards > forwards  # k=8 was missing: measured again
    forwards = target.forwards
    get_or_measure(target, ks=(1, 8), prefix_len=8, repeats=1, timer=clock, progress=False,
                   refresh=True)
    assert target.forwards > forwards


def test_a_disturbed_table_is_measured_again_not_used(tmp_path, monkeypatch):
    """A table whose T(3) < T(1) (timed while the CPU was busy) is neither trusted from the cache
    nor kept as measured while another measurement can fix it: each k keeps its fastest median."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    clock = FakeClock()
    target = ClockedTarget(clock, base_ms=50.0, per_token_ms=1.0)
    good = get_or_measure(target, ks=(1, 2, 3), prefix_len=8, repeats=1, timer=clock, progress=False)
    assert good.plausible() and good.ms == pytest.approx([51.0, 52.0, 53.0])
    CostTable(good.key, [1, 2, 3], [232.0, 131.0, 84.0]).save(default_cache_path(good.key))  # what a busy CPU left
    forwards = target.forwards
    again = get_or_measure(target, ks=(1, 2, 3), prefix_len=8, repeats=1, timer=clock, progress=False)
    assert target.forwards > forwards and again.ms == pytest.approx([51.0, 52.0, 53.0])  # re-measured, not loaded
    assert CostTable.load(default_cache_path(good.key)).ms == pytest.approx([51.0, 52.0, 53.0])

    class BusyOnce(ClockedTarget):  # the first k=1 forwards run slow (another job), later ones do not
        def forward(self, tokens, positions, cache, attn_mask=None, hidden_layers=()):
            out = super().forward(tokens, positions, cache, attn_mask, hidden_layers)
            if self.forwards <= 3 and tokens.shape[1] == 1:
                self.clock.now += 0.5
            return out

    busy = BusyOnce(clock, base_ms=50.0, per_token_ms=1.0)
    measured = get_or_measure(busy, ks=(1, 2), prefix_len=8, repeats=1, timer=clock, progress=False, refresh=True)
    assert measured.ms == pytest.approx([51.0, 52.0])  # the slow first k=1 median was replaced by the second attempt's


# ---------------------------------------------------------------------------- choosers


def _chain_objective_brute(probs, g, cost, draft_ms, other):
    """E[tau] from the exact distribution of the accepted length, then tokens per ms."""
    expected = 0.0
    for accepted in range(g + 1):
        reach = 1.0
        for prob in probs[:accepted]:
            reach *= prob
        stop = (1 - probs[accepted]) if accepted < g else 1.0
        expected += (accepted + 1) * reach * stop
    return expected / (g * draft_ms + cost.t(other + g + 1))


@pytest.mark.parametrize("seed", range(8))
def test_choose_budget_on_a_chain_is_argmax_of_objective(seed):
    rng = random.Random(seed)
    table = _random_table(rng)
    for _ in range(20):
        depth = rng.randint(1, 10)
        probs = [rng.uniform(0.0, 1.0) for _ in range(depth)]
        draft_ms = rng.uniform(0.0, 3.0)
        other = rng.choice([0, 0, 3, 7])
        max_gamma = rng.randint(0, 12)
        chosen = choose_budget(chain_path_scores(probs), table, draft_ms, max_gamma, other)
        limit = min(max_gamma, depth)
        values = [_chain_objective_brute(probs, g, table, draft_ms, other)
                  for g in range(limit + 1)]
        best = max(values)
        assert values[chosen] == pytest.approx(best, rel=1e-12)
        assert chosen == min(g for g, v in enumerate(values) if v >= best * (1 - 1e-12))


def test_choose_budget_returns_zero_when_drafting_never_pays():
    steep = CostTable(k=[1, 2, 4, 8], ms=[10.0, 25.0, 50.0, 100.0])  # worse than linear
    assert choose_budget(chain_path_scores([0.9] * 8), steep, 0.0, 8) == 0
    flat = CostTable(k=[1, 16], ms=[10.0, 10.0])
    assert choose_budget(chain_path_scores([0.05] * 8), flat, 2.0, 8) == 0  # low acceptance, costly drafter
    assert choose_budget(chain_path_scores([0.9] * 8), flat, 0.0, 8) == 8  # free verify + drafts: go long
    assert choose_budget(chain_path_scores([0.9] * 8), flat, 0.0, 0) == 0


@pytest.mark.parametrize("seed", range(5))
def test_choose_budget_on_tree_scores_is_argmax_of_objective(seed):
    rng = random.Random(100 + seed)
    table = _random_table(rng)
    for _ in range(20):
        scores = sorted((rng.random() ** 2 for _ in range(rng.randint(0, 24))), reverse=True)
        per_node = rng.choice([0.0, 0.3, rng.uniform(0, 3)])
        other, max_nodes = rng.choice([0, 5]), rng.randint(0, 30)
        chosen = choose_budget(scores, table, per_node, max_nodes, other)
        values = [1 / table.t(other + 1)] + [
            (1 + sum(scores[:n])) / (n * per_node + table.t(other + n + 1))
            for n in range(1, min(max_nodes, len(scores)) + 1)
        ]
        best = max(values)
        assert values[chosen] == pytest.approx(best, rel=1e-12)
        assert chosen == min(n for n, v in enumerate(values) if v >= best * (1 - 1e-12))


def test_choosers_reject_bad_input():
    table = CostTable(k=[1, 2], ms=[1.0, 2.0])
    with pytest.raises(ValueError, match="descending"):
        choose_budget([0.2, 0.5], table, 0.0, 4)
    with pytest.raises(ValueError, match="probability"):
        choose_budget([1.5], table, 0.0, 4)
    with pytest.raises(ValueError, match="probability"):
        chain_path_scores([1.5])
    with pytest.raises(ValueError, match="max_budget"):
        choose_budget([0.5], table, 0.0, -1)
    with pytest.raises(ValueError, match="draft time"):
        choose_budget([0.5], table, -1.0, 4)
    with pytest.raises(ValueError, match="draft time"):
        allocate_batch_budget([[0.5], [0.4]], table, -1.0)


def test_tokens_per_ms_is_the_step_objective():
    table = CostTable(k=[1, 2, 4], ms=[10.0, 14.0, 20.0])
    rates = tokens_per_ms([0.8, 0.5, 0.25], table, 1.5, other_tokens=1)
    # T(2) = 14, T(3) = 17 (interpolated), T(4) = 20, T(5) = 23 (extrapolated)
    assert rates == pytest.approx([1 / 14.0, 1.8 / (1.5 + 17.0), 2.3 / (3.0 + 20.0), 2.55 / (4.5 + 23.0)], rel=1e-12)
    # a block drafter's forward costs the same for any n > 0 (plain decoding pays nothing)
    block = tokens_per_ms([0.8, 0.5], table, 0.0, other_tokens=1, draft_ms_per_step=6.0)
    assert block == pytest.approx([1 / 14.0, 1.8 / (6.0 + 17.0), 2.3 / (6.0 + 20.0)], rel=1e-12)
    assert choose_budget([0.8, 0.5], table, 0.0, 2, other_tokens=1, draft_ms_per_step=6.0) == 2
    assert choose_budget([0.8, 0.5], table, 0.0, 2, other_tokens=1, draft_ms_per_step=30.0) == 0


def _batch_objective(per_request, budgets, cost, draft_ms):
    requests, admitted = len(per_request), sum(budgets)
    expected = requests + sum(sum(s[:b]) for s, b in zip(per_request, budgets))
    return expected / (admitted * draft_ms + cost.t(requests + admitted))


def _random_convex_table(rng, ks=(1, 2, 3, 4, 6, 8, 12, 16)):
    """T(k) whose cost per extra token never falls (no plateaus followed by steps)."""
    slopes = sorted(rng.uniform(0.0, 6.0) for _ in ks[1:])
    ms = [rng.uniform(5.0, 20.0)]
    for slope, (left, right) in zip(slopes, zip(ks, ks[1:])):
        ms.append(ms[-1] + slope * (right - left))
    return CostTable(key={"seed": "x"}, k=list(ks), ms=ms)


@pytest.mark.parametrize("seed", range(6))
def test_allocate_batch_budget_is_brute_force_optimal_on_convex_costs(seed):
    """With a cost per extra token that never falls, expected tokens per ms rises then falls
    along the walk (concave numerator over convex denominator), so stopping at the first
    non-improvement is the exact optimum."""
    rng = random.Random(200 + seed)
    table = _random_convex_table(rng)
    for _ in range(8):
        per_request = [
            chain_path_scores([rng.uniform(0.2, 1.0) for _ in range(rng.randint(0, 4))])
            for _ in range(rng.randint(1, 3))
        ]
        draft_ms = rng.uniform(0.0, 2.0)
        budgets = allocate_batch_budget(per_request, table, draft_ms)
        assert all(0 <= b <= len(s) for b, s in zip(budgets, per_request))
        best = max(
            _batch_objective(per_request, combo, table, draft_ms)
            for combo in itertools.product(*(range(len(s) + 1) for s in per_request))
        )
        assert _batch_objective(per_request, budgets, table, draft_ms) == pytest.approx(
            best, rel=1e-12
        )


def test_allocate_batch_budget_stops_at_the_first_non_improvement():
    """A step in T(k) then a plateau: the 2nd position costs a lot, the 3rd..8th are free.
    Scanning every n would admit all 8; the scheduler's walk (the one that stays lossless when
    the scores come from drafted tokens, specdec.schedule) stops after the 1st."""
    table = CostTable(k=[1, 2, 3, 16], ms=[10.0, 10.1, 16.0, 16.0])
    scores = chain_path_scores([0.95] * 8)
    assert allocate_batch_budget([scores], table, draft_ms=0.0) == [1]
    all_eight = _batch_objective([scores], [8], table, 0.0)
    assert all_eight > _batch_objective([scores], [1], table, 0.0) > _batch_objective([scores], [2], table, 0.0)


def test_allocate_single_request_equals_chain_chooser_on_convex_costs():
    rng = random.Random(5)
    for _ in range(20):
        table = _random_convex_table(rng)
        probs = [rng.uniform(0.3, 1.0) for _ in range(8)]
        draft_ms = rng.uniform(0.0, 2.0)
        assert allocate_batch_budget([chain_path_scores(probs)], table, draft_ms) == [
            choose_budget(chain_path_scores(probs), table, draft_ms, 8)
        ]


def test_allocate_batch_budget_shrinks_as_requests_join():
    # GPU-like: flat up to 16 tokens, then each extra token costs like a full step
    table = CostTable(k=[1, 16, 32], ms=[10.0, 10.5, 30.0])
    scores = chain_path_scores([0.8] * 8)
    per_request_budget = []
    for requests in (1, 2, 4, 8, 16):
        budgets = allocate_batch_budget([scores] * requests, table, draft_ms=0.1)
        per_request_budget.append(max(budgets))
        assert max(budgets) - min(budgets) <= 1  # identical requests share evenly
    assert per_request_budget == sorted(per_request_budget, reverse=True)
    assert per_request_budget[0] == 8 and per_request_budget[-1] == 0


def test_acceptance_tracker_prior_and_convergence():
    tracker = AcceptanceTracker(prior=0.6, prior_weight=2.0, decay=0.98)
    assert tracker.probs(3) == pytest.approx([0.6, 0.6, 0.6])
    rng = random.Random(11)
    true_probs = [0.9, 0.7, 0.4, 0.4]
    for _ in range(4000):
        accepted = 0
        while accepted < 4 and rng.random() < true_probs[accepted]:
            accepted += 1
        tracker.update(drafted_depths=4, accepted=accepted)
    estimates = tracker.probs(5)
    for estimate, truth in zip(estimates, true_probs):
        assert estimate == pytest.approx(truth, abs=0.12)
    assert estimates[4] == pytest.approx(0.6)  # never drafted: the prior
    assert tracker.path_scores(2) == pytest.approx([estimates[0], estimates[0] * estimates[1]])
    with pytest.raises(ValueError):
        tracker.update(drafted_depths=2, accepted=3)
    with pytest.raises(ValueError):
        AcceptanceTracker(decay=0.0)


def test_acceptance_tracker_recent_rejections_lower_estimate():
    tracker = AcceptanceTracker()
    for _ in range(20):
        tracker.update(3, 3)
    high = tracker.probs(1)[0]
    for _ in range(20):
        tracker.update(3, 0)
    assert tracker.probs(1)[0] < 0.5 < high


# ---------------------------------------------------------------------------- plot + CLI


def test_plot_cost_table_writes_png(tmp_path):
    path = plot_cost_table(CostTable(k=[1, 2, 4], ms=[5.0, 8.0, 9.0]), tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_profile_json_prints_only_k_and_ms(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    loaded = []

    def load_target(name, dtype="float32", weights=None):
        loaded.append((name, dtype, weights))
        print("loading chatter that must not reach stdout")
        return TinyRealTarget()

    parser = add_profile_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "tiny", "--json", "--ks", "1,2,4", "--repeats", "2",
                              "--prefix-len", "8", "--plot", str(tmp_path / "cost.png")])
    out = io.StringIO()
    assert run_profile(args, load_target, out=out) == 0
    data = json.loads(out.getvalue())
    assert set(data) == {"k", "ms"} and data["k"] == [1, 2, 4]
    assert len(data["ms"]) == 3 and all(ms > 0 for ms in data["ms"])
    assert "chatter" not in capsys.readouterr().out
    assert loaded == [("tiny", "float32", None)]
    assert (tmp_path / "cost.png").is_file()
    assert list((tmp_path / "cost").glob("*.json"))  # cached for --gamma auto


def test_measure_cost_table_on_real_tiny_target(tiny_target):
    """The real native forward + KVCache.truncate satisfy what measure_cost_table relies on."""
    steps = iter(range(10_000))
    table = measure_cost_table(tiny_target, ks=(1, 3), prefix_len=8, repeats=2,
                               timer=lambda: next(steps) / 1000.0, progress=False)
    # the counting timer ticks once per call, so every timed forward reads exactly 1 ms
    assert table.k == [1, 3] and table.ms == pytest.approx([1.0, 1.0])
    assert table.key["model"] == tiny_target.name
    real = measure_cost_table(tiny_target, ks=(1, 2), prefix_len=8, repeats=1, progress=False)
    assert all(ms > 0 for ms in real.ms)


def test_cpu_clock_tables_are_cached_apart_from_wall_clock_ones(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    clock = FakeClock()
    target = ClockedTarget(clock, base_ms=5.0, per_token_ms=1.0)
    wall = get_or_measure(target, ks=(1, 2), prefix_len=8, repeats=1, timer=clock, progress=False)
    cpu = get_or_measure(target, ks=(1, 2), prefix_len=8, repeats=1, timer=clock, progress=False, clock="cpu")
    assert "clock" not in wall.key and cpu.key["clock"] == "cpu"  # wall keys unchanged: old caches stay valid
    assert default_cache_path(wall.key) != default_cache_path(cpu.key)
    with pytest.raises(ValueError, match="clock must be one of wall, cpu"):
        measure_cost_table(target, ks=(1,), prefix_len=8, repeats=1, progress=False, clock="gpu")


def test_a_kernel_targets_key_names_its_threads_and_serial_torch_ops(tmp_path):
    """Tables of a target on the compiled kernel are keyed by the kernel's thread count (the same
    inside a decoding step, where torch runs on one thread) and by torch's ops running serially, so a
    table timed before that hand-over is not reused; a target on torch's linears keeps its key."""
    from conftest import make_tiny_hf_dir

    from specdec.cost import cost_key
    from specdec.kernels import KernelUnavailable, load_library
    from specdec.models.llama import load_native

    try:
        load_library()
    except KernelUnavailable as exc:
        pytest.skip(f"compiled kernel unavailable here: {exc}")
    hf_dir, _ = make_tiny_hf_dir(tmp_path / "tiny", "llama", seed=1)
    on_kernel, on_torch = load_native(hf_dir, linear="cpp"), load_native(hf_dir, linear="torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outside = cost_key(on_kernel)
        with on_kernel.kernel_owns_threads():
            assert torch.get_num_threads() == 1
            assert cost_key(on_kernel) == outside
        assert outside["threads"] == 2 and outside["torch_ops"] == "one thread"
        assert "torch_ops" not in cost_key(on_torch) and cost_key(on_torch)["threads"] == 2
    finally:
        torch.set_num_threads(threads)

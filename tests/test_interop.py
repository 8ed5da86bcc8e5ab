"""Acceptance parity with vLLM CPU (`make test-interop`; needs `specdec peers install vllm`).

Drafters of every kind vLLM 0.32 loads on CPU (EAGLE-3, DFlash, Medusa; EAGLE-3 and DFlash also
in the speculators format) are trained here on the tiny counter target (head_dim 32: the smallest
vLLM's CPU attention takes), exported, and run on the same prompts with the same draft length,
greedy, here and in vLLM (in its own venv and process), both in fp32 (rather than vLLM's CPU default
bf16: the same weights on both sides keep the bound below tight). The
accepted draft tokens per draft agree within PARITY_BOUND, and both sides generate the same tokens.
DSpark: vLLM 0.32's CPU runner refuses it ("Model Runner V1 does not support: dspark speculative
decoding"); test_vllm_cpu_refuses_dspark keeps that finding checked.

The bound: both sides run the very same fp32 weights and the same greedy rule, so a drafted token
can only differ where the drafter's top-2 logits are within the two engines' different summation
orders (relative ~1e-6). The drafters here learn a deterministic cycle, so few drafted tokens sit
that close; each flip changes one draft's accepted count by at most the draft length K. Allowing 0.1 * K accepted
tokens per draft (one flip in every ten drafts, at the worst position) covers that and still
fails a wrongly wired drafter, which accepts by chance (~K / 21 on the counter's 21 cycle tokens)
where ours accepts at least MIN_ACCEPTED * K. The counts also differ at each answer's end: our
budget shortens the last drafts to the tokens left, vLLM drafts K and drops the excess. Measured
with fp32 on both sides (K = 3, 4 prompts x 48 tokens, the same outputs on both sides), specdec / vLLM:
EAGLE-3 1.38 / 1.50 (native and speculators format alike), DFlash 2.08 / 2.15, Medusa 2.92 / 3.00.
"""

import contextlib
import glob
import json
import os
import re
import signal
import time

import pytest
from train_support import VOCAB, counter_selfdistill_data, make_counter_target, text_prompts

from specdec import SamplingParams, generate
from specdec.drafters import make_drafter
from specdec.heads import target_description
from specdec.heads.export import export_dflash, export_dspark, export_eagle3, export_medusa, rewrite_as_speculators
from specdec.train import TrainSettings, build_heads, load_samples, train

pytestmark = pytest.mark.interop

# head_dim 32 (the smallest vLLM's CPU attention takes) at the counter's own hidden size 64
VLLM_COUNTER = dict(num_attention_heads=2, num_key_value_heads=1)
MAX_NEW_TOKENS = 48
PARITY_BOUND = 0.1  # accepted tokens per draft, as a fraction of the draft length K (see the docstring)
MIN_ACCEPTED = 0.2  # of K: the drafter must accept far above chance for the comparison to mean anything
BLOCK = 4  # DFlash / DSpark block
# kind -> (build_heads options, tokens per draft, vLLM method, specdec drafter options)
KINDS = {
    "eagle3": (dict(num_positions=3, draft_vocab_size=16), 3, "eagle3", dict(tree=False)),
    "dflash": (dict(num_positions=BLOCK - 1, block_size=BLOCK, num_draft_layers=1), BLOCK - 1, "dflash", {}),
    "dspark": (dict(num_positions=BLOCK, block_size=BLOCK, num_draft_layers=1, markov_rank=8), BLOCK, "dspark", {}),
    "medusa": (dict(num_positions=3), 3, "medusa", dict(choices="[[0], [0, 0], [0, 0, 0]]")),
}
# the parity cases: (kind, export format)
CASES = [("eagle3", "native"), ("eagle3", "speculators"), ("dflash", "native"), ("dflash", "speculators"),
         ("medusa", "native")]


@pytest.fixture(scope="module")
def counter(tmp_path_factory):
    return make_counter_target(tmp_path_factory.mktemp("counter") / "model", seed=0, **VLLM_COUNTER)


@pytest.fixture(scope="module")
def counter_data(counter, tmp_path_factory):
    return counter_selfdistill_data(counter, tmp_path_factory.mktemp("data") / "data", layers=[0, 1, 2, 3])


@pytest.fixture(scope="module")
def trained(counter, counter_data, tmp_path_factory):
    """kind -> (checkpoint dir, heads), trained at first use (one drafter per kind for every format)."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            out = tmp_path_factory.mktemp(kind) / "ckpt"
            cache[kind] = (out, _train(kind, counter, counter_data, out))
        return cache[kind]

    return get


def _train(kind: str, counter, data, out):
    options = dict(KINDS[kind][0])
    heads = build_heads(kind, counter, options.pop("num_positions"), **options)
    _, samples = load_samples(data, sorted({*heads.input_layers, counter.num_layers}), counter)
    settings = TrainSettings(steps=150, lr=3e-3, batch_size=4, loss_rows=256, warmup_steps=10, eval_every=150,
                             anchors_per_row=8)
    train(heads, counter, samples, out, settings, target_description(counter), progress=False, log=lambda _: None)
    return heads


def _export(kind: str, heads, counter, out, fmt: str):
    """float32 weights, run in float32 by vLLM too: both sides compute from the same numbers."""
    writers = {"eagle3": lambda: export_eagle3(heads, out, "float32"), "dflash": lambda: export_dflash(heads, out, "float32"),
               "dspark": lambda: export_dspark(heads, counter, out, "float32"),
               "medusa": lambda: export_medusa(heads, counter, out, "float32")}
    writers[kind]()
    if fmt == "speculators":
        rewrite_as_speculators(out, KINDS[kind][1], str(counter.model_dir), ["LlamaForCausalLM"])
    return out


def _prompts(counter) -> list[list[int]]:
    return [counter.encode_prompt(item.text) for item in text_prompts(4, seed=5)]


def _specdec_acceptance(counter, checkpoint, kind: str, prompts) -> tuple[float, list[list[int]]]:
    _, k, _, options = KINDS[kind]
    drafter = make_drafter(kind, counter, checkpoint=str(checkpoint), draft_weights="fp32", **options)
    drafts = accepted = 0
    outputs = []
    for prompt in prompts:
        result = generate(counter, prompt, drafter, MAX_NEW_TOKENS, SamplingParams(), gamma=k)
        drafts, accepted = drafts + result.stats.steps, accepted + result.stats.accepted_tokens
        outputs.append(result.tokens)
    return accepted / max(drafts, 1), outputs


def _vllm_acceptance(counter, export_dir, kind: str, prompts) -> tuple[float, list[list[int]], dict]:
    from specdec.peers.vllm_client import VllmWorker

    _, k, method, _ = KINDS[kind]
    spec = {"method": method, "model": str(export_dir), "num_speculative_tokens": k}
    totals = {"drafts": 0, "accepted_tokens": 0, "draft_tokens": 0}
    outputs = []
    with VllmWorker(counter.model_dir, spec, {"enforce_eager": True, "gpu_memory_utilization": 0.1,
                                             "max_model_len": 256, "dtype": "float32"}) as worker:
        for prompt in prompts:
            answer = worker.generate(prompt, MAX_NEW_TOKENS, counter.eos_token_ids)
            outputs.append(answer.tokens)
            for key in totals:
                totals[key] += getattr(answer, key)
    return totals["accepted_tokens"] / max(totals["drafts"], 1), outputs, totals


@pytest.mark.parametrize("kind, fmt", CASES)
def test_acceptance_per_draft_matches_vllm(counter, trained, tmp_path, kind, fmt):
    checkpoint, heads = trained(kind)
    export_dir = _export(kind, heads, counter, tmp_path / "export", fmt)
    prompts = _prompts(counter)
    ours, our_outputs = _specdec_acceptance(counter, checkpoint, kind, prompts)
    theirs, their_outputs, totals = _vllm_acceptance(counter, export_dir, kind, prompts)
    k = KINDS[kind][1]
    print(json.dumps({"kind": kind, "format": fmt, "k": k, "specdec_accepted_per_draft": ours,
                      "vllm_accepted_per_draft": theirs, "same_outputs": our_outputs == their_outputs, **totals}))
    assert totals["drafts"] > 0, f"vLLM never drafted with the {kind} export"
    assert ours >= MIN_ACCEPTED * k, f"the trained {kind} drafter is too weak for a parity check ({ours:.2f} of {k})"
    assert abs(ours - theirs) <= PARITY_BOUND * k, f"{kind}: specdec {ours:.3f} vs vLLM {theirs:.3f} accepted per draft"
    assert their_outputs == our_outputs  # both lossless, same arithmetic precision


def test_vllm_cpu_refuses_dspark(counter, tmp_path):
    """vLLM 0.32 drafts DSpark only on its GPU model runner (V2); its CPU runner rejects the config.
    When this fails, vLLM runs DSpark on CPU: add ("dspark", ...) to CASES."""
    from specdec.peers.vllm_client import VllmError

    heads = build_heads("dspark", counter, BLOCK, block_size=BLOCK, num_draft_layers=1, markov_rank=8)
    export_dir = _export("dspark", heads, counter, tmp_path / "export", "native")
    with pytest.raises(VllmError, match="does not support: dspark speculative decoding"):
        _vllm_acceptance(counter, export_dir, "dspark", _prompts(counter))


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (vLLM's engine core and its model workers), from /proc."""
    parents = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = open(stat).read().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        parents[int(stat.split("/")[2])] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def test_a_dead_vllm_engine_is_one_clear_error_and_closes(counter):
    """vLLM's engine killed under a running worker (as the OOM killer or a native crash would): the next
    request is a one-line VllmError naming the dead engine, and closing the worker does not hang."""
    from specdec.peers.vllm_client import VllmError, VllmWorker

    prompt = _prompts(counter)[0]
    with VllmWorker(counter.model_dir, None, {"enforce_eager": True, "gpu_memory_utilization": 0.1,
                                             "max_model_len": 256, "dtype": "float32"}) as worker:
        assert len(worker.generate(prompt, 8, counter.eos_token_ids).tokens) > 0
        engine = _descendants(worker.process.pid)
        assert engine, "vLLM runs its engine in a child process; none was found"
        for pid in engine:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with pytest.raises(VllmError) as failure:
            worker.generate(prompt, 8, counter.eos_token_ids)
        message = str(failure.value)
        print(message)
        assert "\n" not in message
        assert re.search(r"EngineDead|died|exited", message), message
    assert worker.process is None  # closed


def test_the_bench_runs_vllm_plain_with_its_options_in_the_engine(counter):
    """The bench's vllm-plain, built from its option strings as `--methods vllm-plain:dtype=float32:...`
    gives them, generates in vLLM what specdec's plain decoding generates (fp32 both sides)."""
    from specdec.bench.methods import METHODS, PeerSource
    from specdec.bench.peers_vllm import VllmTarget
    from specdec.bench.runner import BenchConfig
    from specdec.peers.envs import VLLM

    source = PeerSource(str(counter.model_dir), counter.model_dir, counter.tokenizer, counter.vocab_size, counter.eos_token_ids)
    target = VllmTarget(counter.model_dir, source, VLLM.version)
    method = METHODS["vllm-plain"].build(target, {"dtype": "float32", "enforce_eager": "1", "max_model_len": "256"}, BenchConfig())
    try:
        assert "dtype=float32" in method.description and "eager" in method.description
        assert f"kv_cache_memory_bytes={2 << 30}" in method.description  # an explicit cache, not a memory fraction
        for prompt in _prompts(counter)[:2]:
            ours = generate(counter, prompt, None, MAX_NEW_TOKENS, SamplingParams()).tokens
            theirs = method.generate(prompt, MAX_NEW_TOKENS, SamplingParams())
            assert theirs.tokens == ours
            assert theirs.target_forwards == len(theirs.tokens)  # plain: one forward per token
    finally:
        method.close()


def test_a_terminated_vllm_worker_takes_its_engine_with_it(counter):
    """SIGTERM to the worker (a user's Ctrl-C of the bench, a killed job): vLLM's engine processes end too
    instead of holding their memory as orphans."""
    from specdec.peers.vllm_client import VllmWorker

    with VllmWorker(counter.model_dir, None, {"enforce_eager": True, "gpu_memory_utilization": 0.1,
                                             "max_model_len": 256, "dtype": "float32"}) as worker:
        engine = _descendants(worker.process.pid)
        assert engine
        worker.process.terminate()
        worker.process.wait(timeout=120)
        deadline = time.monotonic() + 60
        while (alive := [pid for pid in engine if os.path.exists(f"/proc/{pid}")]) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not alive, f"vLLM engine processes {alive} outlived their worker"

"""What the int8-activation mode costs in quality (a developer tool): gguf-a8 vs the exact path on a fixed text.

    python scripts/kernel_quality.py --model qwen2.5-coder-0.5b

Loads the model once with its GGUF blocks (weights="gguf": fp32 activations, bitwise the
dequantized-fp32 model), scores the text below in one forward, switches every GGUFLinear to int8
activations (= weights="gguf-a8") and scores it again. Prints the perplexity of both, the top-1
agreement of their next-token predictions and the mean KL divergence exact -> a8. With
--llama-cpp, also llama.cpp's own logits for the same token ids on the same GGUF file (its
q8_0 / q8_K activation quantization), compared with the exact path the same way.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

# Written for this check (prose, a list, code and numbers, ~600 tokens); fixed so numbers compare across runs.
QUALITY_TEXT = """\
The lighthouse keeper kept two notebooks. In the first he wrote the weather every three hours:
wind direction, the height of the swell, whether the far buoy could be seen through the haze.
In the second he wrote everything else, which over the years came to mean mostly the birds.
Gannets arrived in March and left in October; the terns were less predictable and, some
summers, did not come at all. When the supply boat was late he rationed coffee before flour,
because, as he explained to the one inspector who ever asked, bread can be improvised and
patience cannot.

A short list of what he repaired in a single winter: the lens carriage (twice), the rain gauge,
a hinge on the oil store, the radio, his own boots, and a chair that had belonged to the keeper
before him. He kept the broken parts in labelled tins, on the theory that a part which failed
once explains the next failure better than any manual.

Measuring a slow process is mostly a matter of writing the same thing down at the same time
every day. If the tide gauge reads 2.41 metres at noon on Monday and 2.63 metres at noon on
Thursday, the difference says little on its own; a year of such readings says a great deal.
Averages hide the storms, so he also recorded the maximum of each week, and the date on which
it occurred, in a separate column.

def moving_average(values, window):
    \"\"\"Mean of each run of `window` consecutive values.\"\"\"
    if window <= 0:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    means = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        means.append(total / window)
    return means

readings = [2.41, 2.52, 2.47, 2.63, 2.58, 2.71, 2.66]
print(moving_average(readings, 3))

The station was automated in the spring of his last year. The new equipment logged the wind
every ten seconds and sent it to a computer on the mainland, which produced charts far better
than his. He said he did not mind. On the last page of the second notebook he wrote only that
the gannets had come back early, and that the chair was still holding.
"""


@torch.inference_mode()
def score_logits(target, ids: torch.Tensor) -> torch.Tensor:
    """Logits [T, vocab] fp32 of one forward over ids [T] from an empty cache."""
    cache = target.new_cache(batch_size=1, max_len=int(ids.numel()))
    logits, _ = target.forward(ids[None], torch.arange(ids.numel())[None], cache)  # [1, T, V]
    return logits[0].float()


def compare(reference: torch.Tensor, candidate: torch.Tensor, ids: torch.Tensor) -> dict:
    """Perplexities of ids[1:] under both, top-1 agreement and mean KL(reference || candidate)."""
    targets = ids[1:]
    ref_logp = torch.log_softmax(reference[:-1].double(), dim=-1)  # [T-1, V]
    cand_logp = torch.log_softmax(candidate[:-1].double(), dim=-1)
    nll_ref = -ref_logp.gather(1, targets[:, None]).mean()
    nll_cand = -cand_logp.gather(1, targets[:, None]).mean()
    kl = (ref_logp.exp() * (ref_logp - cand_logp)).sum(-1).mean()
    top1 = (reference.argmax(-1) == candidate.argmax(-1)).double().mean()
    return {
        "tokens": int(ids.numel()),
        "ppl_exact": math.exp(float(nll_ref)),
        "ppl_a8": math.exp(float(nll_cand)),
        "top1_agreement": float(top1),
        "mean_kl": float(kl),
    }


def set_activations(model: torch.nn.Module, activations: str) -> int:
    """Switch every GGUFLinear in `model` to `activations` ("fp32" or "int8"); returns how many."""
    from specdec.kernels.gguf_linear import GGUFLinear

    linears = [module for module in model.modules() if isinstance(module, GGUFLinear)]
    for module in linears:
        module.set_activations(activations)  # checks the value; builds or drops the interleaved copy
    return len(linears)


def measure_quality(target, text: str = QUALITY_TEXT) -> dict:
    """Score `text` with fp32 activations, then with int8 activations, on the same GGUF blocks."""
    if getattr(target, "weights", None) not in ("gguf", "gguf-a8"):
        raise ValueError(f"{target.name} holds no GGUF blocks (weights={getattr(target, 'weights', None)!r}); "
                         "the a8 mode needs a GGUF-sourced model loaded with weights='gguf'")
    ids = torch.tensor(target.tokenizer(text)["input_ids"], dtype=torch.long)  # [T]
    set_activations(target.model, "fp32")
    exact = score_logits(target, ids)
    set_activations(target.model, "int8")
    a8 = score_logits(target, ids)
    return {"model": str(target.name), **compare(exact, a8, ids)}


def llama_cpp_logits(model: str, ids: torch.Tensor) -> torch.Tensor:
    """llama.cpp's logits [T, vocab] for ids [T] on the registry model's GGUF file (the bench peer's
    runtime: llama-cpp-python, an optional extra)."""
    from specdec.bench.peers import LLAMA_CPP, machine_cores
    from specdec.models.registry import fetch_gguf

    missing = LLAMA_CPP.missing()
    if missing:
        raise ValueError(f"llama.cpp unavailable: {missing}")
    from llama_cpp import Llama

    llama = Llama(model_path=str(fetch_gguf(model, progress=False)), n_ctx=int(ids.numel()) + 8, logits_all=True,
                  n_threads=machine_cores(), n_threads_batch=machine_cores(), verbose=False)
    llama.eval(ids.tolist())
    return torch.from_numpy(llama.scores[: ids.numel()].copy()).float()  # [T, V]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/kernel_quality.py", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="registry name, HF dir or .gguf file (GGUF-sourced)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="also score llama.cpp's logits on the model's GGUF file (registry models; "
                             "needs llama-cpp-python)")
    args = parser.parse_args(argv)
    from specdec.api import load_target

    try:
        target = load_target(args.model, weights="gguf")
        result = measure_quality(target)
        if args.llama_cpp:
            ids = torch.tensor(target.tokenizer(QUALITY_TEXT)["input_ids"], dtype=torch.long)  # [T]
            set_activations(target.model, "fp32")
            exact = score_logits(target, ids)  # [T, V]
            theirs = llama_cpp_logits(args.model, ids)
            vocab = min(exact.shape[-1], theirs.shape[-1])  # a GGUF may pad or trim the vocabulary
            peer = compare(exact[:, :vocab], theirs[:, :vocab], ids)
            result["llama_cpp"] = {"ppl": peer["ppl_a8"], "top1_agreement": peer["top1_agreement"],
                                   "mean_kl": peer["mean_kl"]}
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{result['model']}: {result['tokens']} tokens of the fixed text (QUALITY_TEXT in scripts/kernel_quality.py)")
    print(f"  perplexity  exact (gguf = fp32 path) {result['ppl_exact']:.4f}   gguf-a8 {result['ppl_a8']:.4f}")
    print(f"  top-1 agreement {100 * result['top1_agreement']:.2f} %   mean KL(exact || a8) {result['mean_kl']:.2e} nats")
    if "llama_cpp" in result:
        peer = result["llama_cpp"]
        print(f"  llama.cpp on the same file: perplexity {peer['ppl']:.4f}, top-1 agreement with exact "
              f"{100 * peer['top1_agreement']:.2f} %, mean KL(exact || llama.cpp) {peer['mean_kl']:.2e} nats")
    return 0


if __name__ == "__main__":
    sys.exit(main())

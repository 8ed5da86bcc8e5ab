#!/usr/bin/env bash
# The measurements behind docs/performance.md and docs/results.md, one section per argument
# (default: all). Run on a quiet machine, one section at a time; logs in runs/. The bench runs
# write docs/results/NAME (committed); regenerate the page with: python scripts/results_page.py
#   bash scripts/measure.sh profiles | plain | bench15 | auto15 | quick | heads05 | load05
set -x
S=.venv/bin/specdec
mkdir -p runs

profiles() {  # T(k) with the kernel and with F.linear
  for m in smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
    $S profile --model $m --ks 1,2,4,8,16 --json > runs/profile-$m-cpp.json
    SPECDEC_LINEAR=torch $S profile --model $m --ks 1,2,4,8,16 --json > runs/profile-$m-torch.json
  done
}
plain() {  # specdec plain decoding vs transformers generate
  $S bench --target smollm2-135m --methods plain,hf-plain --limit-per-category 1 --max-new-tokens 64 --out docs/results/plain-smollm2 --no-progress > runs/plain-smollm2.log 2>&1
  $S bench --target qwen2.5-coder-0.5b --methods plain,hf-plain --limit-per-category 1 --max-new-tokens 64 --out docs/results/plain-qwen05 --no-progress > runs/plain-qwen05.log 2>&1
}
bench15() {  # every default method and the transformers peers on the 1.5B target
  $S bench --target qwen2.5-coder-1.5b --methods plain,pld,suffix,lookahead,small-model,layer-skip,hf-plain,hf-assisted,hf-pld --limit-per-category 1 --max-new-tokens 64 --out docs/results/bench-qwen15 --no-progress > runs/bench-qwen15.log 2>&1
}
auto15() {  # the model-based drafters that need the catch-up rule, same setup as bench15
  $S bench --target qwen2.5-coder-1.5b --methods plain,small-model,layer-skip --limit-per-category 1 --max-new-tokens 64 --out docs/results/auto-qwen15 --no-progress > runs/auto-qwen15.log 2>&1
}
quick() {  # the quick profile: bench defaults (3 questions per kind, 128 new tokens, SmolLM2)
  /usr/bin/time -v $S bench --out docs/results/quick-smollm2 --no-progress > runs/quick-smollm2.log 2>&1
}
heads05() {  # trained heads next to the training-free drafters (checkpoints from `specdec train`)
  $S bench --target qwen2.5-coder-0.5b --methods "plain,pld,suffix,lookahead,medusa:checkpoint=${MEDUSA:-/tmp/sd/ckpt-medusa4},mtp:checkpoint=${MTP:-/tmp/sd/ckpt-mtp4}" \
    --limit-per-category 1 --max-new-tokens 64 --out docs/results/heads-qwen05 --no-progress > runs/heads-qwen05.log 2>&1
}
load05() {  # serving: per-user and total tokens/s at 1, 2, 4, 8 users, plain vs pld (auto)
  .venv/bin/python scripts/load_bench.py --model qwen2.5-coder-0.5b --drafter pld --gamma auto \
    --concurrency 1,2,4,8 --max-tokens 48 --requests-per-user 2 --out runs/load-qwen05 > runs/load-qwen05.log 2>&1
}

for section in "${@:-profiles plain bench15 quick heads05 load05}"; do
  for name in $section; do "$name"; done
done
echo ALLDONE

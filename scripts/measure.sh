#!/usr/bin/env bash
# One sequential measurement session (nothing else running). Logs in runs/*.log
set -x
export OMP_WAIT_POLICY=PASSIVE
S=.venv/bin/specdec
for m in smollm2-135m qwen2.5-coder-0.5b qwen2.5-coder-1.5b; do
  $S profile --model $m --ks 1,2,4,8,16 --json > runs/profile-$m-cpp.json
  SPECDEC_LINEAR=torch $S profile --model $m --ks 1,2,4,8,16 --json > runs/profile-$m-torch.json
done
$S bench --target smollm2-135m --methods plain,hf-plain --limit-per-category 1 --max-new-tokens 64 --out runs/plain-smollm2 --no-progress > runs/plain-smollm2.log 2>&1
$S bench --target qwen2.5-coder-0.5b --methods plain,hf-plain --limit-per-category 1 --max-new-tokens 64 --out runs/plain-qwen05 --no-progress > runs/plain-qwen05.log 2>&1
$S bench --target qwen2.5-coder-1.5b --limit-per-category 1 --max-new-tokens 64 --out runs/bench-qwen15 --no-progress > runs/bench-qwen15.log 2>&1
echo ALLDONE

#!/usr/bin/env bash
# GRPO vs ExGRPO on one GPU with a 0.5-1.5B instruct model, a fixed number of steps each, paired on
# one seed, writing the same table as `exgrpo experiment` (docs/results.md, "GPU recipe").
#
#   MODEL=models/Qwen2.5-0.5B-Instruct bash scripts/gpu_grpo_vs_exgrpo.sh
#   MODEL=... DATA=../shared/data/exgrpo/valid.parquet STEPS=20 SEEDS="0 1" OUT=exgrpo-data/gpu bash scripts/gpu_grpo_vs_exgrpo.sh
#
# MODEL is a local Hugging Face folder (the GPU machine reaches no network). DATA holds questions in
# the verl/ExGRPO parquet layout: the first HELDOUT rows are held out and evaluated before and after
# training, the next TRAIN rows are imported into the pool. Each run is the one-box main job with
# the math reward, bfloat16 on the GPU, K = 8, B = 32 questions per step, up to 1,024 new tokens.
# Generation is the trainer's own (colocated, transformers on the GPU); vLLM rollout workers are not
# wired into this script. Budget: about 10 minutes of an H200 for both arms at STEPS=20 with a 0.5B model (estimated, not
# measured: the script has not been run on a GPU yet).
set -euo pipefail
: "${MODEL:?set MODEL to a local Hugging Face model folder}"
DATA="${DATA:-../shared/data/exgrpo/valid.parquet}"
OUT="${OUT:-exgrpo-data/gpu-compare}"
STEPS="${STEPS:-20}"
SEEDS="${SEEDS:-0}"
HELDOUT="${HELDOUT:-256}"
TRAIN="${TRAIN:-1500}"
EXGRPO="${EXGRPO:-exgrpo}"

settings=(
  model.dtype=auto model.max_prompt_len=1024 model.activation_checkpointing=true
  rollout.max_new_tokens=1024 rollout.grader=math_think rollout.temperature=1.0
  experience.batch_size=32 pool.k=8 optim.lr=1e-6 optim.mini_batches=2
  job.train_questions="$TRAIN" job.eval_every=5 job.eval_temperature=0.6
  run.steps="$STEPS" schedule.publish_every=1000 schedule.checkpoint_every=0
)
for seed in $SEEDS; do
  for arm in grpo exgrpo; do
    dir="$OUT/$arm/seed-$seed"
    if [[ -f "$dir/summary.json" ]]; then continue; fi
    rm -rf "$dir"
    flags=(--model "$MODEL" --data "$DATA" --out "$dir" --seed "$seed" --heldout "$HELDOUT")
    if [[ "$arm" == grpo ]]; then flags+=(--grpo); fi
    "$EXGRPO" run "${flags[@]}" "${settings[@]}"
  done
done
# the table and plots of `exgrpo experiment` over the finished runs (seeds as given)
seed_list="$(echo $SEEDS | tr ' ' ',')"
if [[ "$seed_list" != *,* ]]; then seed_list="$seed_list-$seed_list"; fi  # one seed: a range of one
"$EXGRPO" experiment --out "$OUT" --arms grpo,exgrpo --seeds "$seed_list" --report-only
echo "results: $OUT/results.md"

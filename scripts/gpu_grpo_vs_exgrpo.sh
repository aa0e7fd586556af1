#!/usr/bin/env bash
# GRPO vs ExGRPO on one GPU with a 0.5-1.5B instruct model and vLLM rollouts, a fixed number of
# steps each, paired on the same seeds, writing the same table and plots as `exgrpo experiment`
# (docs/results.md, "GPU recipe").
#
#   MODEL=models/Qwen2.5-0.5B-Instruct bash scripts/gpu_grpo_vs_exgrpo.sh
#   MODEL=... DATA=../shared/data/exgrpo/valid.parquet STEPS=10 SEEDS="0 1" OUT=exgrpo-data/gpu bash scripts/gpu_grpo_vs_exgrpo.sh
#   DRY_RUN=1 MODEL=... bash scripts/gpu_grpo_vs_exgrpo.sh      # print the commands, run nothing
#   bash scripts/gpu_grpo_vs_exgrpo.sh job.eval_every=2           # extra key=value settings of every run
#
# Each run is the one-box main job (`exgrpo run`): its embedded pool service, the trainer on the GPU
# (bfloat16), and WORKERS rollout worker processes (`--workers`) that generate every batch with vLLM
# (job.worker_engine=vllm) on the same GPU, synchronously: every batch with exactly the trainer's
# current weights, published to the workers after each step (rollout.max_policy_lag=0). vLLM takes
# GPU_MEM of the GPU's memory (vllm.LLM gpu_memory_utilization); the trainer uses the rest.
# Held-out accuracy: the first HELDOUT rows of DATA, evaluated before training, every EVAL_EVERY steps
# and at the end (the trainer's transformers engine, temperature 0.6, system prompt dropped); the next
# TRAIN rows are the pool's questions. The math reward (math_think) is the training reward.
#
# MODEL is a local Hugging Face folder (the GPU machine reaches no network). vLLM must be importable
# by the workers (`pip install vllm` in the same environment). ENGINE=transformers generates with
# the transformers engine in the worker instead (no vLLM: a dry run of the same pipeline on a CPU).
#
# Budget (an estimate, never measured: the script has not been run on a GPU): with a 0.5B model,
# STEPS=10, B=32 questions x K=8 rollouts of up to 1,024 tokens, each step is about 15-25 s on an
# H200 (vLLM generation plus the update), each run ~1.5 min of start-up (model, vLLM engine and
# CUDA graphs, baseline evaluation) and ~3-4 min of steps: about 10 minutes for both arms.
set -euo pipefail
: "${MODEL:?set MODEL to a local Hugging Face model folder}"
DATA="${DATA:-../shared/data/exgrpo/valid.parquet}"
OUT="${OUT:-exgrpo-data/gpu-compare}"
STEPS="${STEPS:-10}"
SEEDS="${SEEDS:-0}"
HELDOUT="${HELDOUT:-128}"
TRAIN="${TRAIN:-1500}"
BATCH="${BATCH:-32}"
K="${K:-8}"
MAX_NEW_TOKENS="${MAX_NEW_TOKENS:-1024}"
MAX_PROMPT_LEN="${MAX_PROMPT_LEN:-1024}"
EVAL_EVERY="${EVAL_EVERY:-5}"
LR="${LR:-1e-6}"
WORKERS="${WORKERS:-1}"
ENGINE="${ENGINE:-vllm}"
GPU_MEM="${GPU_MEM:-0.35}"
EXGRPO="${EXGRPO:-exgrpo}"
PYTHON="${PYTHON:-python}" # the Python of the exgrpo command (for the vLLM check)
DRY_RUN="${DRY_RUN:-0}"

for n in STEPS HELDOUT TRAIN BATCH K MAX_NEW_TOKENS MAX_PROMPT_LEN EVAL_EVERY WORKERS; do
  if ! [[ "${!n}" =~ ^[1-9][0-9]*$ ]]; then
    echo "$n=${!n}: expected a positive integer" >&2
    exit 2
  fi
done
for s in $SEEDS; do
  if ! [[ "$s" =~ ^[0-9]+$ ]]; then
    echo "SEEDS=\"$SEEDS\": expected seeds separated by spaces, e.g. SEEDS=\"0 1 2\"" >&2
    exit 2
  fi
done
if [[ -z "${SEEDS// /}" ]]; then
  echo "SEEDS is empty" >&2
  exit 2
fi
case "$ENGINE" in
  vllm | transformers) ;;
  *) echo "ENGINE=$ENGINE: use vllm or transformers" >&2; exit 2 ;;
esac
if [[ "$DRY_RUN" != 1 ]]; then
  if [[ ! -f "$MODEL/config.json" ]]; then
    echo "MODEL=$MODEL: not a Hugging Face model folder (no config.json)" >&2
    exit 2
  fi
  if [[ ! -f "$DATA" ]]; then
    echo "DATA=$DATA: no such file" >&2
    exit 2
  fi
  if [[ "$ENGINE" == vllm ]] && ! "$PYTHON" -c "import vllm" 2>/dev/null; then
    echo "ENGINE=vllm: vLLM is not importable here (pip install vllm), or ENGINE=transformers" >&2
    exit 2
  fi
fi

settings=(
  model.dtype=auto model.max_prompt_len="$MAX_PROMPT_LEN" model.activation_checkpointing=true
  rollout.max_new_tokens="$MAX_NEW_TOKENS" rollout.grader=math_think rollout.temperature=1.0
  experience.batch_size="$BATCH" pool.k="$K" optim.lr="$LR" optim.mini_batches=2
  job.train_questions="$TRAIN" job.eval_every="$EVAL_EVERY" job.eval_temperature=0.6
  job.worker_engine="$ENGINE"
  run.steps="$STEPS" schedule.checkpoint_every=0
)
if [[ "$ENGINE" == vllm ]]; then
  settings+=(
    job.worker_vllm.gpu_memory_utilization="$GPU_MEM"
    job.worker_vllm.max_model_len=$((MAX_PROMPT_LEN + MAX_NEW_TOKENS))
  )
fi
settings+=("$@")

run() {
  echo "+ $*"
  if [[ "$DRY_RUN" != 1 ]]; then "$@"; fi
}

for seed in $SEEDS; do
  for arm in grpo exgrpo; do
    dir="$OUT/$arm/seed-$seed"
    if [[ -f "$dir/summary.json" ]]; then
      echo "$dir: done already"
      continue
    fi
    flags=(--model "$MODEL" --data "$DATA" --out "$dir" --seed "$seed" --heldout "$HELDOUT" --workers "$WORKERS")
    if [[ "$arm" == grpo ]]; then flags+=(--grpo); fi
    run rm -rf "$dir"
    run "$EXGRPO" run "${flags[@]}" "${settings[@]}"
  done
done
# the table and plots of `exgrpo experiment` over the finished runs (seeds as given)
seed_list="$(echo $SEEDS | tr ' ' ',')"
if [[ "$seed_list" != *,* ]]; then seed_list="$seed_list-$seed_list"; fi # one seed: a range of one
run "$EXGRPO" experiment --out "$OUT" --arms grpo,exgrpo --seeds "$seed_list" --report-only
echo "results: $OUT/results.md"

#!/bin/sh
# Start the ExGRPO trainer under torchrun: one node (compose) or one node of several (Kubernetes).
# Arguments go to `python -m exgrpo_trainer` (--config FILE key=value ...).
#
#   NPROC_PER_NODE     processes on this node, one per GPU (default 1)
#   NNODES             nodes in the job (default 1: torchrun --standalone)
#   NODE_RANK          this node's rank; default: JOB_COMPLETION_INDEX (Indexed Job), else the
#                      ordinal at the end of the host name (StatefulSet pod exgrpo-trainer-N), else 0
#   RDZV_ENDPOINT      host:port of the rendezvous when NNODES > 1, e.g.
#                      exgrpo-trainer-0.exgrpo-trainer:29500 (pod 0 behind the headless Service)
#   RDZV_BACKEND       c10d (default; node 0 hosts the store) or static (ranks = NODE_RANK)
#   RDZV_ID            rendezvous id, the same on every node (default exgrpo)
#   RDZV_JOIN_TIMEOUT  seconds to wait for all nodes (default 900)
#   MAX_RESTARTS       torchrun worker-group restarts (default 0: the pod restarts instead)
#   EXGRPO_LAUNCH_DRY_RUN=1  print the command, one argument per line, instead of running it
set -eu

nproc="${NPROC_PER_NODE:-1}"
nnodes="${NNODES:-1}"

if [ -z "${NODE_RANK:-}" ]; then
  if [ -n "${JOB_COMPLETION_INDEX:-}" ]; then
    NODE_RANK="$JOB_COMPLETION_INDEX"
  else
    host="${HOSTNAME:-$(hostname)}"
    ordinal="${host##*-}"
    case "$ordinal" in
      '' | *[!0-9]*) NODE_RANK=0 ;;
      *) NODE_RANK="$ordinal" ;;
    esac
  fi
fi
case "$NODE_RANK" in
  '' | *[!0-9]*) echo "launch-trainer: NODE_RANK must be a non-negative integer, got '$NODE_RANK'" >&2; exit 2 ;;
esac
export NODE_RANK

if [ "$nnodes" = "1" ]; then
  set -- torchrun --standalone --nnodes=1 "--nproc-per-node=$nproc" \
    "--max-restarts=${MAX_RESTARTS:-0}" -m exgrpo_trainer "$@"
else
  if [ -z "${RDZV_ENDPOINT:-}" ]; then
    echo "launch-trainer: NNODES=$nnodes needs RDZV_ENDPOINT (host:port of node 0)" >&2
    exit 2
  fi
  case "${RDZV_BACKEND:-c10d}" in
    c10d)
      # Node 0 hosts the rendezvous store: say so instead of letting torchrun guess from DNS,
      # which may not resolve the pod's own headless name before it is ready.
      is_host=false
      if [ "$NODE_RANK" = "0" ]; then is_host=true; fi
      set -- torchrun "--nnodes=$nnodes" "--nproc-per-node=$nproc" \
        --rdzv-backend=c10d "--rdzv-endpoint=$RDZV_ENDPOINT" "--rdzv-id=${RDZV_ID:-exgrpo}" \
        "--rdzv-conf=is_host=$is_host,join_timeout=${RDZV_JOIN_TIMEOUT:-900}" \
        "--max-restarts=${MAX_RESTARTS:-0}" -m exgrpo_trainer "$@"
      ;;
    static)
      set -- torchrun "--nnodes=$nnodes" "--nproc-per-node=$nproc" --rdzv-backend=static \
        "--master-addr=${RDZV_ENDPOINT%:*}" "--master-port=${RDZV_ENDPOINT##*:}" \
        "--node-rank=$NODE_RANK" "--max-restarts=${MAX_RESTARTS:-0}" -m exgrpo_trainer "$@"
      ;;
    *)
      echo "launch-trainer: RDZV_BACKEND must be c10d or static, got '${RDZV_BACKEND}'" >&2
      exit 2
      ;;
  esac
fi

if [ "${EXGRPO_LAUNCH_DRY_RUN:-0}" = "1" ]; then
  printf '%s\n' "$@"
  exit 0
fi
echo "launch-trainer: node $NODE_RANK of $nnodes, $nproc process(es): $*" >&2
exec "$@"

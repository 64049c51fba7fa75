#!/usr/bin/env bash
# Body of the sbatch scripts (run inside the batch job, not submitted itself):
#   srun_pretrain.sh ENTRY --config FILE [section.key=value ...]
# starts ENTRY once per task of the allocation with srun: rank = SLURM_PROCID, one rank per CPU
# task or per GPU. MASTER_ADDR/MASTER_PORT (first node, port from the job id) are exported unless
# already set. A rank that exits non-zero ends the whole step (--kill-on-bad-exit). The config, and
# the checkpoint it would resume, is checked once for the job's task count first: a bad one is one
# line in the log, exit 2, no srun.
# After a stop signal (the --signal=USR1 time-limit warning) that saved a checkpoint the job
# resumes from (checkpoint.load=auto), the job requeues itself (scontrol requeue).
set -euo pipefail
: "${SLURM_JOB_ID:?run inside a SLURM job: sbatch [options] scripts/slurm/pretrain_gpt_moe.sbatch ...}"
ENTRY=$1
shift
if [ "${1:-}" != "--config" ] || [ -z "${2:-}" ]; then
  echo "usage: sbatch [sbatch options] scripts/slurm/${ENTRY%.py}.sbatch --config FILE [section.key=value ...]" >&2
  exit 2
fi
if [ ! -f "$2" ]; then
  echo "config file not found: $2 (relative paths are relative to $(pwd))" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
source "$ROOT/scripts/python_env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
  export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK  # srun of Slurm 22.05-23.02 does not inherit it
fi
read -r MASTER_ADDR MASTER_PORT < <("$PYTHON" -m megatron_moe.distributed.launch master)
export MASTER_ADDR MASTER_PORT
ntasks=${SLURM_NTASKS:-$SLURM_JOB_NUM_NODES}  # unset with only -N: srun then starts one per node
echo "[$(date '+%F %T')] job $SLURM_JOB_ID ($SLURM_JOB_NAME): $ntasks tasks on $SLURM_JOB_NODELIST," \
  "master $MASTER_ADDR:$MASTER_PORT, OMP_NUM_THREADS=$OMP_NUM_THREADS"
echo "command: $PYTHON $ROOT/$ENTRY $*"
# Rank 0 (on this, the job's first node) writes the checkpoint's path here when a stop signal ended
# the ranks with a checkpoint that a requeued job resumes from (checkpoint.load=auto). A caller that
# requeues the job itself (tools/sweep.py's array tasks) sets MEGATRON_MOE_REQUEUE=caller.
unset MEGATRON_MOE_REQUEUE_FILE
if [ "${MEGATRON_MOE_REQUEUE:-script}" = script ]; then
  requeue_dir=$(mktemp -d "${TMPDIR:-/tmp}/megatron_moe-$SLURM_JOB_ID.XXXXXX")
  trap 'rm -rf "$requeue_dir"' EXIT
  export MEGATRON_MOE_REQUEUE_FILE=$requeue_dir/requeue
fi
status=0
"$PYTHON" "$ROOT/$ENTRY" --check-config --world-size "$ntasks" "$@" || status=$?  # once, before any rank
if [ "$status" -eq 0 ]; then
  srun --kill-on-bad-exit=1 --label "$PYTHON" -u "$ROOT/$ENTRY" "$@" || status=$?
fi
echo "[$(date '+%F %T')] job $SLURM_JOB_ID finished with exit code $status"
if [ "$status" -eq 0 ] && [ -f "${MEGATRON_MOE_REQUEUE_FILE:-}" ]; then
  echo "[$(date '+%F %T')] requeueing job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) to resume from" \
    "$(cat "$MEGATRON_MOE_REQUEUE_FILE")"
  # on success slurmctld ends this script; --no-requeue jobs are refused
  scontrol requeue "$SLURM_JOB_ID" ||
    echo "[$(date '+%F %T')] job $SLURM_JOB_ID not requeued: resume it with a new job (checkpoint.load=auto)"
fi
exit "$status"

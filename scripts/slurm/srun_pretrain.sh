#!/usr/bin/env bash
# Body of the sbatch scripts (run inside the batch job, not submitted itself):
#   srun_pretrain.sh ENTRY --config FILE [section.key=value ...]
# starts ENTRY once per task of the allocation with srun: rank = SLURM_PROCID, one rank per CPU
# task or per GPU. MASTER_ADDR/MASTER_PORT (first node, port from the job id) are exported unless
# already set. A rank that exits non-zero ends the whole step (--kill-on-bad-exit). The config is
# checked once for the job's task count first: a bad one is one line in the log, exit 2, no srun.
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
status=0
"$PYTHON" "$ROOT/$ENTRY" --check-config --world-size "$ntasks" "$@" || status=$?  # once, before any rank
if [ "$status" -eq 0 ]; then
  srun --kill-on-bad-exit=1 --label "$PYTHON" -u "$ROOT/$ENTRY" "$@" || status=$?
fi
echo "[$(date '+%F %T')] job $SLURM_JOB_ID finished with exit code $status"
exit "$status"

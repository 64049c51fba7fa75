#!/usr/bin/env bash
# Train on this machine with torchrun: NPROC processes (gloo on CPU, NCCL with one GPU each).
#   scripts/run_local.sh NPROC CONFIG [section.key=value ...]
#   scripts/run_local.sh 4 configs/gpt_moe_tiny.yaml parallel.expert=2 training.train_iters=20
# ENTRY=pretrain_bert_moe.py selects the BERT entry point; OMP_NUM_THREADS defaults to 1.
# The config (and the checkpoint it resumes) is checked once for NPROC processes first: a bad one is
# one line, exit 2, no workers. torchrun runs inside megatron_moe/training/run_local.py: Ctrl-C or
# SIGTERM reaches every worker, which finishes its iteration, saves and exits 0, and so does this
# script (a second Ctrl-C aborts, exit 130); a worker's config error is its one line and exit 2.
set -euo pipefail
if [ $# -lt 2 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
  echo "usage: $0 NPROC CONFIG [section.key=value ...]" >&2
  exit 2
fi
NPROC=$1 CONFIG=$2
shift 2
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/python_env.sh"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
entry=$ROOT/${ENTRY:-pretrain_gpt_moe.py}
"$PYTHON" "$entry" --check-config --world-size "$NPROC" --config "$CONFIG" "$@" >/dev/null || exit $?
exec "$PYTHON" -m megatron_moe.training.run_local "$NPROC" "$entry" --config "$CONFIG" "$@"

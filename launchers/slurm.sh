#!/bin/bash
# Multi-node training under SLURM: one task per GPU started by srun (no torchrun in between), so
# SLURM's pre-timeout SIGTERM reaches every rank and the run saves a final checkpoint and exits 0.
# The run then says how it ended (FOCUS_EXIT_STATUS_FILE): after a stop by signal this script
# requeues the job (`scontrol requeue`), which resumes from `latest`; when training is done, or
# after a crash (non-zero exit), it does not.
#
#   sbatch launchers/slurm.sh configs/7b.yaml
#   sbatch --nodes 2 launchers/slurm.sh configs/7b.yaml --set run.output_dir=runs/7b-a
#
# Each task's rank comes from SLURM_PROCID, the world size from SLURM_STEP_NUM_TASKS (set by srun
# inside the job step) and the local device from SLURM_LOCALID; MASTER_ADDR and MASTER_PORT
# (exported below, both required) name the rendezvous on the first node. These are the variables
# focus_pretrain.parallel.launch_environment reads.
#SBATCH --job-name=focus-pretrain
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=48:00:00
#SBATCH --signal=TERM@300
#SBATCH --requeue
#SBATCH --output=%x-%j.out
set -euo pipefail

CONFIG=${1:?usage: sbatch launchers/slurm.sh CONFIG [--set section.key=value ...]}
shift
cd "${SLURM_SUBMIT_DIR:-.}"
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$SLURM_CPUS_PER_TASK}
PYTHON=${PYTHON:-python}

# on the shared file system: rank 0 writes it, this script (first node) reads it
export FOCUS_EXIT_STATUS_FILE=${FOCUS_EXIT_STATUS_FILE:-$PWD/.focus-exit-$SLURM_JOB_ID}
rm -f "$FOCUS_EXIT_STATUS_FILE"
trap 'rm -f "$FOCUS_EXIT_STATUS_FILE"' EXIT  # also when srun fails (set -e)

srun --kill-on-bad-exit=1 --cpu-bind=none \
    "$PYTHON" launchers/pretrain.py --config "$CONFIG" "$@"

status=$(cat "$FOCUS_EXIT_STATUS_FILE" 2>/dev/null || echo "missing")
case "$status" in
  stopped_by_signal*)
    echo "focus-pretrain: $status; requeueing job $SLURM_JOB_ID"
    scontrol requeue "$SLURM_JOB_ID" ;;
  done*) echo "focus-pretrain: training done ($status); not requeued" ;;
  *) echo "focus-pretrain: no exit status ($status); not requeued" >&2; exit 1 ;;
esac

#!/bin/bash
# Slurm recipe for one ANDREA run on several nodes (docs/operations.md#several-nodes), surviving
# pre-emption and time limits.
#
#   sbatch --nodes=2 scripts/slurm_multinode.sh /shared/runs/a120 --preset andrea-120m
#
# What happens:
#  * srun starts one `proxy run` per node with the same options; RUN_DIR must be on a filesystem
#    every node shares (NFS, Lustre, GPFS; its flock need not be shared between hosts: the
#    owner's record in RUN_DIR beats). The first proxy to claim the run owns it (history, bandit,
#    checkpoints; global rank 0 runs on its node); the others follow
#    (docs/architecture.md#several-nodes). Exercised on one machine by tests/test_nodes.py with
#    the stand-ins in tests/fake_slurm/ (srun, scontrol).
#  * --rdzv-id is the job id, so a requeued job (same id) on the same directory resumes it; a
#    second job given the same directory is refused while the first one runs.
#  * --signal=B:USR1@300: 300 s before the time limit Slurm signals this batch shell; the trap
#    sends SIGTERM to the run's owner proxy only (its host and pid are in RUN_DIR/.proxy.owner.json):
#    every rank agrees on one checkpoint step, every proxy exits 0, and the job requeues itself.
#  * Pre-emption (PreemptMode=REQUEUE with a GraceTime) sends SIGTERM to every process of the
#    job: each proxy stops its node's ranks, the ranks agree on one step, rank 0 writes one
#    checkpoint. torchrun's agents get it too and give their ranks 30 s before SIGKILL: the rest
#    of a step plus one checkpoint write must fit in that and in the partition's GraceTime.
#  * `scancel --signal=USR2 --batch <jobid>` asks for a checkpoint without stopping: the trap
#    sends SIGUSR1 to the owner proxy only (SIGUSR1 to a torchrun agent would stop everything).
#  * A node that dies (kill -9, hardware) makes the owner restart from the newest checkpoint as
#    soon as a node joins again, or exit 1 after --rdzv-timeout; Slurm does not restart one
#    task of a step, so with --requeue the whole job comes back and resumes.
#SBATCH --job-name=andrea-multi
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gres=gpu:8
#SBATCH --cpus-per-task=64
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=andrea-%j.out

set -u
RUN_DIR=${1:?usage: sbatch slurm_multinode.sh RUN_DIR [proxy run options]}
shift
PY=${ANDREA_PYTHON:-.venv/bin/python}
GPUS=${ANDREA_GPUS_PER_NODE:-8}
PORT=${ANDREA_RDZV_PORT:-29400}   # the job beacon's port on the first node (the store's is picked)
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)

# One proxy per node, in the background so this shell can take signals while it waits.
srun --ntasks-per-node=1 --kill-on-bad-exit=0 \
    "$PY" -m proxy run --run-dir "$RUN_DIR" --nnodes "$SLURM_JOB_NUM_NODES" \
    --nproc-per-node "$GPUS" --rdzv-id "$SLURM_JOB_ID" --rdzv-endpoint "$HEAD:$PORT" "$@" &
STEP=$!
REQUEUE=0

signal_owner() {   # $1: TERM or USR1, to the owner proxy on its node
    local host pid
    host=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["host"])' "$RUN_DIR/.proxy.owner.json")
    pid=$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["pid"])' "$RUN_DIR/.proxy.owner.json")
    echo "$(date -Is) SIG$1 to the owner proxy $pid on $host"
    srun --overlap --nodes=1 --ntasks=1 -w "$host" kill -"$1" "$pid"
}
on_time_limit() { REQUEUE=1; signal_owner TERM; }
on_checkpoint() { signal_owner USR1; }
on_term()       { signal_owner TERM; }
trap on_time_limit USR1
trap on_checkpoint USR2
trap on_term TERM INT

while kill -0 "$STEP" 2>/dev/null; do
    wait "$STEP"   # a trap interrupts it (status > 128): wait again while srun runs
done
wait "$STEP"       # srun's own exit code, which bash keeps
RC=$?
echo "$(date -Is) srun step exited with code $RC"
if [ "$REQUEUE" = 1 ] && [ "$RC" = 0 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$RC"

#!/bin/bash
# Batch-scheduler example (Slurm) for an ANDREA run that survives pre-emption and time limits
# (docs/operations.md#slurm).
#
#   sbatch scripts/slurm_preempt.sh runs/main [extra `proxy run` options]
#
# What happens:
#  * --signal=B:USR1@300: 300 s before the time limit Slurm sends SIGUSR1 to this batch shell
#    only (B:), not to every process of the job. The trap turns it into SIGTERM for the proxy:
#    the worker finishes its step, writes a checkpoint, both exit 0, and the job requeues itself.
#  * Pre-emption (PreemptMode=REQUEUE with a GraceTime) sends SIGTERM to all processes of the job
#    (the worker too): the proxy and worker both stop cleanly on it (the worker coalesces the
#    direct SIGTERM and the forwarded one), within the rest of a step + one write + ~2 s; make the
#    partition's GraceTime cover that.
#  * `scancel --signal=USR2 --batch <jobid>` asks for a checkpoint without stopping: forwarded to
#    the proxy as SIGUSR1 (a pinned checkpoint after the current step).
#  * Polish pivots (docs/pivots.md): run `python -m proxy pivot --run-dir RUN_DIR --caps ...`
#    from a shell on the node (`srun --jobid <jobid> --overlap --pty bash`, or ssh); the proxy
#    of this job step does the pivot in place (same pid, inside the job), so the traps above and
#    Slurm's signals keep reaching it. A pivot on a stopped/queued run is recorded and the next
#    (requeued) start trains in the new phase.
#  * The requeued job runs this script again; `proxy run` on the same directory resumes from the
#    newest valid checkpoint, bit-exactly.
#SBATCH --job-name=andrea
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=andrea-%j.out

set -u
RUN_DIR=${1:?usage: sbatch slurm_preempt.sh RUN_DIR [proxy run options]}
shift
PY=${ANDREA_PYTHON:-.venv/bin/python}

# The proxy runs in the background so this shell can take signals while it waits.
"$PY" -m proxy run --run-dir "$RUN_DIR" "$@" &
PROXY=$!
REQUEUE=0

on_time_limit() {   # SIGUSR1 from --signal=B:USR1@300: stop with a checkpoint, then requeue
    echo "$(date -Is) time limit near: SIGTERM to proxy $PROXY (checkpoint and stop)"
    REQUEUE=1
    kill -TERM "$PROXY" 2>/dev/null
}
on_checkpoint() {   # SIGUSR2 (scancel --signal=USR2 --batch): checkpoint now, keep training
    echo "$(date -Is) checkpoint requested: SIGUSR1 to proxy $PROXY"
    kill -USR1 "$PROXY" 2>/dev/null
}
on_term() {         # pre-emption / scancel: stop with a checkpoint (requeued by Slurm if set up)
    echo "$(date -Is) SIGTERM: forwarding to proxy $PROXY"
    kill -TERM "$PROXY" 2>/dev/null
}
trap on_time_limit USR1
trap on_checkpoint USR2
trap on_term TERM INT

# `wait` returns early whenever a trapped signal arrives: keep waiting for the proxy itself.
while kill -0 "$PROXY" 2>/dev/null; do
    wait "$PROXY"
    RC=$?
done
wait "$PROXY" 2>/dev/null; RC=${RC:-$?}
echo "$(date -Is) proxy exited with code $RC"
if [ "$REQUEUE" = 1 ] && [ "$RC" = 0 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
    scontrol requeue "$SLURM_JOB_ID"
fi
exit "$RC"

#!/bin/bash
# K-FAC on ImageNet under Slurm, requeued until the run is done.
#
#   sbatch docs/jobs/slurm.sh            (from the checkout)
#
# Slurm sends this script SIGUSR1 ten minutes before the time limit
# (--signal=B:USR1@600); the trap below forwards it to mpiexec, which
# forwards it to every rank: they stop at the end of the optimizer step in
# progress, write the snapshot and exit with status 75 ("resume me"). The
# job then requeues itself and the next run continues with --resume latest.
# Leave the lead time above the step in progress plus the snapshot write
# (docs/imagenet.md, "Running under a batch scheduler"). Do not forward
# SIGTERM to mpiexec: Open MPI kills the ranks 0.25 s after it.
#
#SBATCH --job-name=kfac-bs32k
#SBATCH --nodes=16
#SBATCH --ntasks-per-node=4
#SBATCH --gpus-per-node=4
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@600
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=kfac-bs32k.%j.out

set -u

# What to run (the variables let a stand-in scheduler drive this script in
# the tests: tests/scripts/test_job_scripts.py and test_preemption.py).
OUT=${OUT:-result/bs32k}
# --no-progress: plain lines in the job's log file, not a progress bar's
# terminal escape codes.
ARGS=${ARGS:-"train.txt val.txt --root /data/imagenet --config config/bs32k.json --gpu --snapshot-every 30min --no-progress"}
LAUNCH=${LAUNCH:-"mpiexec --bind-to none python train_imagenet.py"}
REQUEUE=${REQUEUE:-"scontrol requeue ${SLURM_JOB_ID:-}"}
RESUME_STATUS=75

resume=
if compgen -G "$OUT/snapshot_step_*.rank0" > /dev/null; then
    resume="--resume latest"
fi
# shellcheck disable=SC2086  # the commands and options are word lists
$LAUNCH $ARGS --out "$OUT" $resume &
pid=$!
trap 'kill -USR1 "$pid" 2> /dev/null' USR1
# A trapped signal ends `wait` early: wait until mpiexec itself is done.
while kill -0 "$pid" 2> /dev/null; do
    wait "$pid"
done
wait "$pid"
status=$?

if [ "$status" -eq "$RESUME_STATUS" ]; then
    echo "$(date): stopped by the signal, snapshot written: requeueing"
    if ! $REQUEUE; then
        # Not a success: the run is unfinished and nothing will continue it.
        echo "$(date): the requeue failed ($REQUEUE): resubmit this script" \
            "by hand; the next job continues with --resume latest" >&2
        exit "$RESUME_STATUS"
    fi
    exit 0
fi
exit "$status"

#!/bin/bash
# K-FAC on ImageNet under PBS Pro / Torque, resubmitted until the run is
# done.
#
#   qsub docs/jobs/pbs.sh                (from the checkout)
#
# PBS sends no signal ahead of the wall-time limit, so this script keeps
# its own clock: LEAD_S seconds before WALLTIME_S it sends SIGUSR1 to
# mpiexec, which forwards it to every rank: they stop at the end of the
# optimizer step in progress, write the snapshot and exit with status 75
# ("resume me"); the script then submits the next job, which continues with
# --resume latest. A SIGTERM that reaches only this script (qdel on some
# sites) is forwarded the same way, so that the snapshot is written, but
# nothing is resubmitted: a cancelled job stays cancelled (resubmit it by
# hand to continue). One that reaches mpiexec too ends the ranks 0.25 s
# later (Open MPI), and a later job falls back to the newest whole
# snapshot (--snapshot-every 30min bounds what is lost).
#
# Submit from a shell whose `python` and `mpiexec` are the project's (e.g.
# after `. .venv/bin/activate`): with -V the environment travels with this
# job and with each one it submits (OUT, ARGS, ... included).
#
#PBS -N kfac-bs32k
#PBS -l select=16:ncpus=40:ngpus=4:mpiprocs=4
#PBS -l walltime=24:00:00
#PBS -j oe
#PBS -r y
#PBS -V

set -u
cd "${PBS_O_WORKDIR:-.}" || exit 1

# What to run (the variables let a stand-in scheduler drive this script in
# the tests: tests/scripts/test_job_scripts.py and test_preemption.py).
OUT=${OUT:-result/bs32k}
# --no-progress: plain lines in the job's log file, not a progress bar's
# terminal escape codes.
ARGS=${ARGS:-"train.txt val.txt --root /data/imagenet --config config/bs32k.json --gpu --snapshot-every 30min --no-progress"}
LAUNCH=${LAUNCH:-"mpiexec --bind-to none python train_imagenet.py"}
REQUEUE=${REQUEUE:-"qsub -V docs/jobs/pbs.sh"}
WALLTIME_S=${WALLTIME_S:-86400}     # the walltime requested above
LEAD_S=${LEAD_S:-600}               # > the step in progress + the write
RESUME_STATUS=75

resume=
if compgen -G "$OUT/snapshot_step_*.rank0" > /dev/null; then
    resume="--resume latest"
fi
# shellcheck disable=SC2086  # the commands and options are word lists
$LAUNCH $ARGS --out "$OUT" $resume &
pid=$!
cancelled=
trap 'kill -USR1 "$pid" 2> /dev/null' USR1
trap 'cancelled=1; kill -USR1 "$pid" 2> /dev/null' TERM
# The clock: SIGUSR1 at LEAD_S before the wall-time limit. Its output goes
# nowhere: a sleep left by a TERM that came before `sleeper` was set must
# not hold the job's output open.
(
    trap 'kill "${sleeper:-}" 2> /dev/null; exit 0' TERM
    sleep $((WALLTIME_S - LEAD_S)) &
    sleeper=$!
    wait "$sleeper" && kill -USR1 "$pid" 2> /dev/null
) > /dev/null 2>&1 &
clock=$!
# A trapped signal ends `wait` early: wait until mpiexec itself is done.
while kill -0 "$pid" 2> /dev/null; do
    wait "$pid"
done
wait "$pid"
status=$?
kill "$clock" 2> /dev/null

if [ "$status" -eq "$RESUME_STATUS" ] && [ -n "$cancelled" ]; then
    echo "$(date): stopped by SIGTERM (qdel?), snapshot written: not" \
        "resubmitted (resubmit this script by hand to continue)"
    exit "$RESUME_STATUS"
fi
if [ "$status" -eq "$RESUME_STATUS" ]; then
    echo "$(date): stopped before the wall-time limit, snapshot written: resubmitting"
    if ! $REQUEUE; then
        # Not a success: the run is unfinished and nothing will continue it.
        echo "$(date): the resubmission failed ($REQUEUE): resubmit this" \
            "script by hand; the next job continues with --resume latest" >&2
        exit "$RESUME_STATUS"
    fi
    exit 0
fi
exit "$status"

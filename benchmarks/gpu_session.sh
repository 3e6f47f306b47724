#!/usr/bin/env bash
# One lent GPU machine, one call: the checks of issue 26 in order of what
# they tell, each cut to the time left, everything packed into one file.
#
#     bash benchmarks/gpu_session.sh            (from the project root)
#
# On the lent machine (docs/gpu.md, "For the next GPU session"): carry
# .whl/ (Chainer's wheel) and, for the peer, kfac-pytorch's kfac/ folder
# (PEER_PATH, default gpu_scratch/peer); the device call has a time
# limit, so set BUDGET (seconds, default 555) a little under it. Only a
# few files come back from such a call: the results go into
# $OUT/gpu_session.tgz (rewritten after every step, so a call cut short
# still returns what ran), beside timeline.txt, which says what each step
# took and how it ended.
#
# The steps: the step times at batch 32 against the peer (the goals; the
# replayed refresh cycle and refresh passes), the GPU suite (single
# process), a kernel profile of a refresh step at batch 32 (replayed but
# for its inverses, as a default run takes it), batches 64 and 128, then
# 256, against the peer, the inverse stage's routes, the GPU suite under
# mpiexec -n 1,2 and the host's work before a replay. DRY_RUN=1 prints
# them instead; STEPS (names, comma-separated) runs only those, e.g. the
# rest in a second call.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2

OUT=${OUT:-result/gpu_session}
WORK=${WORK:-$(mktemp -d)}
BUDGET=${BUDGET:-555}
PEER_PATH=${PEER_PATH:-gpu_scratch/peer}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
mkdir -p "$OUT" "$WORK" || exit 2
START=$(date +%s)
DEADLINE=$((START + BUDGET))

say() {
    echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$WORK/timeline.txt"
    cp "$WORK/timeline.txt" "$OUT/timeline.txt"
}

pack() {
    (cd "$WORK" && tar czf "$OUT/gpu_session.tgz.part" . &&
        mv "$OUT/gpu_session.tgz.part" "$OUT/gpu_session.tgz")
}

# step NAME CAP COMMAND...: COMMAND's output in NAME.log, cut at CAP
# seconds or at the deadline (less a margin to pack), whichever is first
step() {
    local name=$1 cap=$2
    shift 2
    local left=$(( DEADLINE - $(date +%s) - 10 ))
    local limit=$(( cap < left ? cap : left ))
    if [ -n "${STEPS:-}" ] && [[ ",$STEPS," != *",$name,"* ]]; then
        [ "${DRY_RUN:-0}" = 1 ] || say "$name: not in STEPS"
        return 0
    fi
    if [ "${DRY_RUN:-0}" = 1 ]; then
        echo "$name (at most ${cap}s): $*"
        return 0
    fi
    if [ "$limit" -lt 20 ]; then
        say "$name: skipped, ${left}s left"
        return 0
    fi
    say "$name: start (at most ${limit}s): $*"
    timeout -k 5 "$limit" "$@" > "$WORK/$name.log" 2>&1
    local rc=$?
    say "$name: exit $rc$( [ $rc = 124 ] && echo ' (cut at its limit)')"
    pack
}

export PYTHONPATH="$SITE:$PWD:$PWD/$PEER_PATH${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 \
    OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
if [ "${DRY_RUN:-0}" != 1 ]; then
    if ! "$PY" -c 'import chainerkfac, chainer' > /dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile \
            --target "$SITE" .whl/chainer-*.whl || exit 2
    fi
    nvidia-smi -L > "$WORK/device.txt" 2>&1
    git log --oneline -1 >> "$WORK/device.txt" 2>&1
    say "set up"
fi

SWEEP=sgd,kfac_every,kfac_stale,kfac_low_rank,sgd_graph,kfac_stale_graph,kfac_every_graph
step step_time_b32 150 "$PY" -m benchmarks.step_time --gpu --peer \
    --models resnet50 --resnet50-rounds 7 --variants "$SWEEP" \
    --out "$WORK/step_time_b32.json"
step gpu_suite 220 env LOG="$WORK/gpu_suite_full.log" PY="$PY" \
    bash tests/gpu/run.sh single
step kernel_profile_b32 90 "$PY" -m benchmarks.kernel_profile --batch 32 \
    --variants kfac_every_graph --out "$WORK/kernel_profile_b32.json"
step sweep_64_128 190 "$PY" -m benchmarks.step_time --gpu --peer \
    --models resnet50 --resnet50-rounds 5 --batches 64,128 \
    --out "$WORK/sweep.json"
step sweep_256 170 "$PY" -m benchmarks.step_time --gpu --peer \
    --models resnet50 --resnet50-rounds 3 --batches 256 \
    --out "$WORK/sweep_256.json"
step inverse_routes 50 "$PY" -m benchmarks.step_time --gpu --inverse-only \
    --cholesky-inverses potri,potrs,auto --out "$WORK/inverse_only.json"
step gpu_suite_mpi 70 env LOG="$WORK/gpu_suite_mpi_full.log" PY="$PY" \
    MPI_SIZES=1,2 MPI_TIMEOUT=60 bash tests/gpu/run.sh mpi
step replay_host 30 "$PY" -m benchmarks.replay_host \
    --out "$WORK/replay_host.json"
[ "${DRY_RUN:-0}" = 1 ] && exit 0
say "end"
pack
# the goals, read where the call's output is all that comes back
grep -h -A12 'Goals against the peer' "$WORK"/step_time_b32.log \
    "$WORK"/sweep_64_128.log 2>/dev/null | cut -c1-150
exit 0

"""A scheduler's signal stops a run under ``mpiexec -n 2`` and ``-n 3`` at
the end of the optimizer step in progress, snapshotted, with exit status
75; resumed with ``--resume latest`` until done, the run ends bit for bit
as the uninterrupted one: weights, BatchNormalization statistics, the
optimizer state (the final snapshot of every rank, key by key), the log
apart from timings, ``fisher_diff.jsonl``.

The stops fall at points drawn from seeds 0-9 (``signal_at``: during an
accumulation, a refresh step, an evaluation, a snapshot write; received
by one rank or by all; SIGUSR1 or SIGTERM), one after the other in one
chain of resumed runs per number of processes. Snapshots are taken every
3 iterations, so most stops and resumes fall inside an epoch. Then the
signal as a scheduler sends it: SIGUSR1 to ``mpiexec``, which forwards it
to every rank and to the ranks' loader processes (which must survive it);
and SIGKILL right after the signal, which falls back to the newest whole
snapshot.
"""
import json
import os
import random
import signal
import subprocess
import time

import numpy
import pytest

from tests import launch
from tests.scripts import imagenet_like
from tests.scripts import conftest
from tests.scripts.conftest import command, kill, read_log, run, \
    session_processes, start, weights

#: Global batch 24 = 4 per process x 2 processes x 3 micro-batches, or x 3
#: processes x 2; 48 images: 2 steps per epoch, 8 steps in all.
CONFIG = {'global_batch_size': 24, 'batch_size_per_process': 4,
          'epochs': 4}
STEPS = 8
RESUME_STATUS = 75
#: Values of the log that depend on the machine's speed.
TIMING = ('elapsed_time', 'images_per_sec')
PHASES = ('micro', 'refresh', 'evaluate', 'write')
#: The seeds of the stop points of each chain.
CHAINS = {2: range(0, 6), 3: range(6, 10)}


def preempt_command(dataset, out, *extra):
    config = imagenet_like.write_config(dataset['root'], 'preempt.json',
                                        **CONFIG)
    return command(dataset, out, '--fisher-diff', '--snapshot-every', '3it',
                   '--keep-snapshots', '0', '--loaderjob', '0', *extra,
                   config=config)


def stop_point(seed, nproc):
    """``signal_at``'s PHASE:N:RANKS:SIGNAL of one seed: each phase in
    turn; an occurrence early in the resumed run (a micro-batch inside an
    accumulation; every write from the first: a second signal arrives
    while the stop's snapshot is written); one rank or all; SIGUSR1 or
    SIGTERM."""
    rng = random.Random(seed)
    phase = PHASES[seed % len(PHASES)]
    acc_iters = CONFIG['global_batch_size'] // (
        CONFIG['batch_size_per_process'] * nproc)
    n = rng.choice([i for i in range(2, 2 * acc_iters + 1)
                    if (i - 1) % acc_iters]) if phase == 'micro' else 1
    if phase == 'write':
        n = '1+'

    ranks = rng.choice(['all'] + [str(r) for r in range(nproc)])
    return '{}:{}:{}:{}'.format(phase, n, ranks, rng.choice(['USR1',
                                                             'TERM']))


def signal_at(cmd, spec):
    """``cmd`` (``python train_imagenet.py ...``) under ``signal_at``."""
    assert cmd[1].endswith('train_imagenet.py')
    return [cmd[0], '-m', 'tests.scripts.signal_at', spec, '--'] + cmd[2:]


@pytest.fixture(scope='module')
def uninterrupted(dataset, tmp_path_factory):
    """``{nproc: dir}`` of the runs never stopped."""
    out = {}
    for nproc in CHAINS:
        directory = str(tmp_path_factory.mktemp('uninterrupted{}'.format(
            nproc)))
        result = run(preempt_command(dataset, directory), nproc)
        assert result.returncode == 0, result.stdout[-3000:]
        out[nproc] = directory
    return out


def final_snapshot(directory, rank):
    return os.path.join(directory, 'snapshot_step_{}.rank{}'.format(
        STEPS, rank))


def without_timing(entries):
    return [{k: v for k, v in e.items() if k not in TIMING}
            for e in entries]


def assert_same_run(reference, out, nproc):
    """Bit for bit, timings apart."""
    want, got = read_log(reference), read_log(out)
    assert len(got) == CONFIG['epochs']
    assert without_timing(got) == without_timing(want)
    final = weights(os.path.join(out, 'model_final.npz'))
    expected = weights(os.path.join(reference, 'model_final.npz'))
    assert sorted(final) == sorted(expected)
    for key in expected:
        numpy.testing.assert_array_equal(final[key], expected[key], key)
    for rank in range(nproc):
        with numpy.load(final_snapshot(reference, rank)) as a, \
                numpy.load(final_snapshot(out, rank)) as b:
            assert sorted(a.files) == sorted(b.files)
            for key in a.files:
                if key in ('_snapshot_elapsed_time', 'run/id'):
                    continue        # (the id: of two runs, not their state)
                if key == 'extensions/LogReport/_log':
                    assert without_timing(json.loads(str(b[key]))) == \
                        without_timing(json.loads(str(a[key])))
                    continue
                numpy.testing.assert_array_equal(b[key], a[key],
                                                 'rank {}: {}'.format(
                                                     rank, key))
    with open(os.path.join(reference, 'fisher_diff.jsonl')) as f, \
            open(os.path.join(out, 'fisher_diff.jsonl')) as g:
        assert g.read() == f.read()


def resume_until_done(dataset, out, nproc, tries=3):
    for _ in range(tries):
        result = run(preempt_command(dataset, out, '--resume', 'latest'),
                     nproc)
        if result.returncode == 0:
            return result
        assert result.returncode == RESUME_STATUS, result.stdout[-3000:]
    raise AssertionError('not done after {} resumes'.format(tries))


@pytest.mark.slow
@pytest.mark.parametrize('nproc', sorted(CHAINS))
def test_stopped_at_random_points_and_resumed_ends_bit_for_bit(
        dataset, uninterrupted, tmp_path, nproc):
    out = str(tmp_path)
    seeds = list(CHAINS[nproc])
    stops = 0
    for i, seed in enumerate(seeds):
        spec = stop_point(seed, nproc)
        extra = ('--resume', 'latest') if i else ()
        result = run(signal_at(preempt_command(dataset, out, *extra), spec),
                     nproc)
        phase = spec.split(':')[0]
        assert 'in {} #'.format(phase) in result.stdout, (spec, result.stdout[
            -3000:])
        if i:
            assert 'resumed from' in result.stdout
        if result.returncode == 0:
            # The signal came in the run's last step (the last seed's, or
            # on a loaded machine a writer thread's signal handled a step
            # late): the run is complete.
            assert '"final_top1"' in result.stdout, result.stdout[-3000:]
            break
        assert result.returncode == RESUME_STATUS, (spec, result.stdout[
            -3000:])
        assert 'stopped by SIG' in result.stdout, spec
        stops += 1
    else:
        resume_until_done(dataset, out, nproc)
    assert stops >= len(seeds) - 2
    assert_same_run(uninterrupted[nproc], out, nproc)


def wait_for_snapshot(out, step, nproc, process, timeout=240):
    deadline = time.time() + timeout
    while not all(os.path.exists(os.path.join(out, 'snapshot_step_{}.rank{}'
                                              .format(step, r)))
                  for r in range(nproc)):
        # a Launch starts its run again if the launcher failed; a job
        # script's Popen is what it is
        alive = (process.running() if isinstance(process, conftest.Launch)
                 else process.poll() is None)
        assert alive, 'the run ended before step {}'.format(step)
        assert time.time() < deadline, 'no snapshot after {} s'.format(
            timeout)
        time.sleep(0.02)


def snapshot_steps(out, rank):
    suffix = '.rank{}'.format(rank)
    return sorted(int(n[len('snapshot_step_'):-len(suffix)])
                  for n in os.listdir(out)
                  if n.startswith('snapshot_step_') and n.endswith(suffix))


@pytest.mark.slow
def test_signal_forwarded_by_mpiexec_stops_every_rank_and_its_loaders(
        dataset, uninterrupted, tmp_path):
    """SIGUSR1 to ``mpiexec``, as a scheduler sends it: Open MPI forwards
    it to the ranks and to their children; the loader processes
    (``--loaderjob 1``) hold it blocked and live on to the stop. Snapshots
    every 60 ms by rank 0's clock (a timed one comes early in the run even
    on a machine many times faster than CI's): every rank writes the same
    ones."""
    out, nproc = str(tmp_path / 'run'), 3
    process = start(preempt_command(dataset, out, '--loaderjob', '1',
                                    '--snapshot-every', '0.001min'),
                    nproc, str(tmp_path / 'output'))
    deadline = time.time() + 240
    while not (os.path.isdir(out) and snapshot_steps(out, nproc - 1)):
        assert process.running() and time.time() < deadline
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGUSR1)
    assert process.wait(timeout=120) == RESUME_STATUS
    with open(str(tmp_path / 'output')) as f:
        output = f.read()
    assert 'stopped by SIGUSR1 at the end of step' in output, output[-3000:]
    steps = snapshot_steps(out, 0)
    assert all(snapshot_steps(out, r) == steps for r in range(nproc))
    resume_until_done(dataset, out, nproc)
    assert_same_run(uninterrupted[nproc], out, nproc)


@pytest.mark.slow
def test_sigkill_right_after_the_signal_falls_back_to_a_whole_snapshot(
        dataset, uninterrupted, tmp_path):
    """The scheduler's SIGKILL 50 ms after its SIGUSR1: the snapshot of
    the stop is not written, or not whole (a temporary file, or one rank's
    file only); ``--resume latest`` takes the newest whole one."""
    out, nproc = str(tmp_path / 'run'), 2
    process = start(preempt_command(dataset, out), nproc,
                    str(tmp_path / 'output'))
    wait_for_snapshot(out, 3, nproc, process)
    os.kill(process.pid, signal.SIGUSR1)
    time.sleep(0.05)
    kill(process)
    result = resume_until_done(dataset, out, nproc)
    assert 'resumed from' in result.stdout
    assert_same_run(uninterrupted[nproc], out, nproc)


@pytest.mark.slow
def test_sigterm_to_every_process_stops_the_run_and_its_loaders(
        dataset, tmp_path):
    """SIGTERM to the whole process group, loaders included (as Slurm
    signals every process of a job step, or ``kill -TERM -PGID``), one
    process with ``--loaderjob 2``: the loaders hold it blocked and live
    on to the stop (killed mid-task they left their pool locked, and the
    run hung at its stop, snapshot written); the run exits 75, leaves no
    process behind, and resumes to the end."""
    out = str(tmp_path / 'run')
    with open(str(tmp_path / 'output'), 'w') as log:
        process = subprocess.Popen(
            preempt_command(dataset, out, '--loaderjob', '2'),
            env=launch.mpi_env(), cwd=launch.REPO, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_snapshot(out, 3, 1, process)
        os.killpg(process.pid, signal.SIGTERM)
        assert process.wait(timeout=120) == RESUME_STATUS
        deadline = time.time() + 10     # no loader left behind
        while session_processes(process.pid) and time.time() < deadline:
            time.sleep(0.1)
        assert not session_processes(process.pid)
    finally:
        kill(process)
    with open(str(tmp_path / 'output')) as f:
        output = f.read()
    assert 'stopped by SIGTERM at the end of step' in output, output[-3000:]
    result = resume_until_done(dataset, out, 1)
    assert len(read_log(out)) == CONFIG['epochs'], result.stdout[-3000:]


def test_stop_points_cover_every_phase_one_rank_and_both_signals():
    """The seeds' draws (what the chains above exercise)."""
    points = [stop_point(seed, nproc).split(':')
              for nproc, seeds in CHAINS.items() for seed in seeds]
    assert len(points) >= 10
    assert all(p[1] == '1+' for p in points if p[0] == 'write')
    assert {p[0] for p in points} == set(PHASES)
    assert any(p[2] not in ('all', '0') for p in points)
    assert {p[3] for p in points} == {'USR1', 'TERM'}


def job_env(dataset, out, tmp_path, nproc, pace=None, **variables):
    """The environment of a job script (docs/jobs) driven by a stand-in
    scheduler: the run of :func:`preempt_command` on ``nproc`` processes,
    and a requeue that leaves a file. ``pace``: seconds added to each
    micro-batch (:mod:`tests.scripts.paced`), so that a clock counted from
    the job's start falls inside the run on any machine."""
    cmd = preempt_command(dataset, out)
    at = cmd.index('--out')
    spaced = [word for word in cmd + [launch.MPIEXEC] if ' ' in word]
    if spaced:
        pytest.skip('the job scripts take LAUNCH and ARGS as word lists: '
                    '{} has a space'.format(spaced[0]))
    run = '{} {}'.format(*cmd[:2]) if pace is None else \
        '{} -m tests.scripts.paced {} --'.format(cmd[0], pace)
    env = launch.mpi_env()
    env.update(OUT=out, ARGS=' '.join(cmd[2:at] + cmd[at + 2:]),
               LAUNCH='{} -n {} {}'.format(launch.MPIEXEC, nproc, run),
               REQUEUE='touch {}'.format(tmp_path / 'requeued'),
               SLURM_JOB_ID='1', **variables)
    return env


def run_job(script, env, log, signal_after=None):
    """``bash script`` as the scheduler starts it; ``signal_after``:
    ``(out, step, nproc)``, SIGUSR1 to the script once that snapshot is
    whole (Slurm's ``--signal=B:USR1@...``)."""
    job = subprocess.Popen(['bash', os.path.join(launch.REPO, script)],
                           env=env, cwd=launch.REPO, stdout=log,
                           stderr=subprocess.STDOUT, start_new_session=True)
    if signal_after is not None:
        wait_for_snapshot(*signal_after, job)
        os.kill(job.pid, signal.SIGUSR1)
    return job.wait(timeout=240)


@pytest.mark.slow
@pytest.mark.parametrize('script', ['docs/jobs/slurm.sh', 'docs/jobs/pbs.sh'])
def test_job_script_requeues_on_the_resume_status_and_the_run_ends_alike(
        dataset, uninterrupted, tmp_path, script):
    """The stand-in scheduler: Slurm's signal to the script (forwarded to
    mpiexec by its trap), or the PBS script's own clock (2 s after the
    start, in the imports or the first steps); the job exits 0 having
    asked for a requeue; the requeued job resumes and completes."""
    out, nproc = str(tmp_path / 'run'), 2
    requeued = tmp_path / 'requeued'
    with open(str(tmp_path / 'job1'), 'w') as log:
        if script.endswith('slurm.sh'):
            status = run_job(script, job_env(dataset, out, tmp_path, nproc),
                             log, signal_after=(out, 2, nproc))
        else:
            # each of the run's 24 micro-batches 0.15 s longer: the clock
            # at 2 s falls inside it however fast the machine (a run of
            # 2 s, imports included, once ended before it in CI)
            status = run_job(script, job_env(
                dataset, out, tmp_path, nproc, pace=0.15, WALLTIME_S='12',
                LEAD_S='10'), log)
    with open(str(tmp_path / 'job1')) as f:
        output = f.read()
    assert status == 0, output[-3000:]
    assert 'stopped by SIGUSR1' in output and requeued.exists(), \
        output[-3000:]
    requeued.unlink()
    with open(str(tmp_path / 'job2'), 'w') as log:
        status = run_job(script, job_env(dataset, out, tmp_path, nproc), log)
    with open(str(tmp_path / 'job2')) as f:
        output = f.read()
    assert status == 0 and 'resumed from' in output, output[-3000:]
    assert not requeued.exists()
    assert_same_run(uninterrupted[nproc], out, nproc)

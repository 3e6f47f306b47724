"""benchmarks/gpu_session.sh, the one-call GPU check, on a CPU with a
stand-in Python: the steps in order, each cut to the time left, and what
ran packed into one file (a device call returns few files) after every
step, with a timeline that says how each ended."""
import os
import subprocess
import tarfile

from benchmarks import _common

SCRIPT = os.path.join(_common.ROOT, 'benchmarks', 'gpu_session.sh')


def _run(tmp_path, budget, python, **env):
    out = tmp_path / 'out'
    proc = subprocess.run(
        ['bash', SCRIPT], cwd=str(tmp_path), capture_output=True,
        text=True, timeout=120,
        env=dict(os.environ, OUT=str(out), WORK=str(tmp_path / 'work'),
                 BUDGET=str(budget), PY=python, SITE=str(tmp_path / 'site'),
                 **env))
    return proc, out


def test_dry_run_names_the_steps_in_order(tmp_path):
    proc, _ = _run(tmp_path, 600, 'python3', DRY_RUN='1')
    assert proc.returncode == 0, proc.stderr
    names = [line.split(' ')[0] for line in proc.stdout.splitlines()]
    assert names == ['step_time_b32', 'gpu_suite', 'kernel_profile_b32',
                     'sweep_64_128', 'sweep_256', 'inverse_routes',
                     'gpu_suite_mpi', 'replay_host']
    assert '--peer' in proc.stdout and '--batches 64,128' in proc.stdout
    assert 'kfac_every_graph' in proc.stdout
    assert '--batches 256' in proc.stdout
    assert '--variants kfac_every_graph --out' in proc.stdout
    # STEPS: only those (the rest of a session in a second call)
    proc, _ = _run(tmp_path, 600, 'python3', DRY_RUN='1',
                   STEPS='sweep_64_128,replay_host')
    assert [line.split(' ')[0] for line in proc.stdout.splitlines()] == [
        'sweep_64_128', 'replay_host']


def test_a_step_past_the_time_left_is_cut_and_the_rest_skipped(
        exec_tmp_path):
    """The stand-in Python answers every command at once but the first
    benchmark, which outlasts the budget: it is cut at the deadline (less
    the margin to pack), what it printed is in the packed file, and the
    steps after it are skipped with the time that was left."""
    python = exec_tmp_path / 'python'
    python.write_text(
        '#!/bin/sh\n'
        'case "$*" in\n'
        '  *"--resnet50-rounds 7"*) echo "round 1/7"; sleep 60 ;;\n'
        '  *) echo "ran: $*" ;;\n'
        'esac\n')
    python.chmod(0o755)
    proc, out = _run(exec_tmp_path, 32, str(python))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    timeline = (out / 'timeline.txt').read_text()
    assert 'step_time_b32: exit 124 (cut at its limit)' in timeline
    for name in ('gpu_suite', 'sweep_64_128', 'kernel_profile_b32'):
        assert '{}: skipped'.format(name) in timeline
    with tarfile.open(str(out / 'gpu_session.tgz')) as packed:
        names = {os.path.normpath(n) for n in packed.getnames()}
        assert {'step_time_b32.log', 'timeline.txt'} <= names
        log = packed.extractfile('./step_time_b32.log').read().decode()
    assert 'round 1/7' in log
    assert sorted(os.listdir(str(out))) == ['gpu_session.tgz',
                                            'timeline.txt']


def test_the_script_parses():
    subprocess.run(['bash', '-n', SCRIPT], check=True, timeout=30)

"""docs/jobs/slurm.sh and pbs.sh driven by a stand-in launcher (no
training, no MPI): what each exit status of the run leads to, a requeue
that fails, and the PBS script's SIGTERM (``qdel`` on some sites). The
whole loop with real training is in test_preemption.py."""
import os
import signal
import subprocess
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
SCRIPTS = ['docs/jobs/slurm.sh', 'docs/jobs/pbs.sh']

#: The launcher: says it started, then exits with $CODE, or with 75 on
#: SIGUSR1 (as train_imagenet.py does), or 0 after $DUR seconds.
LAUNCHER = '''
sleeper=
trap 'echo "launcher got USR1"; kill $sleeper 2> /dev/null; exit 75' USR1
echo "launcher started: $*"
if [ -n "${CODE:-}" ]; then exit "$CODE"; fi
sleep "${DUR:-30}" &
sleeper=$!
wait $sleeper
'''


def _job(tmp_path, script, code=None, requeue=None, **env):
    launcher = tmp_path / 'launcher.sh'
    launcher.write_text(LAUNCHER)
    # LAUNCH and REQUEUE are split into words by the scripts: relative to
    # the job's directory, they hold under a TMPDIR with a space too.
    environ = dict(os.environ, OUT=str(tmp_path / 'run'), ARGS='a b',
                   LAUNCH='bash ' + launcher.name,
                   REQUEUE=requeue or 'touch requeued',
                   PBS_O_WORKDIR=str(tmp_path), **env)
    if code is not None:
        environ['CODE'] = str(code)
    return subprocess.Popen(['bash', os.path.join(ROOT, script)],
                            cwd=str(tmp_path), env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            universal_newlines=True)


def _finish(job):
    output, _ = job.communicate(timeout=60)
    return job.returncode, output


@pytest.mark.parametrize('script', SCRIPTS)
@pytest.mark.parametrize('code', [0, 3])
def test_a_finished_or_failed_run_is_not_requeued(tmp_path, script, code):
    status, output = _finish(_job(tmp_path, script, code=code))
    assert status == code, output
    assert not (tmp_path / 'requeued').exists()
    assert '--out {}'.format(tmp_path / 'run') in output
    assert '--resume' not in output     # no snapshot: a fresh start


@pytest.mark.parametrize('script', SCRIPTS)
def test_the_resume_status_requeues_and_resumes_from_a_snapshot(tmp_path,
                                                                script):
    (tmp_path / 'run').mkdir()
    (tmp_path / 'run' / 'snapshot_step_8.rank0').write_text('')
    status, output = _finish(_job(tmp_path, script, code=75))
    assert status == 0, output
    assert (tmp_path / 'requeued').exists()
    assert '--resume latest' in output


@pytest.mark.parametrize('script', SCRIPTS)
def test_a_failing_requeue_is_not_a_success(tmp_path, script):
    """``scontrol requeue`` / ``qsub`` refused: the run is unfinished and
    nothing will continue it (the job used to exit 0 all the same)."""
    status, output = _finish(_job(tmp_path, script, code=75,
                                  requeue='false'))
    assert status == 75, output
    assert 'by hand' in output


def _wait_until_caught(pid, signum, deadline):
    """Until process ``pid`` has a handler for ``signum`` (the script has
    set its trap): Linux's /proc says so; elsewhere, a second's wait."""
    status = '/proc/{}/status'.format(pid)
    if not os.path.exists(status):
        time.sleep(1.0)
        return
    while time.monotonic() < deadline:
        with open(status) as f:
            caught = [line.split()[1] for line in f
                      if line.startswith('SigCgt:')]
        if caught and int(caught[0], 16) >> (signum - 1) & 1:
            return
        time.sleep(0.01)


def test_pbs_sigterm_writes_the_snapshot_and_submits_nothing(tmp_path):
    """A SIGTERM to the script alone (``qdel`` on some sites) reaches the
    run as SIGUSR1, so the snapshot is written, but the cancelled job is
    not resubmitted (it used to be: a chain ``qdel`` could not stop)."""
    job = _job(tmp_path, 'docs/jobs/pbs.sh', DUR='30')
    # The launcher runs in the background of the script: wait until it
    # has started (its first line), then send the script SIGTERM.
    deadline = time.monotonic() + 30
    line = job.stdout.readline()
    while 'launcher started' not in line and time.monotonic() < deadline:
        line = job.stdout.readline()
    _wait_until_caught(job.pid, signal.SIGTERM, deadline)
    job.send_signal(signal.SIGTERM)
    status, output = _finish(job)
    assert 'launcher got USR1' in output, output
    assert status == 75, output
    assert not (tmp_path / 'requeued').exists()
    assert 'not resubmitted' in output


@pytest.mark.parametrize('script', SCRIPTS)
def test_the_default_run_writes_plain_lines_to_the_log(tmp_path, script):
    """Without ARGS the script's own run has --no-progress: a batch job's
    log file, not a terminal, gets the output (a progress bar's escape
    codes filled it)."""
    launcher = tmp_path / 'launcher.sh'
    launcher.write_text(LAUNCHER)
    environ = {k: v for k, v in os.environ.items() if k != 'ARGS'}
    environ.update(OUT=str(tmp_path / 'run'), LAUNCH='bash ' + launcher.name,
                   REQUEUE='touch requeued', PBS_O_WORKDIR=str(tmp_path),
                   CODE='0')
    output = subprocess.run(['bash', os.path.join(ROOT, script)],
                            cwd=str(tmp_path), env=environ, timeout=60,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            universal_newlines=True).stdout
    started = [line for line in output.splitlines()
               if line.startswith('launcher started:')]
    assert started and '--no-progress' in started[0].split(), output

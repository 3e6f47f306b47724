"""tests/run_mpi.py: a launch in which MPI itself failed to start is tried
again; a launch in which tests ran and failed is not (it fails the suite at
once). A stand-in ``mpiexec`` (a shell script) plays the launcher."""
import stat

import pytest

from tests import run_mpi

# The stand-in mpiexec is a script in tmp_path.
pytestmark = pytest.mark.usefixtures('exec_tmp_path')

PMIX = ("The PMIx server's listener thread failed to start. We cannot\n"
        "continue.\n")


def _fake_mpiexec(tmp_path, outcomes):
    """A launcher whose k-th launch prints outcomes[k] (text, exit)."""
    counter = tmp_path / 'launches'
    counter.write_text('0')
    cases = []
    for k, (text, rc) in enumerate(outcomes):
        cases.append('  {}) printf %s {} ; exit {} ;;'.format(
            k, _quote(text), rc))
    script = tmp_path / 'mpiexec'
    script.write_text(
        '#!/bin/sh\nn=$(cat "{c}")\necho $((n + 1)) > "{c}"\ncase $n in\n{}\n'
        '  *) echo "1 passed"; exit 0 ;;\nesac\n'.format(
            '\n'.join(cases), c=counter))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script), counter


def _quote(text):
    return "'" + text.replace("'", "'\"'\"'") + "'"


def test_a_launcher_that_failed_to_start_is_tried_again(tmp_path, capsys,
                                                        monkeypatch):
    monkeypatch.setattr(run_mpi.time, 'sleep', lambda s: None)
    mpiexec, counter = _fake_mpiexec(tmp_path, [(PMIX, 213), (PMIX, 213)])
    assert run_mpi.main(['--mpiexec', mpiexec, '--sizes', '1']) == 0
    assert counter.read_text().strip() == '3'
    out = capsys.readouterr().out
    assert 'failed to start (exit 213), launch 2 of 3' in out
    assert 'mpi: 1 passed, 0 failed' in out


def test_it_gives_up_after_the_last_try(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_mpi.time, 'sleep', lambda s: None)
    mpiexec, counter = _fake_mpiexec(tmp_path, [(PMIX, 213)] * 3)
    assert run_mpi.main(['--mpiexec', mpiexec, '--sizes', '1']) == 1
    assert counter.read_text().strip() == '3'
    assert 'mpi tests failed for -n 1' in capsys.readouterr().out


@pytest.mark.parametrize('text, rc', [
    ('2 passed, 1 failed\n', 1),                    # a test failed
    (PMIX + '3 passed, 1 error\n', 1),              # tests ran
    ('Segmentation fault\n', 139),                  # not the launcher
])
def test_a_launch_in_which_tests_ran_is_never_retried(tmp_path, text, rc,
                                                      monkeypatch):
    monkeypatch.setattr(run_mpi.time, 'sleep', lambda s: None)
    mpiexec, counter = _fake_mpiexec(tmp_path, [(text, rc)])
    assert run_mpi.main(['--mpiexec', mpiexec, '--sizes', '1']) == 1
    assert counter.read_text().strip() == '1'


def test_the_tests_own_launches_are_tried_again(tmp_path, monkeypatch):
    """The scripts' direct launches (tests.launch.run_mpi,
    tests.scripts.conftest.run, test_preemption's Launch) start a run again
    where the launcher failed to start, and only then."""
    from tests import launch
    from tests.scripts import conftest
    mpiexec, counter = _fake_mpiexec(tmp_path, [(PMIX, 213)])
    monkeypatch.setattr(launch, 'MPIEXEC', mpiexec)
    proc, _ = launch.run_mpi(['-c', 'pass'], 2)
    assert proc.returncode == 0 and counter.read_text().strip() == '2'
    counter.write_text('0')
    result = conftest.run(['true'], 2)
    assert result.returncode == 0 and '1 passed' in result.stdout
    assert counter.read_text().strip() == '2'
    counter.write_text('0')
    run = conftest.start(['true'], 2, str(tmp_path / 'log'))
    run.process.wait()
    assert run.running() and run.tries == 2      # started again
    run.process.wait()
    assert not run.running() and run.wait(5) == 0
    mpiexec, counter = _fake_mpiexec(tmp_path, [('Segmentation fault\n',
                                                 139)])
    monkeypatch.setattr(launch, 'MPIEXEC', mpiexec)
    assert conftest.run(['true'], 2).returncode == 139   # not the launcher
    assert counter.read_text().strip() == '1'


def test_a_killed_run_leaves_no_session_directory(tmp_path):
    """tests.scripts.conftest.kill (a scheduler's SIGKILL to a whole run)
    removes the killed mpiexec's session directory: left, it failed the
    next mpiexec given that pid (a CI run lost a test to it:
    harness.mpi.stale_session_dirs)."""
    import os
    import sys
    import tempfile
    import time
    from tests.scripts import conftest
    process = conftest.start([sys.executable, '-c',
                              'import time; time.sleep(60)'], nproc=2)
    session = os.path.join(tempfile.gettempdir(),
                           'ompi.{}'.format(process.pid))
    deadline = time.time() + 60
    while not os.path.isdir(session) and time.time() < deadline:
        time.sleep(0.05)
    assert os.path.isdir(session)
    time.sleep(1.0)                     # the ranks started
    conftest.kill(process)
    assert not os.path.exists(session)

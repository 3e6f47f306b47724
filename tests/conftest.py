"""The suite leaves the checkout as it found it: a test that writes into
the repository's top folder (a Chainer ``Trainer`` without ``out=`` writes
``result/log`` into the working directory) fails the session, naming what
it left. Tests write under pytest's ``tmp_path`` instead."""
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: What a run may add to the top folder: caches of Python and pytest, the
#: demo's data cache (``.cache/digits``, built on first use, as `make demo`
#: does), the virtualenvs, and `make demo`'s output (the two commands may
#: run at once).
ALLOWED = {'__pycache__', '.pytest_cache', '.cache', '.venv', '.venv-np2',
           'demo_out'}

_before = set()


def pytest_sessionstart(session):
    _before.update(os.listdir(ROOT))


def left_in_checkout(before, after, args=()):
    """The names ``after`` adds to ``before`` that a run may not leave:
    not the allowed ones, not coverage's data (``.coverage*``), nor a file
    the command line names (``--junitxml=report.xml``)."""
    return sorted(name for name in set(after) - set(before) - ALLOWED
                  if not name.startswith('.coverage') and
                  not any(name in str(arg) for arg in args))


def pytest_sessionfinish(session, exitstatus):
    from harness import mpi
    if not mpi.launched():
        # this process's Open MPI singleton segment (tests that import
        # mpi4py): Open MPI leaves it in /dev/shm at exit
        mpi.remove_own_segments()
    left = left_in_checkout(_before, os.listdir(ROOT),
                            session.config.invocation_params.args)
    if left:
        session.config._checkout_left = left
        if exitstatus in (pytest.ExitCode.OK,
                          pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    left = getattr(config, '_checkout_left', None)
    if left:
        terminalreporter.write_line(
            'the tests left {} in {}: write under tmp_path instead'.format(
                ', '.join(left), ROOT), red=True)


@pytest.fixture
def exec_tmp_path(tmp_path):
    """``tmp_path``, for a test that runs a script of its own making there
    (a stand-in ``mpiexec`` or ``python``); skipped where the temporary
    directory is mounted ``noexec``."""
    probe = tmp_path / 'probe.sh'
    probe.write_text('#!/bin/sh\nexit 0\n')
    probe.chmod(0o755)
    try:
        subprocess.run([str(probe)], check=True, timeout=60)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip('scripts made in {} cannot run (a noexec mount): set '
                    'TMPDIR to another directory'.format(tmp_path))
    finally:
        probe.unlink()
    return tmp_path

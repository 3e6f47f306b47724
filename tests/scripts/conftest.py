"""Fixtures of the end-to-end tests of ``train_imagenet.py``: the data set,
a command line, and the uninterrupted reference runs the resume tests
continue (1 and 2 processes, run once per session)."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy
import pytest

from benchmarks import _common
from harness import mpi
from tests import launch
from tests.scripts import imagenet_like

ROOT = launch.REPO
SCRIPT = os.path.join(ROOT, 'train_imagenet.py')
#: The reference runs: global batch 32 (1 process: 4 x 8 accumulated; 2:
#: 2 x 8 each), 48 images = 1.5 steps per epoch, so epochs end inside
#: steps and the run (3 epochs, 4.5 steps) ends inside one; A refreshed
#: every 2nd step, mixup and erasing on.
REFERENCE = {'global_batch_size': 32, 'epochs': 3}


@pytest.fixture(scope='session')
def dataset(tmp_path_factory):
    return imagenet_like.build(str(tmp_path_factory.mktemp('imagenet')))


def command(dataset, out, *extra, train=None, val=None, config=None):
    return [sys.executable, SCRIPT, train or dataset['train'],
            val or dataset['val'], '--root', dataset['root'], '--config',
            config or dataset['config'], '--arch', 'small', '--width', '8',
            '--crop-size', '16', '--resize', '18', '--out', str(out),
            '--no-progress'] + list(extra)


def run(cmd, nproc=1, timeout=300):
    """Run ``cmd`` (under ``mpiexec -n nproc`` for more than one), its
    output in ``stdout``; a launch whose launcher itself failed to start
    (Open MPI's PMIx listener on a loaded machine) is started again, as
    :mod:`tests.run_mpi` does."""
    if nproc > 1:
        cmd = [launch.MPIEXEC, '-n', str(nproc)] + cmd
    for attempt in range(1, launch.LAUNCH_TRIES + 1):
        result = subprocess.run(cmd, env=launch.mpi_env(), cwd=ROOT,
                                timeout=timeout, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT,
                                universal_newlines=True)
        if nproc == 1 or attempt == launch.LAUNCH_TRIES or \
                not launch.launcher_failed(result.returncode, result.stdout):
            return result


#: A run started in the background (:func:`start`).
Launch = _common.BackgroundLaunch


def start(cmd, nproc=1, log=None):
    """Start a run in its own process group (mpiexec and its ranks): a
    :class:`Launch`, started again where its launcher failed to start
    (Open MPI's PMIx listener: CI runs lost tests to it, see
    harness.mpi.stale_session_dirs), its output in ``log`` (default: a
    temporary file, removed when the launch object goes)."""
    if nproc > 1:
        cmd = [launch.MPIEXEC, '-n', str(nproc)] + list(cmd)
    handle = None
    if log is None:
        handle = tempfile.NamedTemporaryFile(prefix='launch.', suffix='.log')
        log = handle.name
    launched = Launch(cmd, launch.mpi_env(), log, cwd=ROOT, retry=nproc > 1)
    launched.log_file = handle              # kept while the launch lives
    return launched


def session_processes(session):
    """Process ids of the session ``session`` (mpiexec's, from
    :func:`start`): Open MPI puts every rank in a process group of its
    own, so a signal to mpiexec's group does not reach them."""
    found = []
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            with open('/proc/{}/stat'.format(entry)) as f:
                fields = f.read().rsplit(')', 1)[1].split()
        except OSError:             # gone meanwhile
            continue
        if int(fields[3]) == session:
            found.append(int(entry))
    return found


def kill(process):
    """SIGKILL the whole run: mpiexec and every rank (and their loader
    processes) at once, as a scheduler's SIGKILL does."""
    for pid in session_processes(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()
    deadline = time.time() + 30
    while session_processes(process.pid) and time.time() < deadline:
        time.sleep(0.05)
    # the killed mpiexec's session directory would fail the next mpiexec
    # given its pid (harness.mpi.stale_session_dirs)
    mpi.remove_session_dir(process.pid)


def read_log(out):
    with open(os.path.join(str(out), 'log')) as f:
        return json.load(f)


def weights(path):
    """{name: array} of a model_final.npz."""
    with numpy.load(path) as data:
        return {k: data[k] for k in data.files}


def reference_config(dataset):
    return imagenet_like.write_config(dataset['root'], 'reference.json',
                                      **REFERENCE)


def reference_command(dataset, out, *extra):
    return command(dataset, out, '--keep-snapshots', '0', '--fisher-diff',
                   *extra, config=reference_config(dataset))


@pytest.fixture(scope='session')
def references(dataset, tmp_path_factory):
    """``{1: dir, 2: dir}``: the uninterrupted reference runs."""
    out = {}
    for nproc in (1, 2):
        directory = str(tmp_path_factory.mktemp('reference{}'.format(nproc)))
        result = run(reference_command(dataset, directory), nproc)
        assert result.returncode == 0, result.stdout[-3000:]
        out[nproc] = directory
    return out

"""Process set-up: the loaders' fork server starts and imports the data
pipeline (on NumPy 2 too: chainerkfac's shims first), under a TMPDIR too
long for its socket too."""
import os
import subprocess
import sys
import textwrap

import pytest

from harness import mpi
from tests import launch


@pytest.mark.parametrize('long_tmpdir', [False, True])
def test_fork_server_starts_and_serves_a_loader(long_tmpdir, tmp_path):
    """Also under a TMPDIR too long for a Unix socket's path (a batch
    job's scratch directory): the socket goes under /tmp instead."""
    env = launch.mpi_env()
    if long_tmpdir:
        long = tmp_path / ('scratch-of-a-batch-job-' + 'x' * 80)
        long.mkdir()
        env['TMPDIR'] = str(long)
    script = textwrap.dedent('''
        import multiprocessing
        from harness import mpi
        mpi.start_forkserver()
        assert multiprocessing.get_start_method() == 'forkserver'
        process = multiprocessing.Process(target=print, args=('loader ok',))
        process.start()
        process.join()
        raise SystemExit(process.exitcode)
    ''')
    proc = subprocess.run([sys.executable, '-c', script], cwd=launch.REPO,
                          env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert 'loader ok' in proc.stdout


def test_socket_temp_dir_keeps_a_short_tmpdir_and_names_a_hopeless_one(
        tmp_path, monkeypatch):
    if len(str(tmp_path)) < 60:     # pytest's own under a short TMPDIR
        assert mpi.socket_temp_dir(str(tmp_path)) == str(tmp_path)
    long = str(tmp_path / ('x' * 100))
    os.mkdir(long)
    assert mpi.socket_temp_dir(long) in ('/tmp', '/var/tmp', '/dev/shm')
    monkeypatch.setattr(mpi, '_SHORT_TEMP_DIRS', (long,))
    with pytest.raises(OSError) as info:
        mpi.socket_temp_dir(long)
    assert 'TMPDIR=' + long in str(info.value)
    assert '--loaderjob 0' in str(info.value)

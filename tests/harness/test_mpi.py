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


_SEGMENT_PROBE = textwrap.dedent('''
    import os, sys
    from harness import mpi
    if sys.argv[1] == 'harness':
        mpi.alone_without_shared_memory()
    from mpi4py import MPI
    assert MPI.COMM_WORLD.size == 1
    def mapped():
        with open('/proc/self/maps') as maps:
            return sorted({l.split(None, 5)[-1].strip() for l in maps
                           if '/dev/shm/sm_segment.' in l})
    segments = mapped()
    removed = mpi.remove_own_segments() if sys.argv[1] == 'remove' else []
    print(len(segments), len(removed),
          sum(os.path.exists(s) for s in segments))
''')


@pytest.mark.skipif(not os.path.exists('/proc/self/maps'),
                    reason='reads /proc/self/maps (Linux)')
@pytest.mark.parametrize('how', ['harness', 'remove'])
def test_a_process_alone_leaves_no_shared_memory_segment(how):
    """Open MPI without mpiexec made a 16 MiB segment in /dev/shm and left
    it at exit (thousands accumulated on a test machine). The harness's
    processes alone use the 'self' transport only, which makes none; a
    process that made one (the test session's own) unlinks it before it
    exits ('remove': without the harness's setting, one is made, and
    unlinked)."""
    env = launch.mpi_env()
    for name in ('OMPI_MCA_btl', 'OMPI_COMM_WORLD_SIZE', 'PMIX_RANK',
                 'PMI_RANK', 'PMI_SIZE'):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, '-c', _SEGMENT_PROBE, how],
                          cwd=launch.REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    made, removed, left = map(int, proc.stdout.split())
    if how == 'harness':
        assert (made, removed, left) == (0, 0, 0)
    else:
        assert (made, removed, left) == (1, 1, 0)


def test_alone_without_shared_memory_keeps_launched_and_chosen(
        monkeypatch):
    for name in ('OMPI_MCA_btl', 'OMPI_COMM_WORLD_SIZE', 'PMIX_RANK',
                 'PMI_RANK', 'PMI_SIZE', 'MV2_COMM_WORLD_SIZE'):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv('PMIX_RANK', '0')
    assert not mpi.alone_without_shared_memory()
    assert 'OMPI_MCA_btl' not in os.environ
    monkeypatch.delenv('PMIX_RANK')
    monkeypatch.setenv('OMPI_MCA_btl', 'self,vader')
    assert not mpi.alone_without_shared_memory()
    assert os.environ['OMPI_MCA_btl'] == 'self,vader'
    monkeypatch.delenv('OMPI_MCA_btl')
    assert mpi.alone_without_shared_memory()
    assert os.environ['OMPI_MCA_btl'] == 'self'


def _dead_pid():
    """A process id that no process has (a child that has been reaped)."""
    child = subprocess.Popen(['true'])
    child.wait()
    return child.pid


def test_stale_session_dirs_are_those_of_gone_processes(tmp_path):
    """``ompi.<pid>`` of this host (its ``pmix.<host>.tool``) of a process
    that is gone is stale; of a live one, of another host (a TMPDIR
    shared over NFS), another name, or a file of that name, not."""
    import socket
    tool = 'pmix.{}.tool'.format(socket.gethostname())

    def session(name, tool=tool):
        path = tmp_path / name
        (path / '1').mkdir(parents=True)
        (path / tool).write_text('x')
        return path
    dead = _dead_pid()
    stale = session('ompi.{}'.format(dead))
    live = session('ompi.{}'.format(os.getpid()))
    elsewhere = session('ompi.{}'.format(_dead_pid()), 'pmix.other.tool')
    session('ompi.{}x'.format(dead))
    session('prte.{}'.format(dead))
    (tmp_path / 'ompi.{}'.format(_dead_pid())).write_text('a file')
    assert mpi.stale_session_dirs(str(tmp_path)) == [str(stale)]
    assert mpi.remove_stale_session_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and live.exists() and elsewhere.exists()
    assert mpi.stale_session_dirs(str(tmp_path)) == []
    assert mpi.stale_session_dirs(str(tmp_path / 'none')) == []
    # the directory of one mpiexec the caller killed and reaped
    killed = _dead_pid()
    session('ompi.{}'.format(killed))
    assert mpi.remove_session_dir(killed, str(tmp_path))
    assert not (tmp_path / 'ompi.{}'.format(killed)).exists()
    assert not mpi.remove_session_dir(killed, str(tmp_path))
    assert not mpi.remove_session_dir(int(elsewhere.name[5:]),
                                      str(tmp_path))
    assert elsewhere.exists()


def test_a_stale_session_dir_fails_the_launch_and_is_told(exec_tmp_path,
                                                          tmp_path):
    """The cause of Open MPI 5's "The PMIx server's listener thread failed
    to start" (it failed a CI run): a killed mpiexec's session directory
    (``pmix.<host>.tool`` in ``ompi.<pid>`` under TMPDIR) fails the next
    mpiexec that gets its process id (the stand-in keeps its pid for
    mpiexec: ``exec``); :func:`launcher_failed` tells that failure, and
    not a launch that ran or timed out."""
    import socket
    tmp = tmp_path / 't'
    tmp.mkdir()
    script = tmp_path / 'launch.sh'
    script.write_text(
        '#!/bin/sh\nmkdir -p "$TMPDIR/ompi.$$"\n'
        'if [ -n "$STALE" ]; then touch "$TMPDIR/ompi.$$/pmix.{}.tool"; fi\n'
        'echo $$ > "$TMPDIR/pid"\nexec "$@"\n'.format(socket.gethostname()))
    script.chmod(0o755)
    env = dict(launch.mpi_env(), TMPDIR=str(tmp), STALE='1')
    cmd = [str(script), launch.MPIEXEC, '-n', '1', sys.executable, '-c',
           'print("ran")']
    failed = subprocess.run(cmd, env=env, capture_output=True, text=True,
                            timeout=120)
    assert failed.returncode != 0 and 'ran' not in failed.stdout
    assert mpi.launcher_failed(failed.returncode,
                               failed.stdout + failed.stderr), failed.stderr
    # the failed launcher removed the directory: a launch again works
    assert not (tmp / ('ompi.' + (tmp / 'pid').read_text().strip())).exists()
    env.pop('STALE')
    done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and 'ran' in done.stdout, done.stderr
    assert not mpi.launcher_failed(done.returncode, done.stdout)
    assert not mpi.launcher_failed(124, failed.stderr)        # a timeout

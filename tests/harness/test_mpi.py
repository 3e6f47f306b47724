"""Process set-up: the loaders' fork server starts and imports the data
pipeline (on NumPy 2 too: chainerkfac's shims first)."""
import subprocess
import sys
import textwrap

from tests import launch


def test_fork_server_starts_and_serves_a_loader():
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
                          env=launch.mpi_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert 'loader ok' in proc.stdout

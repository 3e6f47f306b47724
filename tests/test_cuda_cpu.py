"""The CPU build of the CUDA kernels (:mod:`tests.cuda_cpu`): where it
keeps what it compiled."""
import os
import stat

from tests import cuda_cpu


def _fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_cpu.tempfile, 'tempdir', str(tmp_path))
    cuda_cpu._cache_dir.cache_clear()
    return tmp_path / 'chainerkfac-cuda-cpu-{}'.format(os.getuid())


def test_the_shared_cache_is_private(monkeypatch, tmp_path):
    expected = _fresh(monkeypatch, tmp_path)
    try:
        assert cuda_cpu._cache_dir() == str(expected)
        assert stat.S_IMODE(os.stat(expected).st_mode) & 0o077 == 0
    finally:
        cuda_cpu._cache_dir.cache_clear()


def test_a_cache_others_may_write_is_not_used(monkeypatch, tmp_path):
    """A directory of that name that others may write (or another user's:
    181 kernel tests were skipped, blaming a noexec TMPDIR) is left alone:
    a library planted there would be loaded. A private one serves."""
    squatted = _fresh(monkeypatch, tmp_path)
    squatted.mkdir()
    squatted.chmod(0o777)
    try:
        used = cuda_cpu._cache_dir()
        assert used != str(squatted) and os.path.isdir(used)
        assert stat.S_IMODE(os.stat(used).st_mode) & 0o077 == 0
    finally:
        cuda_cpu._cache_dir.cache_clear()

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


def test_the_users_own_open_cache_is_made_private(monkeypatch, tmp_path):
    """This user's cache left group-writable (umask 002) is kept and made
    0700 (thrown away, every process compiled again)."""
    mine = _fresh(monkeypatch, tmp_path)
    mine.mkdir()
    mine.chmod(0o775)
    try:
        assert cuda_cpu._cache_dir() == str(mine)
        assert stat.S_IMODE(os.stat(mine).st_mode) == 0o700
    finally:
        cuda_cpu._cache_dir.cache_clear()


def test_a_link_in_place_of_the_cache_is_not_used(monkeypatch, tmp_path):
    """A link of that name (another user's directory behind it: 181
    kernel tests were skipped, blaming a noexec TMPDIR, and a library
    planted there would be loaded) is left alone; a private one serves."""
    squatted = _fresh(monkeypatch, tmp_path)
    elsewhere = tmp_path / 'elsewhere'
    elsewhere.mkdir()
    elsewhere.chmod(0o777)
    squatted.symlink_to(elsewhere)
    try:
        used = cuda_cpu._cache_dir()
        assert used != str(squatted) and os.path.isdir(used)
        assert stat.S_IMODE(os.stat(used).st_mode) & 0o077 == 0
    finally:
        cuda_cpu._cache_dir.cache_clear()


def test_another_users_directory_of_that_name_is_not_used(monkeypatch,
                                                        tmp_path):
    import pytest
    if os.getuid() != 0:
        pytest.skip('giving a directory to another user needs root')
    squatted = _fresh(monkeypatch, tmp_path)
    squatted.mkdir(mode=0o755)
    os.chown(squatted, 65534, 65534)
    try:
        used = cuda_cpu._cache_dir()
        assert used != str(squatted) and os.path.isdir(used)
    finally:
        cuda_cpu._cache_dir.cache_clear()

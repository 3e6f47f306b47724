"""The mean image file: whole or absent, and readable like every other
output of a run (the process's umask, not the temporary file's 0600)."""
import os

import numpy as np

import augment


def test_saved_mean_has_the_mode_of_any_new_file(tmp_path):
    umask = os.umask(0o022)
    try:
        path = str(tmp_path / 'mean.npy')
        augment.save_mean(path, np.ones((3, 4, 4), np.float32))
        with open(str(tmp_path / 'other'), 'w'):
            pass
    finally:
        os.umask(umask)
    assert os.stat(path).st_mode & 0o777 == 0o644
    assert os.stat(str(tmp_path / 'other')).st_mode & 0o777 == 0o644
    np.testing.assert_array_equal(augment.load_mean(path, 4), 1)
    assert sorted(os.listdir(str(tmp_path))) == ['mean.npy', 'other']

"""The mean image file: whole or absent, and readable like every other
output of a run (the process's umask, not the temporary file's 0600)."""
import os

import numpy as np
import pytest

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


@pytest.mark.parametrize('kind', ['nan', 'one channel', 'four channels',
                                  'truncated', 'empty', 'text', 'npz',
                                  'object'])
def test_a_bad_mean_file_is_refused_naming_it(tmp_path, kind):
    """A ``--mean`` file that is not a finite (3, H, W) ``.npy`` mean
    image: refused naming the file (a NaN mean skipped every step of a
    run, a 1-channel one was broadcast over RGB, a 4-channel one failed at
    the first step, the others with NumPy's own words)."""
    path = tmp_path / 'mean.npy'
    good = np.full((3, 4, 4), 100, np.float32)
    if kind == 'nan':
        np.save(str(path), good * np.nan)
    elif kind == 'one channel':
        np.save(str(path), good[:1])
    elif kind == 'four channels':
        np.save(str(path), np.concatenate([good, good[:1]]))
    elif kind == 'truncated':
        np.save(str(path), good)
        path.write_bytes(path.read_bytes()[:-20])
    elif kind == 'empty':
        path.write_bytes(b'')
    elif kind == 'text':
        path.write_text('not an array\n')
    elif kind == 'npz':
        with open(str(path), 'wb') as f:
            np.savez(f, mean=good)
    else:
        np.save(str(path), np.array([{'a': 1}] * 48, dtype=object).reshape(
            3, 4, 4), allow_pickle=True)
    with pytest.raises(ValueError, match='mean image {}'.format(path)):
        augment.load_mean(str(path), 4)
    np.save(str(path), good)
    np.testing.assert_array_equal(augment.load_mean(str(path), 4), good)

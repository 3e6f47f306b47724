"""Snapshots and weights are read with pickle off: the integrity check,
finding the snapshot (its lowest rank's file, another rank's, the newest
or a named one) and loading weights refuse a file whose array was replaced
by a pickled object, naming the file and the key, and the object's code
never runs (it would create a marker file)."""
import numpy as np
import pytest

import chainer
import chainer.links as L

from chainerkfac.serializers import PickledArrayError
from harness import resume, snapshot_fit, snapshot_integrity
from tests.harness.damage import pickled
from tests.harness.test_resume import snapshot_set

KEY = 'updater/model:main/predictor/fc/W'


def test_integrity_check_refuses_an_object_array(tmp_path):
    prefix = snapshot_set(tmp_path, 1, 1)
    path, marker = prefix + '.rank0', tmp_path / 'ran'
    pickled(path, KEY, marker)
    with pytest.raises(PickledArrayError) as info:
        snapshot_integrity.verify_file(path)
    assert (info.value.path, info.value.key) == (path, KEY)
    [problem] = snapshot_integrity.verify_files([path])
    assert isinstance(problem, PickledArrayError) and problem.key == KEY
    assert not marker.exists()


@pytest.mark.parametrize('rank', [0, 1])
def test_latest_refuses_rather_than_skips(tmp_path, rank):
    """An object array is no accident: ``--resume latest`` stops on it
    (naming it) instead of falling back to an older snapshot."""
    snapshot_set(tmp_path, 2, 2)
    newer = snapshot_set(tmp_path, 3, 2)
    path, marker = '{}.rank{}'.format(newer, rank), tmp_path / 'ran'
    pickled(path, KEY, marker)
    with pytest.raises(PickledArrayError) as info:
        resume.latest_snapshot(str(tmp_path), say=None)
    assert (info.value.path, info.value.key) == (path, KEY)
    assert not marker.exists()


def test_weights_refused_before_their_shapes_are_compared(tmp_path):
    network = L.Linear(3, 2)
    path, marker = str(tmp_path / 'model_final.npz'), tmp_path / 'ran'
    chainer.serializers.save_npz(path, network)
    pickled(path, 'W', marker)
    before = network.W.array.copy()
    with pytest.raises(PickledArrayError, match="key 'W'"):
        snapshot_fit.load_weights(path, network)
    np.testing.assert_array_equal(network.W.array, before)
    assert not marker.exists()

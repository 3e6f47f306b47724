"""The attack of issue 27, item 5, on ``train_imagenet.py``: one array of
a ``model_final.npz`` or of a snapshot replaced by a pickled object whose
unpickling creates a marker file. ``--init-weights-from``, ``--resume
latest`` (the newest snapshot, rank 1's file, under 2 processes) and
``--resume PREFIX`` (rank 0's file) refuse it naming the file and the
key; the marker is never created and the run writes nothing."""
import os
import shutil

import pytest

from tests.harness.damage import pickled
from tests.scripts.conftest import command, reference_command, run

MODEL_KEY = 'updater/model:main/predictor/fc/W'


def copy_snapshots(source, destination):
    for name in os.listdir(source):
        if name.startswith('snapshot_step_'):
            shutil.copy(os.path.join(source, name), str(destination))


def files_of(directory):
    return sorted(os.listdir(str(directory)))


def assert_refused(result, path, key, marker):
    assert result.returncode != 0
    assert path in result.stdout, result.stdout[-3000:]
    assert "key '{}' holds an object array".format(key) in result.stdout
    assert not os.path.exists(str(marker))


@pytest.mark.slow
def test_init_weights_from_a_doctored_model_final(dataset, references,
                                                  tmp_path):
    path = str(tmp_path / 'model_final.npz')
    shutil.copy(os.path.join(references[1], 'model_final.npz'), path)
    pickled(path, 'fc/W', tmp_path / 'ran')
    out = tmp_path / 'out'
    result = run(command(dataset, out, '--init-weights-from', path))
    assert_refused(result, path, 'fc/W', tmp_path / 'ran')
    assert not out.exists() or files_of(out) == []


@pytest.mark.slow
def test_resume_latest_with_a_doctored_file_of_rank_1(dataset, references,
                                                      tmp_path):
    copy_snapshots(references[2], tmp_path)
    path = str(tmp_path / 'snapshot_step_5.rank1')
    # An optimizer key: the K-FAC state is read without pickle too.
    from chainerkfac import serializers
    with serializers.open_npz(path) as data:
        key = next(k for k in sorted(data.files)
                   if k.startswith('updater/optimizer:main/kfac/'))
    pickled(path, key, tmp_path / 'ran')
    before = files_of(tmp_path)
    result = run(reference_command(dataset, tmp_path, '--resume', 'latest'),
                 2)
    assert_refused(result, path, key, tmp_path / 'ran')
    assert files_of(tmp_path) == before


@pytest.mark.slow
def test_resume_of_a_named_snapshot_with_a_doctored_file_of_rank_0(
        dataset, references, tmp_path):
    copy_snapshots(references[2], tmp_path)
    prefix = str(tmp_path / 'snapshot_step_3')
    pickled(prefix + '.rank0', MODEL_KEY, tmp_path / 'ran')
    before = files_of(tmp_path)
    result = run(reference_command(dataset, tmp_path, '--resume', prefix), 2)
    assert_refused(result, prefix + '.rank0', MODEL_KEY, tmp_path / 'ran')
    assert files_of(tmp_path) == before

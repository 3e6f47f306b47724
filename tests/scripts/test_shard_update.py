"""``train_imagenet.py --shard-update`` and ``--optimizer lars
--lars-momentum``: two processes with and without sharding train alike,
and a sharded snapshot resumes on one unsharded process (the velocities
are merged from every process's file)."""
import json
import os

import numpy
import pytest

from tests.scripts import imagenet_like
from tests.scripts.conftest import command, run, weights
from tests.scripts.test_resume import TOLERANCE, max_relative_diff

pytestmark = pytest.mark.slow


def _final(out):
    return weights(os.path.join(str(out), 'model_final.npz'))


def _velocities(path):
    """Names of the velocities a snapshot file holds."""
    with numpy.load(path) as data:
        return {k for k in data.files
                if k.startswith('updater/optimizer:main/') and
                k.endswith('/v')}


def _snapshot_weights(path):
    prefix = 'updater/model:main/predictor/'
    with numpy.load(path) as data:
        return {k[len(prefix):]: data[k] for k in data.files
                if k.startswith(prefix)}


def _relative_to_movement(a, b, start):
    """max |a − b| over max |b − start|: how far apart two ends are, next
    to how far the run moved from ``start`` (statistics left out)."""
    keys = [k for k in b if k.rsplit('/', 1)[-1] not in
            ('avg_mean', 'avg_var', 'N')]
    apart = max(float(numpy.abs(a[k] - b[k]).max()) for k in keys)
    moved = max(float(numpy.abs(b[k] - start[k]).max()) for k in keys)
    assert moved > 0
    return apart / moved


@pytest.mark.parametrize('optimizer', [
    ['--optimizer', 'lars', '--lars-momentum', 'scaled'],
    ['--optimizer', 'kfac']], ids=['lars-scaled', 'kfac'])
def test_sharded_run_trains_like_the_unsharded_and_resumes_unsharded(
        dataset, tmp_path, optimizer):
    """2 processes with and without --shard-update end alike; the sharded
    snapshot's files each hold part of the velocities; one unsharded
    process resumed from them (velocities merged from both files)
    continues as the sharded run did, to 1e-2 of what the run moved after
    the snapshot (a velocity lost would be of the order of that
    movement)."""
    config = imagenet_like.write_config(
        dataset['root'], 'shard.json', global_batch_size=32, epochs=2)
    plain, sharded, resumed = (tmp_path / 'plain', tmp_path / 'sharded',
                               tmp_path / 'resumed')
    options = optimizer + ['--keep-snapshots', '0']
    for out, extra in ((plain, []), (sharded, ['--shard-update'])):
        result = run(command(dataset, out, *(options + extra),
                             config=config), 2)
        assert result.returncode == 0, result.stdout[-3000:]
    assert max_relative_diff(_final(sharded), _final(plain),
                             skip_statistics=True) < TOLERANCE
    files = [str(sharded / 'snapshot_step_2.rank{}'.format(r))
             for r in (0, 1)]
    held = [_velocities(f) for f in files]
    assert held[0] and held[1] and not held[0] & held[1]
    assert held[0] | held[1] == _velocities(
        str(plain / 'snapshot_step_2.rank0'))
    result = run(command(dataset, resumed, *optimizer, '--resume',
                         str(sharded / 'snapshot_step_2'), config=config), 1)
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'on 1 process(es)' in result.stdout
    assert _relative_to_movement(
        _final(resumed), _final(sharded),
        _snapshot_weights(files[0])) < 1e-2


def test_lars_momentum_comes_from_the_config_or_the_option(dataset,
                                                           tmp_path):
    """The config's ``lars_momentum`` picks the form, ``--lars-momentum``
    overrides it; the two forms train differently."""
    finals = {}
    for form, source in (('scaled', 'config'), ('unscaled', 'config'),
                         ('scaled', 'option')):
        config = imagenet_like.write_config(
            dataset['root'], 'lars_{}.json'.format(form),
            global_batch_size=32, epochs=1,
            lars_momentum=form if source == 'config' else 'unscaled')
        extra = ['--lars-momentum', form] if source == 'option' else []
        out = tmp_path / '{}_{}'.format(form, source)
        result = run(command(dataset, out, '--optimizer', 'lars',
                             *extra, config=config))
        assert result.returncode == 0, result.stdout[-3000:]
        with open(str(out / 'config.json')) as f:
            assert json.load(f)['lars_momentum'] == form
        finals[form, source] = _final(out)
    same = finals['scaled', 'config'], finals['scaled', 'option']
    assert max_relative_diff(*same) == 0
    assert max_relative_diff(finals['unscaled', 'config'],
                             finals['scaled', 'config'],
                             skip_statistics=True) > 1e-4

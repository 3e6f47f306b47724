"""Whether a snapshot fits the run about to load it, read from the file's
keys and shapes against those the run's freshly built model and optimizer
serialize: another size of model (``--width``, ``n_class``, ...), another
kind of optimizer (K-FAC's state into SGD or the reverse) or another
Fisher layout (``bn_fisher``) is named with what differs, before anything
is loaded."""
import chainerkfac  # NOQA  (before chainer)
import chainer
import numpy as np
import pytest
from chainer.serializers import npz

import models
from harness import snapshot_fit

N_CLASS = 3


def build(optimizer_name, width=4, n_class=N_CLASS, bn_fisher='full'):
    np.random.seed(0)
    model = models.SoftLabelClassifier(models.SmallResNet(
        depth=8, width=width, n_class=n_class))
    if optimizer_name == 'kfac':
        optimizer = chainerkfac.optimizers.KFAC(verbose=False,
                                                bn_fisher=bn_fisher)
    else:
        optimizer = chainer.optimizers.MomentumSGD()
    optimizer.setup(model)
    return model, optimizer


def step(model, optimizer):
    rng = np.random.RandomState(1)
    x = rng.rand(4, 3, 8, 8).astype(np.float32)
    t = rng.randint(0, N_CLASS, 4).astype(np.int32)
    if isinstance(optimizer, chainerkfac.optimizers.KFAC):
        optimizer.update(model, x, t)
    else:
        model.cleargrads()
        model(x, t).backward()
        optimizer.update()


def write_snapshot(path, optimizer_name, lars_momentum=None, **kwargs):
    """A snapshot with the trainer's key layout after one step."""
    model, optimizer = build(optimizer_name, **kwargs)
    step(model, optimizer)
    target = {}
    serializer = npz.DictionarySerializer(target)
    model.serialize(serializer['updater']['model:main'])
    optimizer.serialize(serializer['updater']['optimizer:main'])
    target[snapshot_fit.OPTIMIZER_KEY] = np.asarray(optimizer_name)
    if lars_momentum is not None:
        target[snapshot_fit.LARS_FORM_KEY] = np.asarray(lars_momentum)
    with open(path, 'wb') as f:
        np.savez(f, **target)
    return path


@pytest.fixture(scope='module')
def kfac_snapshot(tmp_path_factory):
    return write_snapshot(str(tmp_path_factory.mktemp('kfac') / 's.rank0'),
                          'kfac')


@pytest.fixture(scope='module')
def sgd_snapshot(tmp_path_factory):
    return write_snapshot(str(tmp_path_factory.mktemp('sgd') / 's.rank0'),
                          'sgd')


@pytest.mark.parametrize('name', ['kfac', 'sgd'])
def test_snapshot_of_the_same_run_fits(kfac_snapshot, sgd_snapshot, name):
    path = kfac_snapshot if name == 'kfac' else sgd_snapshot
    model, optimizer = build(name)
    snapshot_fit.check(path, model, optimizer, name)


@pytest.mark.parametrize('change, layer, shapes', [
    ({'width': 8}, 'predictor/conv1/W', ('(4, 3, 3, 3)', '(8, 3, 3, 3)')),
    ({'n_class': 5}, 'predictor/fc/W', ('(3, 16)', '(5, 16)')),
])
@pytest.mark.parametrize('name', ['kfac', 'sgd'])
def test_another_model_refused_naming_the_layer_and_shapes(
        kfac_snapshot, sgd_snapshot, name, change, layer, shapes):
    path = kfac_snapshot if name == 'kfac' else sgd_snapshot
    model, optimizer = build(name, **change)
    with pytest.raises(snapshot_fit.SnapshotMismatchError) as info:
        snapshot_fit.check(path, model, optimizer, name)
    message = str(info.value)
    assert path in message and layer in message
    assert 'snapshot {}'.format(shapes[0]) in message
    assert 'this run {}'.format(shapes[1]) in message


@pytest.mark.parametrize('written, resumed', [('kfac', 'sgd'),
                                              ('sgd', 'kfac'),
                                              ('sgd', 'lars')])
def test_another_optimizer_refused_naming_both(kfac_snapshot, sgd_snapshot,
                                               written, resumed):
    path = kfac_snapshot if written == 'kfac' else sgd_snapshot
    model, optimizer = build('kfac' if resumed == 'kfac' else 'sgd')
    with pytest.raises(snapshot_fit.SnapshotMismatchError) as info:
        snapshot_fit.check(path, model, optimizer, resumed)
    message = str(info.value)
    assert '--optimizer {}'.format(written) in message
    assert '--optimizer {}'.format(resumed) in message
    assert '--init-weights-from' in message


def test_lars_of_the_other_momentum_form_refused(tmp_path):
    """Figure 5's velocity holds raw gradients, Figure 6's steps scaled by
    the trust ratio: resuming one as the other jumped the loss (1.28 to
    2.64 at the next epoch), with only the config's form said to change."""
    path = write_snapshot(str(tmp_path / 's.rank0'), 'lars',
                          lars_momentum='scaled')
    model, optimizer = build('lars')
    snapshot_fit.check(path, model, optimizer, 'lars', 'scaled')
    with pytest.raises(snapshot_fit.SnapshotMismatchError,
                       match=r'LARS with scaled momentum; this run has '
                             r'--lars-momentum unscaled.*--lars-momentum '
                             r'scaled'):
        snapshot_fit.check(path, model, optimizer, 'lars', 'unscaled')


def test_snapshot_without_the_optimizer_name_told_apart_by_its_keys(
        tmp_path, kfac_snapshot):
    """Snapshots of earlier versions do not record the optimizer's name;
    K-FAC's state has keys a first-order optimizer's lacks."""
    with np.load(kfac_snapshot) as data:
        arrays = {k: data[k] for k in data.files
                  if k != snapshot_fit.OPTIMIZER_KEY}
    path = str(tmp_path / 'old.rank0')
    with open(path, 'wb') as f:
        np.savez(f, **arrays)
    model, optimizer = build('kfac')
    snapshot_fit.check(path, model, optimizer, 'kfac')
    model, optimizer = build('sgd')
    with pytest.raises(snapshot_fit.SnapshotMismatchError,
                       match='K-FAC.*--optimizer sgd'):
        snapshot_fit.check(path, model, optimizer, 'sgd')


def test_another_fisher_layout_refused_naming_the_factor(kfac_snapshot):
    model, optimizer = build('kfac', bn_fisher='diag')
    with pytest.raises(snapshot_fit.SnapshotMismatchError) as info:
        snapshot_fit.check(kfac_snapshot, model, optimizer, 'kfac')
    message = str(info.value)
    assert 'kfac/predictor/bn1/F' in message
    # full 2C x 2C (C = 4): packed as its upper triangle, or (4 samples)
    # its 2C x 4 low-rank columns; diag: 2C values.
    assert ('bn1/F: snapshot (36,), this run (8,)' in message or
            'bn1/F: snapshot (8, 4), this run (8,)' in message), message


def test_weights_of_any_optimizer_fit_a_model_of_their_size(kfac_snapshot,
                                                            tmp_path):
    model, _ = build('sgd')
    before = {n: p.array.copy() for n, p in model.namedparams()}
    snapshot_fit.load_weights(kfac_snapshot, model.predictor)
    with np.load(kfac_snapshot) as data:
        for name, param in model.namedparams():
            key = 'updater/model:main' + name
            np.testing.assert_array_equal(param.array, data[key])
    assert any((before[n] != p.array).any() for n, p in model.namedparams())
    # A bare model file (model_final.npz) too.
    bare = str(tmp_path / 'model_final.npz')
    npz.save_npz(bare, model.predictor)
    other, _ = build('sgd')
    snapshot_fit.load_weights(bare, other.predictor)
    for (name, a), (_, b) in zip(model.namedparams(), other.namedparams()):
        np.testing.assert_array_equal(a.array, b.array)
    wider, _ = build('sgd', width=8)
    with pytest.raises(snapshot_fit.SnapshotMismatchError,
                       match=r'predictor/conv1/W.*\(4, 3, 3, 3\)'):
        snapshot_fit.load_weights(kfac_snapshot, wider.predictor)

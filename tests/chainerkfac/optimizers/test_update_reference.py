"""``optimizer.update(lossfun, ...)`` gives the results it gave before the
capture was moved out of ``update`` (issue 16), bit for bit.

``update_reference.npz`` holds the weights and velocities after four
updates of each case below, computed by the optimizer as it was before
that change (``OPENBLAS_NUM_THREADS=1 python -m
tests.chainerkfac.optimizers.test_update_reference REFERENCE`` writes it).
BLAS rounds differently with another number of threads, so the cases run
in a subprocess with one BLAS thread; on another NumPy (the NumPy-2 leg)
BLAS may still round differently: there the comparison is to 1e-12
relative instead of bit for bit.
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import os
import subprocess
import sys

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from tests.chainerkfac import helpers

REFERENCE = os.path.join(os.path.dirname(__file__), 'update_reference.npz')
STEPS = 4


class ConvBNNet(chainer.Chain):
    """conv → BN → relu → conv/2 → BN → relu → average pool → linear."""

    def __init__(self, dtype=numpy.float64):
        super().__init__()
        with chainer.using_config('dtype', dtype), self.init_scope():
            self.c1 = L.Convolution2D(2, 4, 3, pad=1)
            self.b1 = L.BatchNormalization(4)
            self.c2 = L.Convolution2D(4, 5, 3, stride=2, pad=1, nobias=True)
            self.b2 = L.BatchNormalization(5)
            self.fc = L.Linear(5, 3)

    def forward(self, x):
        h = F.relu(self.b1(self.c1(x)))
        h = F.relu(self.b2(self.c2(h)))
        return self.fc(F.average(h, axis=(2, 3)))


def _mlp():
    return helpers.MLP(sizes=(6, 7, 3))


#: name -> (model factory, KFAC arguments, input dtype, loss reduction).
CASES = {
    'mlp_emp': (_mlp, {}, 'float64', 'mean'),
    'mlp_acc2': (_mlp, {'acc_iters': 2}, 'float64', 'mean'),
    'mlp_stale': (_mlp, {'refresh_interval_a': 2, 'refresh_interval_g': 3},
                  'float64', 'mean'),
    'mlp_mc': (_mlp, {'fisher': 'mc', 'seed': 3}, 'float64', 'mean'),
    'mlp_sum': (_mlp, {'loss_reduction': 'sum'}, 'float64', 'sum'),
    'mlp_rescale': (_mlp, {'weight_rescale': True, 'factor_decay': 0.5,
                           'damping_target': 1e-4,
                           'damping_warmup_steps': 3}, 'float64', 'mean'),
    'conv_bn': (ConvBNNet, {}, 'float64', 'mean'),
    'conv_bn_diag_acc2': (ConvBNNet, {'bn_fisher': 'diag', 'acc_iters': 2},
                          'float64', 'mean'),
    'conv_bn_fp16': (lambda: ConvBNNet(numpy.float32),
                     {'factor_dtype': 'float16'}, 'float32', 'mean'),
}


def run_case(name):
    """Weights and velocities after :data:`STEPS` updates of one case."""
    make, kwargs, dtype, reduction = CASES[name]
    numpy.random.seed(0)
    model = make()
    optimizer = helpers.kfac(lr=0.05, momentum=0.9, damping=1e-2, **kwargs)
    optimizer.setup(model)
    rng = numpy.random.RandomState(1)
    conv = isinstance(model, ConvBNNet)

    def lossfun(x, t):
        loss = F.softmax_cross_entropy(model(x), t, reduce='no')
        return F.sum(loss) if reduction == 'sum' else F.mean(loss)

    for _ in range(STEPS * optimizer.acc_iters):
        shape = (6, 2, 6, 6) if conv else (6, 6)
        x = rng.normal(size=shape).astype(dtype)
        t = rng.randint(0, 3, size=6).astype(numpy.int32)
        optimizer.update(lossfun, x, t)
    out = {}
    for path, param in model.namedparams():
        out[name + path] = param.array
        out[name + path + '/v'] = param.update_rule.state['v']
    return out


def _write(path):
    arrays = {}
    for name in CASES:
        arrays.update(run_case(name))
    arrays['numpy_version'] = numpy.array(numpy.__version__)
    numpy.savez(path, **arrays)


@pytest.fixture(scope='module')
def results(tmp_path_factory):
    """Every case, run in a subprocess with one BLAS thread."""
    path = str(tmp_path_factory.mktemp('reference') / 'now.npz')
    env = dict(os.environ, OPENBLAS_NUM_THREADS='1', OMP_NUM_THREADS='1',
               MKL_NUM_THREADS='1')
    root = os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.dirname(os.path.abspath(__file__)))))
    subprocess.run([sys.executable, '-m', __name__, path], cwd=root,
                   env=env, check=True)
    return numpy.load(path)


@pytest.mark.parametrize('name', sorted(CASES))
def test_update_with_lossfun_equals_stored_reference(name, results):
    stored = numpy.load(REFERENCE)
    same_numpy = str(stored['numpy_version']) == numpy.__version__
    got = {k: results[k] for k in results.files if k.startswith(name + '/')}
    assert got, name
    for key, value in got.items():
        expected = stored[key]
        assert value.dtype == expected.dtype, key
        if same_numpy:
            assert numpy.array_equal(value, expected), (
                key, float(abs(value - expected).max()))
        else:
            numpy.testing.assert_allclose(value, expected, rtol=1e-12,
                                          atol=1e-12, err_msg=key)


def test_reference_cases_moved_the_weights():
    # The reference is not of runs that did nothing: the weights of every
    # case moved away from their initial values.
    stored = numpy.load(REFERENCE)
    for name in CASES:
        numpy.random.seed(0)
        initial = {name + p: v.array.copy()
                   for p, v in CASES[name][0]().namedparams()}
        moved = [k for k, v in initial.items()
                 if not numpy.array_equal(v, stored[k])]
        assert len(moved) == len(initial), (name, sorted(
            set(initial) - set(moved)))


if __name__ == '__main__':
    _write(sys.argv[1])

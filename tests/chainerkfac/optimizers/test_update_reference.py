"""A refactor guard: ``optimizer.update(lossfun, ...)`` gives the results
it gave when ``update_reference.npz`` was written (by the optimizer as it
was before the capture moved out of ``update``, issue 16), to the rounding
of the machine's BLAS.

``update_reference.npz`` holds the weights and velocities after four
updates of each case below (``python -m
tests.chainerkfac.optimizers.test_update_reference REFERENCE`` writes it).
It guards the arithmetic of a step, not the bits of one CPU: OpenBLAS picks
its kernels by CPU at run time (and by the number of threads), so a Gram
product or a Cholesky factor may round differently elsewhere. The bounds,
per array, relative to its largest entry:

- float64 cases, ``1e-12``: four steps of float64 arithmetic (unit
  roundoff 1.1e-16) through Cholesky inverses of factors damped at
  γ = 1e-2; the worst measured over OpenBLAS 0.3.23's Prescott, Core2,
  Nehalem, Sandybridge, Haswell, Zen, SkylakeX, Cooperlake and
  SapphireRapids kernels was 2.7e-14 (``mlp_rescale``).
- the float16-factor case, ``1e-2``: its factors are float32 Gram products
  rounded to float16 (unit roundoff 4.9e-4), so where the last float32 bits
  differ a factor entry may round to the next float16, 9.8e-4 apart
  relative to it; measured worst 7.0e-4 (Sandybridge against Haswell).

A changed step (another damping split, a missing term, a reordered update)
moves the weights by far more than these: the tests below also check that
each case's weights moved.
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import os
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
    numpy.savez(path, **arrays)


#: Bound on ``|now - stored|`` relative to the array's largest entry, by
#: the case's factor dtype (see the module's docstring).
RELATIVE_BOUND = {'float64': 1e-12, 'float16': 1e-2}


def bound_of(name):
    kwargs = CASES[name][1]
    return RELATIVE_BOUND[kwargs.get('factor_dtype', 'float64')]


@pytest.mark.parametrize('name', sorted(CASES))
def test_update_with_lossfun_equals_stored_reference(name):
    stored = numpy.load(REFERENCE)
    got = run_case(name)
    expected_keys = {k for k in stored.files if k.startswith(name + '/')}
    assert set(got) == expected_keys, name
    bound = bound_of(name)
    for key, value in got.items():
        expected = stored[key]
        assert value.dtype == expected.dtype, key
        scale = float(abs(expected).max())
        error = float(abs(value - expected).max())
        assert error <= bound * scale, (key, error, scale)


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

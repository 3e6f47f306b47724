"""The seed's damped update (experiments/curvature/damped_update.py): the
Kronecker-factored solve against the dense matrix it stands for."""
import math

import numpy

from chainerkfac import curvature
from experiments.curvature.damped_update import (DampedCurvatureUpdate,
                                                 kronecker_solve)
from tests.chainerkfac.curvature import nets


def test_kronecker_solve_is_the_dense_damped_solve():
    rng = numpy.random.RandomState(0)
    a = rng.randn(5, 5)
    a = a.dot(a.T)
    b = rng.randn(3, 3)
    b = b.dot(b.T) * 7
    grad = rng.randn(3, 5)
    damping = 0.3
    pi = math.sqrt((numpy.trace(a) / 5) / (numpy.trace(b) / 3))
    dense = numpy.kron(b + math.sqrt(damping) / pi * numpy.eye(3),
                       a + pi * math.sqrt(damping) * numpy.eye(5))
    expected = numpy.linalg.solve(dense, grad.ravel()).reshape(3, 5)
    numpy.testing.assert_allclose(kronecker_solve(a, b, grad, damping),
                                  expected, rtol=1e-10)


def test_step_is_the_preconditioned_gradient():
    model, x, t = nets.build('conv_pool_linear')
    before = {p: v.array.copy() for p, v in model.namedparams()}
    update = DampedCurvatureUpdate(model, 'diag_ggn', lr=0.5, damping=0.1)
    update.update(x, t)
    model_ = nets.build('conv_pool_linear')[0]
    q = curvature.extract(model_, x, t, quantities=('diag_ggn',))
    for path, p in model_.namedparams():
        step = 0.5 * p.grad / (q[path]['diag_ggn'] + 0.1)
        numpy.testing.assert_allclose(
            dict(model.namedparams())[path].array, before[path] - step,
            rtol=1e-12, err_msg=path)

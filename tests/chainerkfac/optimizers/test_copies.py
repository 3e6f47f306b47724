"""A K-FAC optimizer copied with its model — ``copy.deepcopy`` (a branch of
a run, an EMA copy) or ``pickle`` — trains on as the original would, as
Chainer's MomentumSGD does: the copy captures its own curvature (its own
function hook; the copied one answered to the original and was never in
the hooks, so the copy kept its old factors forever)."""
import copy
import pickle

import numpy
import pytest

import chainerkfac
import chainer.links as L

from tests.chainerkfac import helpers


def run(steps, model=None, optimizer=None):
    """A ConvNet with BN trained at the library's defaults (stale factors
    refreshed on its schedule, the step bounded) for ``steps`` steps."""
    x, t = helpers.data(n=8, shape=(2, 5, 5))
    if model is None:
        numpy.random.seed(0)
        model = L.Classifier(helpers.ConvNet(bn=True))
        optimizer = chainerkfac.optimizers.KFAC(
            lr=0.05, momentum=0.9, verbose=False).setup(model)
    for _ in range(steps):
        optimizer.update(model, x, t)
    return model, optimizer


def weights(model):
    return {name: p.array.copy() for name, p in model.namedparams()}


@pytest.mark.parametrize('how', ['deepcopy', 'pickle'])
def test_a_copy_trains_on_as_the_original_would(how):
    straight, _ = run(30)
    model, optimizer = run(3)
    if how == 'deepcopy':
        branch, branch_optimizer = copy.deepcopy((model, optimizer))
    else:
        branch, branch_optimizer = pickle.loads(pickle.dumps(
            (model, optimizer)))
    for _ in range(27):         # both on, in turns
        run(1, model, optimizer)
        run(1, branch, branch_optimizer)
    expected = weights(straight)
    for trained in (model, branch):
        for name, value in weights(trained).items():
            numpy.testing.assert_array_equal(value, expected[name],
                                             err_msg=name)
    assert branch_optimizer.estimator.capture_hook is not \
        optimizer.estimator.capture_hook

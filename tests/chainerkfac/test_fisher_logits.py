"""The logits that ``fisher='mc'`` and ``'exact'`` sample from: the one
logits-function call of the loss, on the model's output."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

from tests.chainerkfac import helpers

LOSSES = {
    'softmax_cross_entropy': lambda y, t: F.softmax_cross_entropy(y, t),
    'log_softmax': lambda y, t: -F.mean(F.select_item(F.log_softmax(y), t)),
    'softmax': lambda y, t: -F.mean(F.log(F.select_item(F.softmax(y), t))),
}


def _step(loss, fisher, model_seed=0):
    x, t = helpers.data(n=8, shape=(5,), n_class=3)
    numpy.random.seed(model_seed)
    model = helpers.MLP()
    optimizer = helpers.kfac(fisher=fisher, seed=1)
    optimizer.setup(model)
    optimizer.update(lambda x, t: loss(model(x), t), x, t)
    return model, optimizer


@pytest.mark.parametrize('fisher', ['exact', 'mc'])
@pytest.mark.parametrize('loss', ['log_softmax', 'softmax'])
def test_log_softmax_and_softmax_losses_sample_as_softmax_cross_entropy(
        loss, fisher):
    """F.log_softmax and F.softmax (registered logits functions) keep
    their output, not the logits: the passes raised ``'NoneType' object
    has no attribute 'astype'``. Their logits are now taken from that
    output (up to a constant per sample): the factors and the step equal
    those of F.softmax_cross_entropy on the same logits, in float64 (the
    exact Fisher to rounding; the sampled one draws the same labels from
    probabilities equal to rounding)."""
    model, optimizer = _step(LOSSES[loss], fisher)
    reference, expected = _step(LOSSES['softmax_cross_entropy'], fisher)
    for got, want in zip(optimizer.blocks, expected.blocks):
        for name in want.factors:
            numpy.testing.assert_allclose(
                helpers.dense(got.factors[name]),
                helpers.dense(want.factors[name]), rtol=1e-10, atol=1e-14)
    for (name, a), (_, b) in zip(sorted(model.namedparams()),
                                 sorted(reference.namedparams())):
        numpy.testing.assert_allclose(a.array, b.array, rtol=1e-10,
                                      atol=1e-14, err_msg=name)


class TwoHeads(chainer.Chain):
    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.trunk = L.Linear(5, 6)
            self.main = L.Linear(6, 3)
            self.aux = L.Linear(6, 3)

    def loss(self, x, t):
        h = F.tanh(self.trunk(x))
        return (F.softmax_cross_entropy(self.main(h), t) +
                0.3 * F.softmax_cross_entropy(self.aux(h), t))


class Gate(chainer.Chain):
    """A softmax inside the model, a regression loss on its output."""

    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.l1 = L.Linear(5, 6)
            self.l2 = L.Linear(6, 3)

    def forward(self, x):
        return self.l2(F.softmax(self.l1(x)) * 6.0)


@pytest.mark.parametrize('fisher', ['mc', 'exact'])
def test_a_loss_of_two_heads_is_refused_and_emp_takes_it(fisher):
    """Main + 0.3 auxiliary head: only the auxiliary head's logits were
    sampled, the main head never got a G factor and the trunk's G came
    from the auxiliary head alone."""
    x, t = helpers.data(n=8, shape=(5,), n_class=3)
    model = TwoHeads()
    optimizer = helpers.kfac(fisher=fisher)
    optimizer.setup(model)
    with pytest.raises(RuntimeError, match=r"loss comes from 2 calls of "
                       r"logits functions \(SoftmaxCrossEntropy, "
                       r"SoftmaxCrossEntropy\).*fisher='emp'"):
        optimizer.update(model.loss, x, t)
    optimizer = helpers.kfac(fisher='emp')
    optimizer.setup(model)
    optimizer.update(model.loss, x, t)
    assert all(block.has_inverses() for block in optimizer.blocks)


@pytest.mark.parametrize('fisher', ['mc', 'exact'])
def test_a_softmax_inside_the_model_is_refused(fisher):
    """A regression loss on a model with a softmax gate: the gate's
    softmax was taken for the logits (the 'exact' Fisher of a categorical
    distribution the model does not predict), or the passes crashed."""
    x = numpy.random.RandomState(0).randn(8, 5)
    y = numpy.random.RandomState(1).randn(8, 3)
    model = Gate()
    optimizer = helpers.kfac(fisher=fisher)
    optimizer.setup(model)
    with pytest.raises(RuntimeError, match=r"Softmax call is inside the "
                       r"model.*through LinearFunction"):
        optimizer.update(lambda x, y: F.mean_squared_error(model(x), y),
                         x, y)


def test_a_softmax_beside_the_loss_is_not_its_logits():
    """A softmax the loss function computes for a report (not part of the
    loss) is no logits call of the loss."""
    x, t = helpers.data(n=8, shape=(5,), n_class=3)
    numpy.random.seed(0)
    model = helpers.MLP()
    optimizer = helpers.kfac(fisher='exact')
    optimizer.setup(model)

    def loss(x, t):
        y = model(x)
        F.softmax(y)                              # e.g. for a confidence
        return F.softmax_cross_entropy(y, t)
    optimizer.update(loss, x, t)
    reference, expected = _step(LOSSES['softmax_cross_entropy'], 'exact')
    for (name, a), (_, b) in zip(sorted(model.namedparams()),
                                 sorted(reference.namedparams())):
        numpy.testing.assert_array_equal(a.array, b.array, err_msg=name)

"""Frozen parameters under K-FAC (fine-tuning): a parameter whose update
rule is off is not moved, and does not move the others of its block.

Found by a stranger's run (2026-11-27): a Linear's W frozen
(``W.update_rule.enabled = False``), its bias trainable; the frozen W's
γ(w − μ) of eq. (13) went into the block's joint preconditioning and
moved the bias where its gradient was zero (MomentumSGD left it)."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

from tests.chainerkfac import helpers


def _centred_loss(link):
    """A loss whose gradient with respect to the bias is zero: the
    outputs centred over the batch (the bias cancels)."""
    def lossfun(x):
        y = link(x)
        centred = y - F.broadcast_to(F.mean(y, axis=0, keepdims=True),
                                     y.shape)
        return F.mean(centred ** 2)
    return lossfun


@pytest.mark.parametrize('low_rank', [False, True])
def test_a_frozen_weight_does_not_move_its_bias(low_rank):
    numpy.random.seed(0)
    with helpers.float64_links():
        link = L.Linear(8, 4)
    model = chainer.Sequential(link)
    optimizer = helpers.kfac(low_rank=low_rank)
    optimizer.setup(model)
    link.W.update_rule.enabled = False
    weight = link.W.array.copy()
    x = numpy.random.RandomState(1).randn(16, 8)
    for _ in range(3):
        optimizer.update(_centred_loss(link), x)
        # the bias's own gradient: rounding only
        assert abs(link.b.grad).max() < 1e-14
    numpy.testing.assert_array_equal(link.W.array, weight)
    # eq. (13)'s damping term of the bias alone: γ(b − 0) with b = 0
    assert abs(link.b.array).max() < 1e-12, link.b.array


def test_a_frozen_beta_does_not_move_gamma():
    """The same for BatchNormalization's (γ, β) block: β frozen, γ's
    gradient zero (the loss weighs each output by a ``c`` orthogonal to
    the normalised input, per channel, so that Σ c x̂ = 0 while the
    per-sample gradients c x̂ couple γ and β in the block's Fisher): γ
    stays at 1, its μ."""
    numpy.random.seed(0)
    with helpers.float64_links():
        link = L.BatchNormalization(3)
    model = chainer.Sequential(link)
    optimizer = helpers.kfac()
    optimizer.setup(model)
    link.beta.update_rule.enabled = False
    link.beta.array[...] = 2.0
    rs = numpy.random.RandomState(1)
    x = rs.randn(8, 3)
    normalised = (x - x.mean(0)) / numpy.sqrt(x.var(0) + link.eps)
    c = rs.randn(8, 3) + 1.0
    c -= (c * normalised).sum(0) / (normalised ** 2).sum(0) * normalised
    for _ in range(3):
        optimizer.update(lambda x: F.mean(link(x) * c), x)
        assert abs(link.gamma.grad).max() < 1e-12
    numpy.testing.assert_array_equal(link.beta.array, 2.0)
    numpy.testing.assert_allclose(link.gamma.array, 1.0, rtol=0,
                                  atol=1e-12)


def test_a_backbone_without_gradients_is_said_once(caplog):
    """Fine-tuning: a backbone run in ``no_backprop_mode``, a new head
    trained. Its factors are never captured, which K-FAC said in a line
    per layer (12 for a stranger's 12 layers): now one line naming them;
    and nothing once the backbone is frozen (``disable_update()`` after
    ``setup``, where Chainer's update rules exist)."""
    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with helpers.float64_links(), self.init_scope():
                self.backbone = chainer.ChainList(
                    *[L.Linear(5, 5) for _ in range(3)])
                self.head = L.Linear(5, 3)

        def forward(self, x):
            with chainer.no_backprop_mode():
                for link in self.backbone:
                    x = F.relu(link(x))
            return self.head(x)

    x = numpy.random.RandomState(1).randn(8, 5)
    t = numpy.random.RandomState(2).randint(0, 3, 8).astype(numpy.int32)
    for frozen in (False, True):
        caplog.clear()
        numpy.random.seed(0)
        model = L.Classifier(Net())
        optimizer = helpers.kfac()
        optimizer.setup(model)
        if frozen:
            model.predictor.backbone.disable_update()
        with caplog.at_level('WARNING', logger='chainerkfac'):
            for _ in range(3):
                optimizer.update(model, x, t)
        warned = [r.getMessage() for r in caplog.records
                  if 'not captured' in r.getMessage()]
        if frozen:
            assert not warned
            continue
        assert len(warned) == 1, warned
        for i in range(3):
            assert '/predictor/backbone/{} (Linear (K-FAC)): factors A, G'\
                .format(i) in warned[0]
        assert warned[0].endswith('each is not updated while it has no '
                                  'gradient')

"""A link placed twice in a model, and a parameter of two links (tied
weights): every parameter is updated once a step.

Found by a stranger's run (2026-11-27): ``chainer.Sequential(l, F.relu,
l, ...)`` registered two blocks for ``l``; each step updated its W twice,
once with the K-FAC direction and once with the plain gradient (the
second block's capture saw no call: its hook warned "no backward pass
... reached"). Tied embeddings (``out.W = embed.W``) the same, silently."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest

from tests.chainerkfac import helpers


class CalledTwice(chainer.Chain):
    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.l = L.Linear(6, 6)
            self.head = L.Linear(6, 3)

    def forward(self, x):
        return self.head(F.relu(self.l(F.relu(self.l(x)))))


def test_a_link_placed_twice_is_one_block_as_a_link_called_twice():
    x = numpy.random.RandomState(1).randn(8, 6)
    t = numpy.random.RandomState(2).randint(0, 3, 8).astype(numpy.int32)
    numpy.random.seed(0)
    reference = CalledTwice()
    numpy.random.seed(0)
    placed = CalledTwice()
    sequential = chainer.Sequential(placed.l, F.relu, placed.l, F.relu,
                                    placed.head)
    runs = []
    for predictor in (reference, sequential):
        model = L.Classifier(predictor)
        optimizer = helpers.kfac()
        optimizer.setup(model)
        assert len(optimizer.blocks) == 2
        for _ in range(3):
            optimizer.update(model, x, t)
        runs.append(predictor)
    assert placed.l.W.update_rule.t == 3
    for a, b in ((reference.l, placed.l), (reference.head, placed.head)):
        for name in ('W', 'b'):
            numpy.testing.assert_allclose(
                getattr(b, name).array, getattr(a, name).array, rtol=0,
                atol=1e-13, err_msg=name)


class Tied(chainer.Chain):
    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.embed = L.EmbedID(12, 6)
            self.out = L.Linear(6, 12)
        self.out.W = self.embed.W

    def forward(self, words):
        return self.out(F.tanh(self.embed(words)))


def test_a_tied_parameter_is_updated_once_by_its_first_block():
    numpy.random.seed(0)
    model = L.Classifier(Tied())
    optimizer = helpers.kfac()
    with pytest.warns(UserWarning, match=r'/predictor/out shares W with '
                      r'/predictor/embed \(tied weights\)'):
        optimizer.setup(model)
    holders = [b.name for b in optimizer.blocks
               for p in b.params if p is model.predictor.embed.W]
    assert holders == ['/predictor/embed']
    [out] = [b for b in optimizer.blocks if b.name == '/predictor/out']
    assert out.kind == 'plain gradient'
    assert [p.name for p in out.params] == ['b']
    words = numpy.random.RandomState(1).randint(0, 12, 8).astype(numpy.int32)
    before = model.predictor.embed.W.array.copy()
    optimizer.update(model, words, words)
    # once (its update rule's t counts the updates)
    assert model.predictor.embed.W.update_rule.t == 1
    assert numpy.isfinite(model.predictor.embed.W.array).all()
    assert not numpy.array_equal(model.predictor.embed.W.array, before)

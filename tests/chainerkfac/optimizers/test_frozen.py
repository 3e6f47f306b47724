"""A link frozen with ``disable_update()`` (fine-tuning) is left out of
K-FAC's step as Chainer's optimizers leave it out: it does not move, and
its gradient — Chainer still computes it — does not count in the bounded
step, so the layers that train take the step they would take alone.
Oracle: the trainable layer alone, trained on the frozen layer's output."""
import numpy

import chainerkfac
import chainer.functions as F
import chainer.links as L

from tests.chainerkfac import helpers


def kfac():
    """At the library's defaults: the step bounded (kl_clip), stale
    factors."""
    return chainerkfac.optimizers.KFAC(lr=0.1, momentum=0.9, verbose=False)


def test_a_frozen_layer_does_not_shrink_the_others_steps():
    x, t = helpers.data(n=16, shape=(5,), n_class=3)
    numpy.random.seed(0)
    model = helpers.MLP((5, 4, 3))
    head = model.l2.copy(mode='copy')
    frozen_w = model.l1.W.array.copy()
    classifier = L.Classifier(model)
    optimizer = kfac().setup(classifier)
    model.l1.disable_update()
    features = F.tanh(model.l1(x)).array          # the frozen layer's output
    alone = L.Classifier(head)
    reference = kfac().setup(alone)
    for _ in range(3):
        optimizer.update(classifier, x, t)
        reference.update(alone, features, t)
    numpy.testing.assert_array_equal(model.l1.W.array, frozen_w)
    assert optimizer.step_bound.scale < 1          # the bound acted
    numpy.testing.assert_allclose(model.l2.W.array, head.W.array,
                                  rtol=0, atol=1e-12)
    numpy.testing.assert_allclose(model.l2.b.array, head.b.array,
                                  rtol=0, atol=1e-12)


def test_a_frozen_layer_costs_no_curvature_until_it_is_unfrozen():
    """A frozen link's factors were captured, exchanged and inverted at
    every refresh as a trainable one's (a frozen backbone's fine-tuning
    paid full K-FAC). Now it has none of that while frozen; unfrozen, its
    factors are due at the next step that starts and it is
    preconditioned from then on."""
    x, t = helpers.data(n=16, shape=(5,), n_class=3)
    numpy.random.seed(0)
    model = helpers.MLP((5, 4, 3))
    classifier = L.Classifier(model)
    optimizer = helpers.kfac().setup(classifier)   # refreshed every step
    model.l1.disable_update()
    for _ in range(3):
        optimizer.update(classifier, x, t)
    l1, l2 = (helpers.block_named(optimizer, n)
              for n in ('/predictor/l1', '/predictor/l2'))
    assert dict(l1.inverse_count) == {'A': 0, 'G': 0} and not l1.factors
    assert dict(l2.inverse_count) == {'A': 3, 'G': 3}
    model.l1.enable_update()
    optimizer.update(classifier, x, t)      # its due set was decided
    optimizer.update(classifier, x, t)
    assert l1.inverse_count['A'] >= 1 and l1.has_inverses()

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
    paid full K-FAC). Now it has none of that while frozen; unfrozen, it
    is preconditioned from its first step: ``update(lossfun)`` decides
    the step's factors again before its passes (the step after
    ``enable_update()`` was a plain, unbounded gradient step)."""
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
    optimizer.update(classifier, x, t)
    assert dict(l1.inverse_count) == {'A': 1, 'G': 1} and l1.has_inverses()


def test_a_link_unfrozen_after_a_manual_backward_is_said_once(caplog):
    """``loss.backward(); optimizer.update()``: the passes ran before the
    update could decide again; the plain gradient step is said, once."""
    x, t = helpers.data(n=16, shape=(5,), n_class=3)
    numpy.random.seed(0)
    model = helpers.MLP((5, 4, 3))
    classifier = L.Classifier(model)
    optimizer = helpers.kfac().setup(classifier)
    model.l1.disable_update()

    def step():
        classifier.cleargrads()
        classifier(x, t).backward()
        optimizer.update()
    step()
    model.l1.enable_update()
    caplog.set_level('WARNING', logger='chainerkfac')
    step()
    step()
    said = [r.getMessage() for r in caplog.records
            if 'enable_update' in r.getMessage()]
    assert len(said) == 1 and '/predictor/l1 frozen when this step' in \
        said[0] and 'plain gradient step' in said[0], said
    l1 = helpers.block_named(optimizer, '/predictor/l1')
    assert l1.has_inverses()            # from the next step on


def test_a_run_resumed_where_a_link_is_unfrozen_goes_on_to_the_bit(
        tmp_path):
    """Frozen for 4 steps, snapshot, unfrozen: the uninterrupted run had
    decided the 5th step's factors while the link was frozen (refreshed
    first at step 6), the resumed one decided them after the unfreeze
    (step 5): weights 0.09 apart. The snapshot keeps which blocks were
    frozen when the coming step was decided."""
    import chainer
    x, t = helpers.data(n=16, shape=(5,), n_class=3)
    options = dict(lr=0.05, refresh_interval_a=3, refresh_interval_g=3,
                   refresh_interval_f=3, kl_clip=1e-3)

    def make():
        numpy.random.seed(0)
        model = helpers.MLP()
        return model, helpers.kfac(**options).setup(model)

    def steps(model, optimizer, n):
        for _ in range(n):
            optimizer.update(helpers.loss_of(model), x, t)

    model, optimizer = make()
    model.l1.disable_update()
    steps(model, optimizer, 4)
    chainer.serializers.save_npz(str(tmp_path / 'o.npz'), optimizer)
    chainer.serializers.save_npz(str(tmp_path / 'm.npz'), model)
    model.l1.enable_update()
    steps(model, optimizer, 5)
    resumed, fresh = make()
    resumed.l1.disable_update()
    chainer.serializers.load_npz(str(tmp_path / 'o.npz'), fresh)
    chainer.serializers.load_npz(str(tmp_path / 'm.npz'), resumed)
    resumed.l1.enable_update()
    steps(resumed, fresh, 5)
    assert helpers.block_named(fresh, '/l1').inverse_count['A'] >= 1
    for (name, a), (_, b) in zip(sorted(model.namedparams()),
                                 sorted(resumed.namedparams())):
        numpy.testing.assert_array_equal(a.array, b.array, err_msg=name)


def test_a_link_unfrozen_between_micro_batches_is_said_and_one_before(
        caplog):
    """``acc_iters=2``: unfrozen before a step's first micro-batch,
    ``update(lossfun)`` decides again and the link is preconditioned
    from that step; unfrozen between its micro-batches, the first's
    passes ran uncaptured: said once (it was silent)."""
    x, t = helpers.data(n=16, shape=(5,), n_class=3)
    caplog.set_level('WARNING', logger='chainerkfac')
    for between in (False, True):
        numpy.random.seed(0)
        model = helpers.MLP((5, 4, 3))
        optimizer = helpers.kfac(acc_iters=2).setup(model)
        model.l1.disable_update()
        loss = helpers.loss_of(model)
        for _ in range(2):
            optimizer.update(loss, x[0::2], t[0::2])
            optimizer.update(loss, x[1::2], t[1::2])
        caplog.clear()
        if not between:
            model.l1.enable_update()
        optimizer.update(loss, x[0::2], t[0::2])
        if between:
            model.l1.enable_update()
        optimizer.update(loss, x[1::2], t[1::2])
        l1 = helpers.block_named(optimizer, '/l1')
        said = [r.getMessage() for r in caplog.records
                if 'enable_update' in r.getMessage()]
        assert l1.has_inverses() != between
        assert len(said) == int(between), said

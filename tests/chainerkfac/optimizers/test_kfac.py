"""KFAC optimizer: preconditioning, update rule, accumulation, stale refresh,
state round-trip and failure paths, each against an independent computation
(float64)."""
import io
import logging
import math
import re

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import serializers

import chainerkfac
from chainerkfac import equations
from tests.chainerkfac import helpers


def clone(model):
    return model.copy(mode='copy')


def weights(model):
    return {n: p.array.copy() for n, p in model.namedparams()}


def assert_same_weights(a, b, **tol):
    for name in a:
        numpy.testing.assert_allclose(a[name], b[name], err_msg=name, **tol)


def test_direction_equals_dense_damped_solve():
    """(G + γ_G I)⁻¹ ⊗ (A + γ_A I)⁻¹ applied to ∇E, solved densely; BN with
    (F + ρ_BN γ I)⁻¹ ∇E, μ = 1 for BN γ."""
    model = helpers.ConvNet(bn=True)
    model.bn.gamma.array[:] = numpy.linspace(0.5, 1.5, 3)
    x, t = helpers.data(n=6)
    damping, rho_bn = 1e-2, 4.0
    optimizer = helpers.kfac(lr=1.0, momentum=0.0, damping=damping,
                             rho_bn=rho_bn)
    optimizer.setup(model)
    before = weights(model)
    model.cleargrads()
    F.softmax_cross_entropy(model(x), t).backward()
    grads = {n: p.grad.copy() for n, p in model.namedparams()}
    optimizer.update(helpers.loss_of(model), x, t)
    after = weights(model)
    step = {n: before[n] - after[n] for n in before}   # lr = 1: the direction

    for name in ('conv', 'fc'):
        block = helpers.block_named(optimizer, '/' + name)
        a, g = (helpers.dense(block.factors[n]) for n in 'AG')
        pi = math.sqrt((numpy.trace(a) / len(a)) / (numpy.trace(g) / len(g)))
        damped = numpy.kron(g + math.sqrt(damping) / pi * numpy.eye(len(g)),
                            a + pi * math.sqrt(damping) * numpy.eye(len(a)))
        w, b = before['/%s/W' % name], before['/%s/b' % name]
        grad_e = numpy.concatenate(
            [(grads['/%s/W' % name] + damping * w).reshape(len(g), -1),
             (grads['/%s/b' % name] + damping * b)[:, None]], axis=1)
        expected = numpy.linalg.solve(damped, grad_e.reshape(-1))
        expected = expected.reshape(len(g), -1)
        numpy.testing.assert_allclose(
            step['/%s/W' % name].reshape(len(g), -1), expected[:, :-1],
            rtol=1e-8, atol=1e-12)
        numpy.testing.assert_allclose(step['/%s/b' % name], expected[:, -1],
                                      rtol=1e-8, atol=1e-12)

    fisher = helpers.block_named(optimizer, '/bn').factors['F']
    gamma, beta = before['/bn/gamma'], before['/bn/beta']
    grad_e = numpy.concatenate(
        [grads['/bn/gamma'] + rho_bn * damping * (gamma - 1.0),
         grads['/bn/beta'] + rho_bn * damping * beta])
    expected = numpy.linalg.solve(
        fisher + rho_bn * damping * numpy.eye(len(fisher)), grad_e)
    numpy.testing.assert_allclose(step['/bn/gamma'], expected[:3], rtol=1e-8)
    numpy.testing.assert_allclose(step['/bn/beta'], expected[3:], rtol=1e-8)


def test_update_follows_eq19_and_eq20_by_hand():
    """w(t+1) = w − η G + m (w(t) − w(t−1)), then W rescaled to √(2 d_out)."""
    model = helpers.MLP()
    x, t = numpy.random.RandomState(0).randn(5, 5), \
        numpy.array([0, 1, 2, 0, 1], numpy.int32)
    lr, momentum = 0.1, 0.5
    optimizer = helpers.kfac(lr=lr, momentum=momentum, weight_rescale=True)
    optimizer.setup(model)

    def direction_of(model):
        # The direction the optimizer will apply, from a throw-away copy
        # with lr=1, momentum=0 and no rescaling.
        probe = clone(model)
        probe_opt = helpers.kfac(lr=1.0, momentum=0.0)
        probe_opt.setup(probe)
        start = weights(probe)
        probe_opt.update(helpers.loss_of(probe), x, t)
        return {n: start[n] - p.array for n, p in probe.namedparams()}

    history = [weights(model)]
    for _ in range(3):
        direction = direction_of(model)
        w_t = history[-1]
        w_prev = history[-2] if len(history) > 1 else w_t
        expected = {}
        for name in w_t:
            new = w_t[name] - lr * direction[name] + momentum * (
                w_t[name] - w_prev[name])
            if name.endswith('/W'):
                d_out = new.shape[0]
                new = math.sqrt(2 * d_out) * new / (
                    numpy.linalg.norm(new) + 1e-9)
            expected[name] = new
        optimizer.update(helpers.loss_of(model), x, t)
        history.append(weights(model))
        assert_same_weights(history[-1], expected, rtol=1e-9, atol=1e-12)
    for name in ('/l1/W', '/l2/W'):
        norm = numpy.linalg.norm(history[-1][name])
        assert norm == pytest.approx(
            math.sqrt(2 * history[-1][name].shape[0]), rel=1e-9)


@pytest.mark.parametrize('stale', [False, True])
def test_acc_iters_equals_one_big_batch_without_bn(stale):
    x, t = helpers.data(n=8)
    base = helpers.ConvNet()
    intervals = dict(refresh_interval_a=2, refresh_interval_g=3) if stale \
        else {}
    results = []
    for acc, chunks in ((1, [slice(0, 8)]),
                        (2, [slice(0, 4), slice(4, 8)]),
                        (4, [slice(0, 2), slice(2, 4), slice(4, 6),
                             slice(6, 8)])):
        model = clone(base)
        optimizer = helpers.kfac(lr=0.05, momentum=0.9, acc_iters=acc,
                                 weight_rescale=True, **intervals)
        optimizer.setup(model)
        for _ in range(4):
            for chunk in chunks:
                optimizer.update(helpers.loss_of(model), x[chunk], t[chunk])
        assert optimizer.t == 4
        results.append(weights(model))
    assert_same_weights(results[0], results[1], rtol=1e-9, atol=1e-12)
    assert_same_weights(results[0], results[2], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize('reduction', ['mean', 'sum'])
def test_a_flush_told_the_global_micro_batches_steps_as_one_process(
        reduction):
    """``flush_accumulation(global_micro_batches=n)`` on one process, n
    its own count: the step of ``flush_accumulation()``, to the bit (the
    scale size/n is 1/n exactly); 0: no step. (Processes with different
    counts: tests/scripts/test_resume.py, the run's end on 2.)"""
    x, t = helpers.data(n=8)
    base = helpers.ConvNet()
    results = []
    for told in (False, True):
        model = clone(base)
        optimizer = helpers.kfac(lr=0.05, momentum=0.9, acc_iters=4,
                                 loss_reduction=reduction).setup(model)

        def loss(x, t, model=model):
            value = F.softmax_cross_entropy(model(x), t,
                                            reduce='no' if reduction ==
                                            'sum' else 'mean')
            return F.sum(value) if reduction == 'sum' else value
        for chunk in (slice(0, 3), slice(3, 5), slice(5, 8)):
            optimizer.update(loss, x[chunk], t[chunk])
        assert optimizer.flush_accumulation(
            **({'global_micro_batches': 3} if told else {})) == 3
        assert optimizer.t == 1 and optimizer.global_micro_batches is None
        assert optimizer.flush_accumulation(global_micro_batches=0) == 0
        assert optimizer.t == 1
        results.append(weights(model))
    assert_same_weights(results[0], results[1], rtol=0, atol=0)


def test_acc_iters_with_bn_averages_per_chunk_statistics():
    x, t = helpers.data(n=8)
    base = helpers.ConvNet(bn=True)
    per_chunk = []
    for chunk in (slice(0, 4), slice(4, 8)):
        model = clone(base)
        optimizer = helpers.kfac(lr=0.0, momentum=0.0)
        optimizer.setup(model)
        optimizer.update(helpers.loss_of(model), x[chunk], t[chunk])
        per_chunk.append(helpers.block_named(optimizer, '/bn').factors['F'])
    model = clone(base)
    optimizer = helpers.kfac(lr=0.0, momentum=0.0, acc_iters=2)
    optimizer.setup(model)
    for chunk in (slice(0, 4), slice(4, 8)):
        optimizer.update(helpers.loss_of(model), x[chunk], t[chunk])
    numpy.testing.assert_allclose(
        helpers.block_named(optimizer, '/bn').factors['F'],
        (per_chunk[0] + per_chunk[1]) / 2, rtol=1e-10)


def test_micro_batches_of_unequal_sizes_are_warned_about_once(caplog):
    """Micro-batches of 3, 2 and 3 samples: each one's mean counts alike
    (the mean of their means, the convention of ChainerMN's process
    averaging), which differs from one batch of the 8 samples (by 7.6 % of
    the weights after a step in an auditor's run of 10, 10 and 4); it was
    silent. Said once, with the sizes; equal sizes are not warned about."""
    x, t = helpers.data(n=8)
    model = helpers.ConvNet()
    optimizer = helpers.kfac(lr=0.05, acc_iters=3).setup(model)
    with caplog.at_level(logging.WARNING, logger='chainerkfac'):
        for _ in range(2):
            for chunk in (slice(0, 3), slice(3, 5), slice(5, 8)):
                optimizer.update(helpers.loss_of(model), x[chunk], t[chunk])
    said = [r.getMessage() for r in caplog.records
            if 'micro-batches of' in r.getMessage()]
    assert said == [
        'K-FAC: micro-batches of 2, 3 samples in one step: each '
        "micro-batch's mean counts alike in the step's factors and "
        'gradient (as ChainerMN averages processes), so the step is the '
        'mean of their means, not that of one batch of their samples; '
        'micro-batches of one size give that (warned once)']
    caplog.clear()
    optimizer = helpers.kfac(lr=0.05, acc_iters=2).setup(helpers.ConvNet())
    with caplog.at_level(logging.WARNING, logger='chainerkfac'):
        for chunk in (slice(0, 4), slice(4, 8)):
            optimizer.update(helpers.loss_of(optimizer.target), x[chunk],
                             t[chunk])
    assert not [r for r in caplog.records
                if 'micro-batches of' in r.getMessage()]


def test_micro_batches_whose_means_count_other_labels_are_warned_about(
        caplog):
    """Micro-batches of one size whose softmax cross-entropy leaves out
    other numbers of ``ignore_label`` labels (3 and 1 of 4 valid): each
    mean divides by its own count, so the step is not that of one batch
    of their samples (an auditor measured the G factor 31 % off, the step
    32 %), although the docs said micro-batches of one size give it, and
    nothing was said. Now warned once, with the counts; with
    ``normalize=False`` (the means divide by the rows) nothing is said and
    the step is the concatenated batch's (float64, to 1e-12 of the
    weights)."""
    x, t = helpers.data(n=8)
    t = t.copy()
    t[[0, 4, 5, 6]] = -1
    base = helpers.ConvNet()
    results = {}
    for normalize in (True, False):
        def loss(x, t):
            return F.softmax_cross_entropy(model(x), t, normalize=normalize)
        model = clone(base)
        optimizer = helpers.kfac(lr=0.05, acc_iters=2).setup(model)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger='chainerkfac'):
            for _ in range(2):
                for chunk in (slice(0, 4), slice(4, 8)):
                    optimizer.update(loss, x[chunk], t[chunk])
        said = [r.getMessage() for r in caplog.records
                if 'divide by' in r.getMessage()]
        assert len(said) == (1 if normalize else 0), said
        if normalize:
            assert said[0].startswith(
                "K-FAC: the micro-batches' mean losses of one step divide "
                'by 1, 3 labels')
            assert 'normalize=False' in said[0]
        results[normalize] = weights(model)
        model = clone(base)
        whole = helpers.kfac(lr=0.05).setup(model)
        for _ in range(2):
            whole.update(loss, x, t)
        if not normalize:
            assert_same_weights(results[False], weights(model), rtol=1e-12,
                                atol=1e-12)


def test_stale_factors_are_computed_and_inverted_only_when_due(monkeypatch):
    model = helpers.ConvNet(bn=True)
    x, t = helpers.data(n=4)
    optimizer = helpers.kfac(refresh_interval_a=3, refresh_interval_g=2,
                             refresh_interval_f=lambda it, ep: 4)
    optimizer.setup(model)
    captured = {'inputs': 0, 'gradients': 0}
    for block in optimizer.blocks:
        for kind in ('inputs', 'gradients'):
            original = getattr(block, 'capture_' + kind)

            def counting(*args, _original=original, _kind=kind):
                captured[_kind] += 1
                return _original(*args)
            monkeypatch.setattr(block, 'capture_' + kind, counting)
    for _ in range(7):   # steps 0..6
        optimizer.update(helpers.loss_of(model), x, t)
    conv = helpers.block_named(optimizer, '/conv')
    bn = helpers.block_named(optimizer, '/bn')
    assert conv.refresh_count == {'A': 3, 'G': 4}       # A: 0,3,6  G: 0,2,4,6
    assert conv.inverse_count == {'A': 3, 'G': 4}
    assert bn.refresh_count == {'F': 2}                 # F: 0,4
    assert bn.inverse_count == {'F': 2}
    # A of conv+fc on 3 steps; G of conv+fc on 4 steps + F of bn on 2.
    assert captured == {'inputs': 2 * 3, 'gradients': 2 * 4 + 2}


def test_published_refresh_presets_follow_epoch():
    model = helpers.MLP()
    x, t = numpy.random.RandomState(0).randn(4, 5), \
        numpy.array([0, 1, 2, 0], numpy.int32)
    optimizer = helpers.kfac(refresh_interval_a='eq22',
                             refresh_interval_g='eq22',
                             refresh_interval_f='eq22')
    optimizer.setup(model)
    optimizer.epoch = 7          # interval 6 (eq. 22)
    for _ in range(13):
        optimizer.update(helpers.loss_of(model), x, t)
    block = helpers.block_named(optimizer, '/l1')
    assert block.refresh_count['A'] == 3    # steps 0, 6, 12


def test_damping_warmup_follows_eq16():
    model = helpers.MLP()
    x, t = numpy.random.RandomState(0).randn(4, 5), \
        numpy.array([0, 1, 2, 0], numpy.int32)
    optimizer = helpers.kfac(damping=2.5e-2, damping_target=2.5e-4,
                             damping_warmup_steps=10)
    optimizer.setup(model)
    seen = []
    for _ in range(5):
        seen.append(optimizer.damping)
        optimizer.update(helpers.loss_of(model), x, t)
    alpha = 2 * math.log10(100) / 10
    expected, gamma = [], 2.5e-2
    for _ in range(5):
        expected.append(gamma)
        gamma = (1 - alpha) * gamma + alpha * 2.5e-4
    numpy.testing.assert_allclose(seen, expected, rtol=1e-12)


def test_a_warmup_upwards_is_refused_when_built():
    """γ_target > γ(0) (the paper's text says so, its eqs. 15-16 and its
    runs go down): α < 0 and γ ran away, −8e-4 after one step, −0.070
    after 11 (eq. 13 then pushed weights from 0), until the first refresh
    of a stale run raised a math domain error at step 20."""
    with pytest.raises(chainerkfac.optimizers.options.OptionError,
                       match=r"damping_target.*larger than damping=0.001"):
        helpers.kfac(damping=1e-3, damping_target=1e-2,
                     damping_warmup_steps=10)
    # equal: α = 0, γ stays
    optimizer = helpers.kfac(damping=1e-3, damping_target=1e-3,
                             damping_warmup_steps=10)
    model = helpers.MLP()
    optimizer.setup(model)
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    optimizer.update(helpers.loss_of(model), x, t)
    assert optimizer.damping == 1e-3


def train(model, optimizer, x, t, steps):
    for step in range(steps):
        rows = slice((2 * step) % 8, (2 * step) % 8 + 4)
        optimizer.update(helpers.loss_of(model), x[rows], t[rows])


def make_optimizer(fisher='emp'):
    return helpers.kfac(lr=0.05, momentum=0.9, damping=1e-2, fisher=fisher,
                        seed=3,
                        damping_target=1e-3, damping_warmup_steps=5,
                        refresh_interval_a=2, refresh_interval_g=3,
                        refresh_interval_f=2, weight_rescale=True,
                        factor_decay=0.5, fisher_diff=True)


@pytest.mark.parametrize('fisher', ['emp', 'mc'])
def test_snapshot_and_resume_continue_exactly(fisher):
    x, t = helpers.data(n=12)
    base = helpers.ConvNet(bn=True)
    straight = clone(base)
    optimizer = make_optimizer(fisher).setup(straight)
    train(straight, optimizer, x, t, 7)

    first = clone(base)
    optimizer = make_optimizer(fisher).setup(first)
    train(first, optimizer, x, t, 4)
    model_file, opt_file = io.BytesIO(), io.BytesIO()
    serializers.save_npz(model_file, first)
    serializers.save_npz(opt_file, optimizer)
    model_file.seek(0)
    opt_file.seek(0)

    resumed = helpers.ConvNet(bn=True)
    serializers.load_npz(model_file, resumed)
    optimizer = make_optimizer(fisher).setup(resumed)
    optimizer.label_sampler.sample(numpy.zeros((5, 3)))   # move its RNG: restored
    serializers.load_npz(opt_file, optimizer)
    assert optimizer.t == 4
    train_from = 4
    for step in range(train_from, 7):
        rows = slice((2 * step) % 8, (2 * step) % 8 + 4)
        optimizer.update(helpers.loss_of(resumed), x[rows], t[rows])
    for name, param in straight.namedparams():
        numpy.testing.assert_array_equal(
            param.array, dict(resumed.namedparams())[name].array, name)


def test_a_constant_damping_is_the_constructors_after_a_resume(caplog):
    """The damping is state where it follows its schedule (the resumed
    run goes on from the snapshot's, above); a constant damping is a
    hyperparameter, as lr is: the one passed to the resumed optimizer
    stays, with a warning naming both."""
    x, t = helpers.data(n=12)
    model = helpers.ConvNet(bn=True)
    optimizer = helpers.kfac(damping=1e-2).setup(model)
    train(model, optimizer, x, t, 2)
    saved = io.BytesIO()
    serializers.save_npz(saved, optimizer)
    for damping, warned in [(1e-2, False), (1e-1, True)]:
        saved.seek(0)
        caplog.clear()
        resumed = helpers.kfac(damping=damping).setup(clone(model))
        with caplog.at_level(logging.WARNING, logger='chainerkfac'):
            serializers.load_npz(saved, resumed)
        assert resumed.damping == damping
        assert ('taken at damping 0.01' in caplog.text) == warned
    saved.seek(0)
    scheduled = helpers.kfac(damping=1e-1, damping_target=1e-3,
                             damping_warmup_steps=5).setup(clone(model))
    serializers.load_npz(saved, scheduled)
    assert scheduled.damping == 1e-2        # the schedule's state


def test_non_pd_factor_raises_damping_and_is_reported(monkeypatch):
    model = helpers.MLP()
    x, t = numpy.random.RandomState(0).randn(4, 5), \
        numpy.array([0, 1, 2, 0], numpy.int32)
    optimizer = helpers.kfac(lr=0.1, damping=1e-4)
    optimizer.setup(model)
    block = helpers.block_named(optimizer, '/l1')
    helpers.replace_captured_a(monkeypatch, block,
                               lambda total: -numpy.eye(len(total)))  # not PD
    reporter, observation = chainer.Reporter(), {}
    with reporter.scope(observation):
        optimizer.update(helpers.loss_of(model), x, t)
    assert observation['kfac/inverse_retries'] > 0
    assert 'A' in block.inverses
    for _, param in model.namedparams():
        assert numpy.isfinite(param.array).all()


def test_nan_factor_keeps_weights_finite(monkeypatch):
    model = helpers.MLP()
    x, t = numpy.random.RandomState(0).randn(4, 5), \
        numpy.array([0, 1, 2, 0], numpy.int32)
    optimizer = helpers.kfac(lr=0.1)
    optimizer.setup(model)
    optimizer.update(helpers.loss_of(model), x, t)       # healthy step
    block = helpers.block_named(optimizer, '/l1')
    healthy_inverse = block.inverses['A'].copy()
    healthy_factor = block.factors['A'].copy()
    helpers.replace_captured_a(monkeypatch, block,
                               lambda total: total * numpy.nan)
    reporter, observation = chainer.Reporter(), {}
    with reporter.scope(observation):
        optimizer.update(helpers.loss_of(model), x, t)
    assert observation['kfac/inverse_retries'] > 0
    numpy.testing.assert_array_equal(block.inverses['A'], healthy_inverse)
    numpy.testing.assert_array_equal(block.factors['A'], healthy_factor)
    for _, param in model.namedparams():
        assert numpy.isfinite(param.array).all()


def test_a_factor_not_inverted_at_its_first_refresh_is_due_again(
        monkeypatch, caplog):
    """A factor whose first refresh cannot be inverted leaves its block
    without curvature: not counted as preconditioned, said so (no
    'previous factor kept'), and tried again at the next step, not 20
    steps later."""
    model = helpers.MLP()
    x, t = numpy.random.RandomState(0).randn(4, 5), \
        numpy.array([0, 1, 2, 0], numpy.int32)
    optimizer = helpers.kfac(lr=0.1, refresh_interval_a=20,
                             refresh_interval_g=20, refresh_interval_f=20)
    optimizer.setup(model)
    block = helpers.block_named(optimizer, '/l1')
    original = helpers.replace_captured_a(
        monkeypatch, block, lambda total: total * numpy.nan)
    observations = []
    for step in range(3):
        if step == 1:
            monkeypatch.setattr(block, 'captured', original)
        observation = {}
        with chainer.Reporter().scope(observation), \
                caplog.at_level(logging.WARNING, logger='chainerkfac'):
            optimizer.update(helpers.loss_of(model), x, t)
        observations.append(observation)
    failed = [r.getMessage() for r in caplog.records
              if 'could not be inverted' in r.getMessage()]
    assert len(failed) == 1
    assert 'no inverse yet' in failed[0] and 'previous' not in failed[0]
    assert 'due again at the next step' in failed[0]
    n_blocks = observations[2]['kfac/preconditioned_blocks']
    assert observations[0]['kfac/preconditioned_blocks'] == n_blocks - 1
    # refreshed at step 1 (A only), then stale like the others
    assert block.last_refresh == {'A': 1, 'G': 0}
    assert block.has_inverses()
    assert observations[1]['kfac/refresh_A'] == 1.0
    assert observations[2]['kfac/refresh_A'] == 0.0
    for _, param in model.namedparams():
        assert numpy.isfinite(param.array).all()


def test_nan_gradient_skips_the_update():
    model = helpers.MLP()
    x = numpy.random.RandomState(0).randn(4, 5)
    t = numpy.array([0, 1, 2, 0], numpy.int32)
    optimizer = helpers.kfac(lr=0.1)
    optimizer.setup(model)
    optimizer.update(helpers.loss_of(model), x, t)
    before = weights(model)
    x[0, 0] = numpy.nan
    reporter, observation = chainer.Reporter(), {}
    with reporter.scope(observation):
        optimizer.update(helpers.loss_of(model), x, t)
    assert observation['kfac/skipped_step'] == 1.0
    assert_same_weights(weights(model), before, rtol=0, atol=0)


def test_fisher_diff_is_eq21():
    model = helpers.MLP()
    rng = numpy.random.RandomState(0)
    optimizer = helpers.kfac(lr=0.05, fisher_diff=True)
    optimizer.setup(model)
    block = helpers.block_named(optimizer, '/l1')
    previous = None
    for step in range(3):
        x = rng.randn(4, 5)
        t = rng.randint(0, 3, 4).astype(numpy.int32)
        optimizer.update(helpers.loss_of(model), x, t)
        current = block.factors['G'].copy()
        if previous is not None:
            expected = numpy.linalg.norm(current - previous) / \
                numpy.linalg.norm(previous)
            assert optimizer.fisher_diffs[('/l1', 'G')] == pytest.approx(
                expected, rel=1e-10)
        previous = current


def test_factor_fp16_is_close_to_fp32():
    x, t = helpers.data(n=6)
    base = helpers.ConvNet()
    factors = {}
    for dtype in ('float32', 'float16'):
        model = clone(base)
        optimizer = helpers.kfac(lr=0.0, factor_dtype=dtype)
        optimizer.setup(model)
        optimizer.update(helpers.loss_of(model), x, t)
        factors[dtype] = helpers.block_named(optimizer, '/conv').factors
    for name in ('A', 'G'):
        ref = factors['float32'][name]
        err = numpy.abs(factors['float16'][name] - ref).max()
        assert 0 < err <= 2e-3 * numpy.abs(ref).max()


class _Geometries(chainer.Chain):
    """Stride-1 convolutions of several geometries (padding above and
    below half the kernel, dilation, a row kernel, a 5×5), then one of
    stride 2 (unfolded only), float64."""

    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.c1 = L.Convolution2D(2, 3, 3, pad=1)
            self.c2 = L.Convolution2D(3, 3, 3, pad=2, dilate=2, nobias=True)
            self.c3 = L.Convolution2D(3, 4, (1, 3), pad=(0, 2))
            self.c4 = L.Convolution2D(4, 3, 5, pad=1)
            self.c5 = L.Convolution2D(3, 3, 3, stride=2, pad=1)
            self.fc = L.Linear(None, 4)

    def forward(self, x):
        h = x
        for conv in (self.c1, self.c2, self.c3, self.c4, self.c5):
            h = F.tanh(conv(h))
        return self.fc(h)


def test_shifted_and_unfolded_a_train_alike():
    """Three K-FAC steps with every stride-1 convolution's A formed by
    shifted products and by the patch matrix give the same weights
    (float64: the two sum in other orders)."""
    x, t = helpers.data(n=5, shape=(2, 7, 6))
    base = _Geometries()
    base(x)
    weights = {}
    for strategy in ('shifted', 'unfolded'):
        model = clone(base)
        optimizer = helpers.kfac(lr=0.05, conv_a_strategy=strategy)
        optimizer.setup(model)
        for _ in range(3):
            optimizer.update(helpers.loss_of(model), x, t)
        weights[strategy] = {name: param.array.copy()
                             for name, param in model.namedparams()}
    start = dict(base.namedparams())
    for name, value in weights['shifted'].items():
        numpy.testing.assert_allclose(value, weights['unfolded'][name],
                                      rtol=1e-10, atol=1e-12, err_msg=name)
        assert not numpy.allclose(value, start[name].array), name


@pytest.mark.parametrize('kwargs,match', [
    (dict(damping=0.0), 'damping'),
    (dict(bn_fisher='block'), 'bn_fisher'),
    (dict(fisher='true'), 'fisher'),
    (dict(acc_iters=0), 'acc_iters'),
    (dict(factor_dtype='int8'), 'factor_dtype'),
    (dict(damping_target=1e-4), 'damping_warmup_steps'),
    (dict(refresh_interval_a='eq99'), 'eq99'),
    (dict(refresh_interval_g=0), 'refresh interval'),
    (dict(lr=float('inf')), 'lr=inf must be a finite'),
    (dict(damping=float('inf')), 'damping=inf must be a finite'),
    (dict(rho_bn=float('inf')), 'rho_bn=inf'),
    (dict(process_local='no'), "process_local='no' must be True or False"),
    (dict(fisher_diff='yes'), 'fisher_diff'),
    (dict(seed='abc'), "seed='abc' must be an int"),
    (dict(refresh_interval_f=lambda i: 3),
     r'refresh_interval_f: a callable must take \(iteration, epoch\)'),
])
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        chainerkfac.optimizers.KFAC(**kwargs)


@pytest.mark.parametrize('value', ['x', float('nan'), 0, 2.5, None, True])
def test_a_schedules_bad_interval_names_the_argument(value):
    """A callable's values are checked when used: 'x' failed in a
    comparison inside the step, NaN meant "never refresh again" and 0
    "every step", silently. Each step reads every interval when it
    decides what is due (the log shows the step's), the first at
    ``setup``: before any compute (it was at step 1's decision, after a
    step, when step 0's factors, due anyway, did not read them)."""
    model = helpers.MLP()
    optimizer = helpers.kfac(refresh_interval_g=lambda i, e: value)
    with pytest.raises(ValueError, match=r"refresh_interval_g: the schedule "
                       r"returned {} at iteration 0, epoch 0; a refresh "
                       r"interval is an int >= 1".format(
                           re.escape(repr(value)))):
        optimizer.setup(model)
    assert optimizer.t == 0


def test_numpy_ints_floats_and_bools_are_arguments_like_python_ones():
    """Values read from a NumPy array or a config parsed by NumPy."""
    model = helpers.MLP()
    optimizer = helpers.kfac(
        refresh_interval_a=numpy.int64(2), low_rank=numpy.bool_(True),
        verbose=numpy.bool_(False), weight_rescale=numpy.bool_(False),
        refresh_interval_g=lambda i, e: numpy.float64(2.0)).setup(model)
    assert optimizer.low_rank is True and optimizer.weight_rescale is False
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    for _ in range(3):
        optimizer.update(helpers.loss_of(model), x, t)
    assert optimizer.refresh_intervals['A'](5, 0) == 2
    assert optimizer.refresh_intervals['G'](5, 0) == 2


@pytest.mark.parametrize('fisher', ['mc', 'exact'])
def test_fisher_passes_without_lossfun_are_a_clear_error(fisher):
    model = helpers.MLP()
    optimizer = helpers.kfac(fisher=fisher).setup(model)
    x, t = helpers.data(n=4, shape=(5,), n_class=3)
    helpers.loss_of(model)(x, t).backward()
    with pytest.raises(TypeError, match=r"update\(lossfun.*fisher='emp'"):
        optimizer.update()


def test_registration_table_lists_every_layer(caplog):
    model = helpers.ConvNet(bn=True)
    with helpers.float64_links():
        model.add_link('embed', L.EmbedID(3, 2))
    caplog.set_level('INFO', logger='chainerkfac')
    optimizer = chainerkfac.optimizers.KFAC().setup(model)
    assert caplog.text == ''   # logged at the first update
    x, t = helpers.data(n=4)
    optimizer.update(helpers.loss_of(model), x, t)
    out = caplog.text
    assert '/conv' in out and 'Conv2D (K-FAC)' in out and 'A 19x19, G 3x3' \
        in out
    assert 'BN (full Fisher)' in out and 'F 6x6' in out
    assert '/embed' in out and 'plain gradient' in out and \
        'no Fisher block for EmbedID' in out
    assert '3 K-FAC layers, 1 with the plain gradient' in out
    # conv feeds BN: scale invariant, rescaled; the classifier is not.
    rows = {line.split()[0]: line for line in out.splitlines()
            if line.startswith('/')}
    assert '  yes' in rows['/conv'] and '  no' in rows['/fc']


def test_schedules_are_the_papers_equations():
    assert equations.damping_warmup_rate(2.5e-2, 2.5e-4, 313) == \
        pytest.approx(2 * math.log10(100) / 313)
    assert equations.damping_warmup_rate(1e-1, 1e-4, 2) == 1.0  # clipped
    assert equations.polynomial_lr(0.5, 8.18e-3, 11.0, 1, 53) == 8.18e-3
    assert equations.polynomial_lr(27, 8.18e-3, 11.0, 1, 53) == \
        pytest.approx(8.18e-3 * 0.5 ** 11)
    assert equations.polynomial_lr(53, 8.18e-3, 11.0, 1, 53) == 0.0
    assert equations.coupled_momentum(4e-3, 8e-3, 0.997) == 0.997 / 2
    assert [equations.stale_interval_eq22(0, e) for e in
            (0, 4, 5, 9, 10, 15, 20, 40)] == [1, 1, 6, 6, 11, 16, 20, 20]
    assert [equations.stale_interval_eq23(0, e) for e in (0, 12, 13, 30)] \
        == [1, 1, 20, 20]


# -- snapshots through Chainer's Trainer, as users take them ----------------
class LazyHeadNet(chainer.Chain):
    """Lazily sized links (``Linear(None, …)``: no shape until the first
    forward), a head computed but left out of the loss, and one never
    called: their parameters get no gradient."""

    def __init__(self, seed=0):
        super().__init__()
        state = numpy.random.get_state()
        numpy.random.seed(seed)
        with helpers.float64_links(), self.init_scope():
            self.conv = L.Convolution2D(None, 3, 3, pad=1)
            self.bn = L.BatchNormalization(3)
            self.fc = L.Linear(None, 4)
            self.aux = L.Linear(None, 4)
            self.unused = L.Linear(6, 2)
        numpy.random.set_state(state)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        self.aux_out = self.aux(h)
        return self.fc(h)


def _trainer(model, optimizer_options, x, t, iterations, out):
    from chainer import training
    dataset = chainer.datasets.TupleDataset(x, t)
    iterator = chainer.iterators.SerialIterator(dataset, 4, shuffle=False)
    optimizer = helpers.kfac(**optimizer_options)
    optimizer.setup(L.Classifier(model))
    updater = training.updaters.StandardUpdater(iterator, optimizer)
    return training.Trainer(updater, (iterations, 'iteration'),
                            out=str(out))


@pytest.mark.parametrize('low_rank', [False, True])
def test_trainer_snapshot_resumes_into_a_fresh_lazy_model(low_rank, tmp_path):
    """A Trainer snapshot (Chainer's updater loads the optimizer before the
    model) into a freshly built model whose links are lazily sized and
    whose head got no gradient: it loads (strictly) and continues exactly
    as the uninterrupted run. Before, the factors' loading read the shapes
    of links that had none yet (``AttributeError``), and the head's rules,
    never run, had no velocity in the file (``KeyError: …/aux/W/v``)."""
    x, t = helpers.data(n=16, shape=(2, 4, 4))
    options = dict(lr=0.05, momentum=0.9, damping=1e-2,
                   refresh_interval_a=2, refresh_interval_g=3,
                   low_rank=low_rank)
    straight = _trainer(LazyHeadNet(), options, x, t, 7, tmp_path)
    numpy.random.seed(1)    # the lazy links' values, at the first forward
    straight.run()

    first = _trainer(LazyHeadNet(), options, x, t, 4, tmp_path)
    numpy.random.seed(1)
    first.run()
    kfac_first = first.updater.get_optimizer('main')
    if low_rank:
        assert any(isinstance(f, chainerkfac.low_rank.LowRank)
                   for b in kfac_first.blocks for f in b.factors.values())
    snapshot = io.BytesIO()
    serializers.save_npz(snapshot, first)
    snapshot.seek(0)

    fresh = LazyHeadNet()
    assert fresh.fc.W.array is None     # no shape before the first forward
    resumed = _trainer(fresh, options, x, t, 7, tmp_path)
    serializers.load_npz(snapshot, resumed)     # strict
    assert resumed.updater.iteration == 4
    resumed.run()
    mine = dict(resumed.updater.get_optimizer('main').target.namedparams())
    for name, param in straight.updater.get_optimizer(
            'main').target.namedparams():
        numpy.testing.assert_array_equal(param.array, mine[name].array,
                                         err_msg=name)
    aux = resumed.updater.get_optimizer('main').target.predictor.aux
    numpy.testing.assert_array_equal(aux.W.update_rule.state['v'], 0)


def test_never_updated_float16_parameters_save_an_fp32_velocity():
    """Under ``use_fp32_update()`` the velocity given before saving to a
    parameter that never had a gradient is that of its float32 master, as
    Chainer's update makes it; the state loads (strictly)."""
    class Net(chainer.Chain):
        def __init__(self):
            super().__init__()
            with chainer.using_config('dtype', numpy.float16), \
                    self.init_scope():
                self.l1 = L.Linear(5, 4)
                self.l2 = L.Linear(4, 3)
                self.head = L.Linear(4, 2)

        def forward(self, x):
            return self.l2(F.tanh(self.l1(x)))

    x, t = helpers.data(n=6, shape=(5,), n_class=3)
    model = Net()
    optimizer = helpers.kfac(lr=0.05, momentum=0.9).setup(model)
    optimizer.use_fp32_update()
    for _ in range(2):
        optimizer.update(helpers.loss_of(model), x.astype(numpy.float16), t)
    saved = io.BytesIO()
    serializers.save_npz(saved, optimizer)
    for link in (model.l1, model.head):
        assert link.W.update_rule.state['v'].dtype == numpy.float32
    saved.seek(0)
    fresh = Net()
    loaded = helpers.kfac(lr=0.05, momentum=0.9).setup(fresh)
    loaded.use_fp32_update()
    serializers.load_npz(saved, loaded)
    assert loaded.t == 2


def test_unequal_intervals_split_the_damping_of_the_refreshed_factor():
    """A refreshed every 2 steps, G every 3: a step that refreshes A only
    inverts A, with π of A now and G as stored; G keeps its own share
    (docs/kfac.md, "Unequal intervals")."""
    model = helpers.MLP()
    optimizer = helpers.kfac(refresh_interval_a=2, refresh_interval_g=3,
                             damping=1e-2).setup(model)
    shares = []
    for step in range(5):
        x, t = helpers.data(n=4, shape=(5,), n_class=3, seed=step)
        optimizer.update(helpers.loss_of(model), x, t)
        block = helpers.block_named(optimizer, '/l1')
        shares.append(dict(block.inverse_damping))
        if step == 2:       # A refreshed (0, 2, 4), G not (0, 3)
            a, g = (helpers.dense(block.factors[k]) for k in 'AG')
            pi = math.sqrt((numpy.trace(a) / len(a)) /
                           (numpy.trace(g) / len(g)))
            assert block.inverse_damping['A'] == pytest.approx(
                pi * math.sqrt(1e-2), rel=1e-12)
    assert shares[2]['G'] == shares[1]['G'] == shares[0]['G']
    assert shares[2]['A'] != shares[0]['A']
    assert shares[0]['A'] * shares[0]['G'] == pytest.approx(1e-2, rel=1e-12)


@pytest.mark.parametrize('fisher', ['emp', 'mc', 'exact'])
@pytest.mark.parametrize('manual', [False, True])
def test_loss_scaling_takes_the_unscaled_step(fisher, manual, monkeypatch):
    """Chainer's loss scaling (``loss_scaling(scale=S)``, or a backward
    from ``loss_scale=S`` by hand): the backward starts from S and the step
    is the unscaled one. K-FAC ignored the scale with ``update(lossfun)``
    (float16 lost its protection) and, by hand, preconditioned S-times
    gradients with S²-times G factors (a step of about 1/S)."""
    if manual and fisher != 'emp':
        return              # their passes need update(lossfun)
    started = []
    backward = chainer.Variable.backward

    def recording(self, *args, **kwargs):
        started.append(kwargs.get('loss_scale'))
        return backward(self, *args, **kwargs)
    monkeypatch.setattr(chainer.Variable, 'backward', recording)
    x, t = helpers.data(n=6)
    weights = {}
    for scale in (None, 8.0):
        numpy.random.seed(0)
        model = helpers.ConvNet(bn=True)
        optimizer = helpers.kfac(lr=0.1, fisher=fisher, seed=1,
                                 refresh_interval_a=2).setup(model)
        if scale is not None:
            optimizer.loss_scaling(scale=scale)
        for _ in range(3):
            if manual:
                model.cleargrads()
                helpers.loss_of(model)(x, t).backward(
                    loss_scale=optimizer._loss_scale)
                optimizer.update()
            else:
                optimizer.update(helpers.loss_of(model), x, t)
        weights[scale] = {n: p.array.copy() for n, p in model.namedparams()}
    assert started == [None] * 3 + [8.0] * 3
    for name, value in weights[None].items():
        numpy.testing.assert_allclose(weights[8.0][name], value, rtol=1e-12,
                                      atol=1e-14, err_msg=name)


def test_dynamic_loss_scaling_adapts_to_the_steps():
    """The scale grows while steps are finite and halves at a skipped
    (overflowing) one, as with Chainer's optimizers; it stayed at 1."""
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    optimizer = helpers.kfac(lr=0.01).setup(model)
    optimizer.loss_scaling(interval=1000)
    x, t = helpers.data(n=6)
    scales = []
    for step in range(4):
        optimizer.update(helpers.loss_of(model), x, t)
        scales.append(optimizer._loss_scale)
    assert scales == [2.0, 4.0, 8.0, 16.0]
    before = {n: p.array.copy() for n, p in model.namedparams()}
    optimizer._loss_scale = float('inf')           # the backward overflows
    optimizer.update(helpers.loss_of(model), x, t)
    assert optimizer.last_step_skipped
    assert optimizer._loss_scale == 65504       # halved, Chainer's cap
    for name, param in model.namedparams():
        numpy.testing.assert_array_equal(param.array, before[name])


def test_a_summed_loss_takes_its_batch_from_the_pass_that_counts():
    """loss_reduction='sum' learns the batch from the first backward pass
    of the micro-batch: a pass on 4 other samples, then cleargrads and the
    real pass on 8, scaled the step by 1/4 (0.04 off in 3 steps)."""
    x, t = helpers.data(n=12, shape=(5,), n_class=3)

    def run(extra):
        numpy.random.seed(0)
        model = helpers.MLP()
        optimizer = helpers.kfac(lr=0.05, loss_reduction='sum',
                                 refresh_interval_a=2).setup(model)
        for _ in range(3):
            if extra:
                model.cleargrads()
                F.sum(F.softmax_cross_entropy(model(x[8:]), t[8:],
                                              reduce='no')).backward()
            model.cleargrads()
            F.sum(F.softmax_cross_entropy(model(x[:8]), t[:8],
                                          reduce='no')).backward()
            optimizer.update()
        return {n: p.array.copy() for n, p in model.namedparams()}
    plain, extra = run(False), run(True)
    for name, value in plain.items():
        numpy.testing.assert_array_equal(extra[name], value, err_msg=name)


def test_a_one_process_shard_update_snapshot_loads_strictly(tmp_path):
    """``shard_update=True`` on one process holds every velocity in its
    file: a file without one is refused (as without sharding), not loaded
    with the velocity lost and a warning at the next step (the sharded
    files' leniency, for several processes only, had been chosen on the
    flag alone)."""
    x, t = helpers.data(n=8, shape=(5,), n_class=3)
    for shard_update in (False, True):
        numpy.random.seed(0)
        model = helpers.MLP()
        optimizer = helpers.kfac(lr=0.05, momentum=0.9,
                                 shard_update=shard_update).setup(model)
        for _ in range(2):
            optimizer.update(helpers.loss_of(model), x, t)
        path = str(tmp_path / 'optimizer.npz')
        serializers.save_npz(path, optimizer)
        with numpy.load(path) as saved:
            arrays = {k: saved[k] for k in saved.files if k != 'l1/W/v'}
        assert len(arrays) < len(saved.files)
        numpy.savez(path, **arrays)
        again = helpers.kfac(lr=0.05, momentum=0.9,
                             shard_update=shard_update).setup(helpers.MLP())
        with pytest.raises(KeyError, match='l1/W/v'):
            serializers.load_npz(path, again)


def test_skip_layers_none_and_a_dtype_for_precondition_dtype():
    """``skip_layers=None`` (the obvious "skip nothing") raised "'NoneType'
    object is not iterable"; ``precondition_dtype=numpy.float32`` was
    refused with "must be one of ('float32', 'tf32')" where
    ``factor_dtype`` takes a dtype."""
    optimizer = helpers.kfac(skip_layers=None,
                             precondition_dtype=numpy.float32)
    optimizer.setup(helpers.MLP())
    assert optimizer.skip_layers == ()
    assert optimizer.precondition_dtype == 'float32'
    with pytest.raises(TypeError, match=r'skip_layers takes .* got 3'):
        helpers.kfac(skip_layers=3)
    with pytest.raises(ValueError, match='precondition_dtype'):
        helpers.kfac(precondition_dtype=numpy.float16)

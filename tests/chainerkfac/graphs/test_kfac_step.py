"""K-FAC and GuardedOptimizer through StepGraph (chainerkfac.graphs.graphed)
on a CPU, against a CuPy stand-in whose graphs replay the real NumPy step
with its host effects undone (tests/chainerkfac/graphs/replay_fake.py):
which steps run eagerly, are captured or replayed over a mixed
refresh/stale schedule; the same weights, velocities, statistics, host
state and reports as the eager run, to the bit (the same operations in the
same order), with the learning rate and the damping moving every step and
no new capture for it; a non-finite replayed step undone on the device;
nothing read on the host while capturing; a failed capture undone; the
refusals. The CUDA run is tests/gpu/test_kfac_graphs_gpu.py."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import contextlib

import types

import numpy
import pytest

import chainer
import chainer.functions as F

from chainerkfac import fused
from chainerkfac import low_rank
from chainerkfac import graphs
from chainerkfac.device_guard import DeviceStepGuard
from chainerkfac.optimizers import GuardedOptimizer
from chainerkfac.step_bound import StepBound
from chainerkfac.step_guard import StepGuard
from tests.chainerkfac import helpers
from tests.chainerkfac.graphs.replay_fake import (
    ReplayCupy, device_arrays_of, watched_of)


def _lossfun(model):
    def lossfun(x, t):
        loss = F.softmax_cross_entropy(model(x), t)
        chainer.reporter.report({'loss': loss})
        return loss
    return lossfun


def _batches(n_steps, n=6, nan_at=()):
    rng = numpy.random.RandomState(3)
    out = []
    for step in range(n_steps):
        x = rng.randn(n, 2, 5, 5)
        if step in nan_at:
            x[0, 0, 0, 0] = numpy.nan
        out.append((x, rng.randint(0, 4, n).astype(numpy.int32)))
    return out


def _kfac(model, interval=4, kl_clip=None):
    return helpers.kfac(lr=0.05, momentum=0.9, damping=1e-1,
                        damping_target=1e-2, damping_warmup_steps=6,
                        refresh_interval_a=interval,
                        refresh_interval_g=interval,
                        refresh_interval_f=interval,
                        weight_rescale=True, kl_clip=kl_clip).setup(model)


def _decayed(model):
    """K-FAC averaging its factors over refreshes (``factor_decay``): a
    low-rank factor's rank adds up at each refresh until it goes dense,
    so its inverse's arrays change shape."""
    return helpers.kfac(lr=0.05, momentum=0.9, damping=1e-1,
                        refresh_interval_a=4, refresh_interval_g=4,
                        refresh_interval_f=4, factor_decay=0.5,
                        weight_rescale=True).setup(model)


def _bounded(model):
    """K-FAC with its default bounded step, at a bound that acts here."""
    return _kfac(model, kl_clip=1e-5)


def _own_lr(model):
    """The bounded K-FAC with the classifier's layer at a learning rate of
    its own (a graph gave it the optimizer's)."""
    optimizer = _bounded(model)
    for param in model.fc.params():
        param.update_rule.hyperparam.lr = 0.2
    return optimizer


def _guarded(model):
    sgd = chainer.optimizers.MomentumSGD(lr=0.1, momentum=0.9)
    optimizer = GuardedOptimizer(sgd).setup(model)
    optimizer.add_hook(chainer.optimizer_hooks.WeightDecay(1e-3))
    return optimizer


def _run(make, batches, graphed, lr_of=lambda step: 0.05 / (1 + step),
         refresh_steps=False, between=None, network=helpers.ConvNet):
    """Train a fresh ``network`` (a ConvNet) on ``batches``; returns the
    state, the observations, the modes and the fake. ``between(step,
    model)`` runs before each step."""
    numpy.random.seed(0)
    model = network(bn=True)
    optimizer = make(model)
    fake = None
    if graphed:
        fake = ReplayCupy(lambda: device_arrays_of(inner, model),
                          watched=lambda: watched_of(inner, model))
        inner = optimizer
        optimizer = graphs.graphed(optimizer, warmup=1, cupy=fake,
                                   route_linear=contextlib.nullcontext,
                                   refresh_steps=refresh_steps)
    lossfun = _lossfun(model)
    observations, modes = [], []
    for step, (x, t) in enumerate(batches):
        if between is not None:
            between(step, model)
        optimizer.lr = lr_of(step)
        observation = {}
        if fake is not None:
            x, t = fake.asarray(x), fake.asarray(t)
        with chainer.reporter.Reporter().scope(observation):
            modes.append(optimizer.update(lossfun, x, t))
        if fake is not None:
            fake.step_graph = optimizer.graph
        observations.append({
            k: float(v.array if isinstance(v, chainer.Variable) else v)
            for k, v in observation.items()})
    state = {n: p.array.copy() for n, p in model.namedparams()}
    for name, param in model.namedparams():
        if param.update_rule.state is not None:     # None: never updated
            state[name + '/v'] = param.update_rule.state['v'].copy()
        state[name + '/t'] = param.update_rule.t
    state['avg_mean'] = model.bn.avg_mean.copy()
    state['avg_var'] = model.bn.avg_var.copy()
    state['t'] = optimizer.t
    state['damping'] = getattr(optimizer, 'damping', None)
    return state, observations, modes, (fake, optimizer)


def _record_fakes(monkeypatch, cls, fakes):
    """Append each stand-in of ``cls`` made from now on to ``fakes``."""
    original = cls.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        fakes.append(self)
    monkeypatch.setattr(cls, '__init__', recording)


def _kept(model):
    """The weights, velocities and BN mean of ``model``, copied."""
    return ({n: p.array.copy() for n, p in model.namedparams()},
            {n: p.update_rule.state['v'].copy()
             for n, p in model.namedparams()},
            model.bn.avg_mean.copy())


def _assert_kept(model, kept):
    """``model`` as :func:`_kept` copied it (a skipped step)."""
    weights, velocity, mean = kept
    for name, param in model.namedparams():
        numpy.testing.assert_array_equal(param.array, weights[name])
        numpy.testing.assert_array_equal(param.update_rule.state['v'],
                                         velocity[name])
    numpy.testing.assert_array_equal(model.bn.avg_mean, mean)


def _assert_same_state(a, b):
    assert sorted(a) == sorted(b)
    for key in a:
        numpy.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize('make', [_kfac, _bounded, _own_lr],
                         ids=['kfac', 'kfac-bounded', 'kfac-own-lr'])
def test_kfac_mixed_schedule_replays_stale_steps_as_eager(make):
    batches = _batches(13)
    eager, eager_obs, _, _ = _run(make, batches, graphed=False)
    state, obs, modes, (fake, optimizer) = _run(make, batches,
                                                graphed=True)
    if make is not _kfac:
        # ν computed on the device in the graphed run, on the host in the
        # eager one: the same to the bit (the same additions in the same
        # order, on Python 3.11 and 3.12), and the bound acted
        scales = [o['kfac/step_scale'] for o in eager_obs]
        assert min(scales) < 0.5, scales
        assert [o['kfac/step_scale'] for o in obs] == scales
    # refresh steps (t = 0, 4, 8, 12) eager; the first stale step of the
    # run warms up, the next is captured; the graph is kept through each
    # later refresh (its inverses go where the graph reads them), so every
    # other stale step is replayed
    assert modes == ['eager', 'eager', 'captured', 'replayed', 'eager',
                     'replayed', 'replayed', 'replayed', 'eager',
                     'replayed', 'replayed', 'replayed', 'eager']
    stats = optimizer.stats
    assert stats['eager: a refresh step (factors due)'] == 3
    assert stats['eager: the first step (it sets up the transport and '
                 'eq. 20)'] == 1
    assert stats['kept through: a refresh step (factors due)'] == 3
    assert not [k for k in stats if k.startswith('dropped')], stats
    assert fake.captures == 1
    _assert_same_state(eager, state)
    numpy.testing.assert_equal(obs, eager_obs)   # NaN == NaN
    assert isinstance(optimizer.optimizer.guard, DeviceStepGuard)


def test_kfac_non_finite_replayed_step_is_undone_on_the_device():
    batches = _batches(8, nan_at=(6,))
    _, _, modes, (fake, optimizer) = _run(_kfac, batches[:6], graphed=True)
    assert modes[-2:] == ['eager', 'replayed']   # kept through a refresh
    model = optimizer.target
    kept = _kept(model)
    x, t = (fake.asarray(a) for a in batches[6])
    observation = {}
    with chainer.reporter.Reporter().scope(observation):
        assert optimizer.update(optimizer._lossfun, x, t) == 'replayed'
    assert optimizer.last_step_skipped
    assert observation['kfac/skipped_step'] == 1.0
    _assert_kept(model, kept)
    x, t = (fake.asarray(a) for a in batches[7])
    assert optimizer.update(optimizer._lossfun, x, t) == 'replayed'
    assert not optimizer.last_step_skipped
    assert optimizer.guard.skipped_steps == 1


def test_nothing_is_read_on_the_host_while_capturing(monkeypatch):
    fakes = []
    real_skipped = DeviceStepGuard.skipped

    def forbidden(what):
        def check(*args, **kwargs):
            if fakes and fakes[0].capturing is not None:
                pytest.fail('{} read on the host during capture'.format(
                    what))
        return check

    def skipped(guard):
        forbidden('DeviceStepGuard.skipped')()
        return real_skipped.fget(guard)
    monkeypatch.setattr(DeviceStepGuard, 'skipped', property(skipped))
    all_finite = fused.all_finite
    monkeypatch.setattr(fused, 'all_finite', lambda arrays: (
        forbidden('fused.all_finite')(), all_finite(arrays))[1])
    apply = StepBound.apply     # ν on the host: float() of the terms
    monkeypatch.setattr(StepBound, 'apply', lambda self, *args: (
        forbidden('StepBound.apply')(), apply(self, *args))[1])
    real_check = DeviceStepGuard.check

    def check(guard, *args, **kwargs):
        finite = real_check(guard, *args, **kwargs)
        if not guard._open:     # it read the flag to decide (a rule
            forbidden('the guard deciding')()   # without state: a head)
        return finite
    monkeypatch.setattr(DeviceStepGuard, 'check', check)
    _record_fakes(monkeypatch, ReplayCupy, fakes)
    for make, network, refresh_steps in [
            (_kfac, helpers.ConvNet, False),
            (_bounded, helpers.ConvNet, False),
            (_guarded, helpers.ConvNet, False),
            (_kfac, _WithUnusedHead, False), (_every, _WithUnusedHead, True)]:
        fakes.clear()
        _, _, modes, (_, optimizer) = _run(
            make, _batches(6), graphed=True, network=network,
            refresh_steps=refresh_steps)
        if refresh_steps:
            assert optimizer.stats[_UPDATE + 'replayed'] >= 2
        else:
            assert 'captured' in modes and 'replayed' in modes


def test_guarded_optimizer_lr_schedule_needs_no_new_capture():
    batches = _batches(10, nan_at=(7,))
    eager, eager_obs, _, _ = _run(_guarded, batches, graphed=False,
                                  lr_of=lambda step: 0.1 * 0.8 ** step)
    state, obs, modes, (fake, optimizer) = _run(
        _guarded, batches, graphed=True,
        lr_of=lambda step: 0.1 * 0.8 ** step)
    # the first step (the warm-up) decides on the host (no velocities
    # yet), then one capture for every learning rate
    assert modes == ['eager', 'captured'] + ['replayed'] * 8
    assert fake.captures == 1
    assert obs[7]['skipped_step'] == 1.0 and eager_obs[7][
        'skipped_step'] == 1.0
    # the host guard does not count the skipped step in t, the device
    # guard cannot know it without reading its flag
    assert (eager.pop('t'), state.pop('t')) == (9, 10)
    for key in [k for k in eager if k.endswith('/t')]:
        assert (eager.pop(key), state.pop(key)) == (9, 10)
    _assert_same_state(eager, state)
    numpy.testing.assert_equal(obs, eager_obs)   # NaN == NaN


class _Refusing(ReplayCupy):
    """CUDA ends every capture with an error (a forbidden call
    invalidated it)."""

    def __init__(self, device_arrays, **kwargs):
        super().__init__(device_arrays, **kwargs)

        class Failing(self.cuda.Stream):
            def end_capture(self):
                super().end_capture()
                raise RuntimeError('cudaErrorStreamCaptureInvalidated')
        self.cuda.Stream = Failing


def test_failed_capture_is_undone_and_runs_eagerly(monkeypatch):
    # CUDA ends the capture with an error (a forbidden call invalidated
    # it): the step's host effects are undone and it runs eagerly.
    batches = _batches(9)
    eager, eager_obs, _, _ = _run(_kfac, batches, graphed=False)
    monkeypatch.setitem(globals(), 'ReplayCupy', _Refusing)
    state, obs, modes, (_, optimizer) = _run(_kfac, batches, graphed=True)
    assert modes == ['eager'] * 9
    assert optimizer.stats['capture failed'] == 1
    assert optimizer.stats['eager: its capture failed before'] == 4
    _assert_same_state(eager, state)
    numpy.testing.assert_equal(obs, eager_obs)


class _Transport:
    size = 2


@pytest.mark.parametrize('change, reason', [
    (lambda o: setattr(o, 'transport', _Transport()), 'on 2 processes'),
    (lambda o: setattr(o, 'synchronize_stage_timers', True),
     'stage timers'),
    (lambda o: o.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4)),
     'WeightDecay'),
    (lambda o: setattr(o, 'guard', StepGuard()), 'checkpoint'),
    (lambda o: o.loss_scaling(), 'loss scaling'),
])
def test_kfac_refusals(change, reason):
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    optimizer = _kfac(model)
    x, t = _batches(1)[0]
    optimizer.update(_lossfun(model), x, t)
    adapter = graphs.graphed(optimizer, cupy=ReplayCupy(list)).adapter
    adapter.before_step()
    assert adapter.refusal() is None
    change(optimizer)
    assert reason in adapter.refusal()
    for kwargs, text in (({'acc_iters': 2}, 'acc_iters=2'),
                         ({'loss_reduction': 'sum'}, "'sum'")):
        numpy.random.seed(0)
        model = helpers.ConvNet(bn=True)
        optimizer = helpers.kfac(**kwargs).setup(model)

        def summed(x, t, model=model):
            return F.sum(F.softmax_cross_entropy(model(x), t, reduce='no'))
        loss = summed if 'loss_reduction' in kwargs else _lossfun(model)
        for _ in range(kwargs.get('acc_iters', 1)):
            optimizer.update(loss, x, t)
        adapter = graphs.graphed(optimizer, cupy=ReplayCupy(list)).adapter
        adapter.before_step()
        assert text in adapter.refusal()


def test_graphed_checks_what_it_is_given():
    with pytest.raises(TypeError, match='graphed takes'):
        graphs.graphed(object())
    with pytest.raises(ValueError, match='setup'):
        graphs.graphed(chainer.optimizers.MomentumSGD())
    model = helpers.ConvNet(bn=True)
    optimizer = GuardedOptimizer(
        chainer.optimizers.MomentumSGD(),
        comm=types.SimpleNamespace(rank=0, size=2)).setup(model)
    adapter = graphs.graphed(optimizer, cupy=ReplayCupy(list)).adapter
    assert 'communicator' in adapter.refusal()


@pytest.mark.parametrize('make', [_kfac, _bounded],
                         ids=['kfac', 'kfac-bounded'])
def test_refilled_inverses_take_the_same_steps_in_the_same_arrays(make):
    """``refill_inverses`` (set by the graphed run) writes each refreshed
    inverse into its predecessor's arrays: the steps are those of the
    optimizer that makes new ones, to the bit (the same values in the
    same layout), and after the first refresh the inverses' arrays
    (dense, diagonal and Woodbury, with 1/γ as the damping schedule moves
    it) never move: what lets a captured stale step go on through a
    refresh."""
    from chainerkfac.graphs import step as graphs_step
    batches = _batches(13)
    runs = []
    for refill in (False, True):
        numpy.random.seed(0)
        model = helpers.ConvNet(bn=True)
        optimizer = make(model)
        optimizer.refill_inverses = refill
        lossfun = _lossfun(model)
        signatures = []
        for x, t in batches:
            optimizer.update(lossfun, x, t)
            signatures.append(graphs_step.buffer_signature(
                optimizer.inverse_buffers()))
        runs.append((model, optimizer, signatures))
    (plain, plain_opt, moved), (model, optimizer, kept) = runs
    for (name, a), (_, b) in zip(sorted(plain.namedparams()),
                                 sorted(model.namedparams())):
        numpy.testing.assert_array_equal(a.array, b.array, err_msg=name)
        numpy.testing.assert_array_equal(a.update_rule.state['v'],
                                         b.update_rule.state['v'])
    assert optimizer.damping == plain_opt.damping
    woodbury = [(b, n) for b in optimizer.blocks
                for n, inv in b.inverses.items()
                if isinstance(inv, low_rank.WoodburyInverse)]
    assert woodbury
    for block, name in woodbury:
        # one d × k array for the factor and its refilled inverse
        assert block.factors[name].columns is block.inverses[name].columns
    assert len(set(kept)) == 1 and kept[0]
    assert len(set(moved)) > 1       # new arrays at every refresh


def test_a_refresh_that_moves_a_buffer_drops_the_graph():
    """Where a refresh cannot take its inverse in place (a low-rank
    factor's rank grew), the graph is dropped and the next stale step
    captured again; the run is the eager one to the bit, and a refresh
    whose inverses all fit keeps the graph."""
    batches = _batches(17)
    eager, eager_obs, _, _ = _run(_decayed, batches, graphed=False)
    state, obs, modes, (fake, optimizer) = _run(_decayed, batches,
                                                graphed=True)
    stats = optimizer.stats
    moved = 'dropped: an eager step moved its buffers ({})'.format(
        'a refresh step (factors due)')
    assert stats[moved] >= 1, dict(stats)
    assert stats['captured'] == 1 + stats[moved]
    assert stats['kept through: a refresh step (factors due)'] >= 1
    assert stats[moved] + stats[
        'kept through: a refresh step (factors due)'] == 4   # t = 4 ... 16
    _assert_same_state(eager, state)
    numpy.testing.assert_equal(obs, eager_obs)


# -- the refresh steps' passes replayed (graphed(refresh_steps=True)) -----

_PASSES = 'refresh passes: '
_UPDATE = 'refresh update: '


def _passes_as_eager(make, batches, **kwargs):
    """The graphed run with the refresh passes replayed and the eager run:
    the same state and reports to the bit. Returns the graphed run's
    modes, fake and optimizer."""
    eager, eager_obs, _, _ = _run(make, batches, graphed=False, **kwargs)
    state, obs, modes, (fake, optimizer) = _run(
        make, batches, graphed=True, refresh_steps=True, **kwargs)
    _assert_same_state(eager, state)
    numpy.testing.assert_equal(obs, eager_obs)   # NaN == NaN
    return modes, fake, optimizer


def _every(model):
    """K-FAC refreshing every factor at every step (the paper's every-step
    K-FAC): no stale step, so only the passes can be replayed."""
    return _kfac(model, interval=1)


def _every_decayed(model):
    """Every step, factors averaged over refreshes (the previous factor
    is read at each refresh) and low-rank factors whose rank grows."""
    return helpers.kfac(lr=0.05, momentum=0.9, damping=1e-1,
                        factor_decay=0.5, weight_rescale=True).setup(model)


@pytest.mark.parametrize('make', [_every, _every_decayed, _bounded],
                         ids=['every', 'every-decayed', 'bounded'])
def test_refresh_steps_replayed_every_step_as_eager(make):
    """Every step refreshes: the stale graph never runs; from the third
    refresh on the forward and backward passes are replayed, from the
    fourth the step's end after its eager inverses (stage 5, the update)
    too; the same weights, velocities, statistics, host state and reports
    as the eager run, to the bit."""
    batches = _batches(9)
    make = {_bounded: lambda m: _kfac(m, interval=1, kl_clip=1e-5)}.get(
        make, make)
    modes, fake, optimizer = _passes_as_eager(make, batches)
    assert modes == ['eager'] * 9
    stats = optimizer.stats
    # the first step plain; the passes' first refresh warms up, the next
    # is captured, then replayed
    assert stats[_PASSES + 'eager'] == 1
    assert stats[_PASSES + 'captured'] == 1
    assert stats[_PASSES + 'replayed'] == 6
    # the end of the step: from the passes' capture on (their gradients
    # where a graph wrote them)
    assert stats[_UPDATE + 'eager'] == 1
    assert stats[_UPDATE + 'captured'] == 1
    assert stats[_UPDATE + 'replayed'] == 5
    assert stats['eager: a refresh step (factors due)'] == 8
    assert not [k for k in stats if 'dropped' in k or 'failed' in k], stats
    assert fake.captures == 2
    # what each refresh step stored is its own: a later replay of the
    # passes rewrites the captured sums, not a factor
    passes, = [g.adapter for g in optimizer.adapter.passes_graphs.values()]
    captured = {id(a) for a in passes.captured_arrays()}
    for block in optimizer.optimizer.blocks:
        for factor in block.factors.values():
            assert id(getattr(factor, 'columns', factor)) not in captured


def test_a_non_finite_replayed_refresh_is_undone_on_the_device():
    """A refresh step whose passes and end are replayed, on a batch with
    a NaN: the device guard flags it and its checkpoint puts the weights,
    velocities and statistics back (the replayed end leaves the guard's
    step open for it, as the eager check does); the next step goes on."""
    batches = _batches(9, nan_at=(7,))
    _, _, modes, (fake, optimizer) = _run(_every, batches[:7], graphed=True,
                                          refresh_steps=True)
    assert optimizer.stats[_UPDATE + 'replayed'] == 3
    model = optimizer.target
    kept = _kept(model)
    x, t = (fake.asarray(a) for a in batches[7])
    with chainer.reporter.Reporter().scope({}):
        optimizer.update(optimizer._lossfun, x, t)
    assert optimizer.stats[_UPDATE + 'replayed'] == 4
    assert optimizer.last_step_skipped
    _assert_kept(model, kept)
    x, t = (fake.asarray(a) for a in batches[8])
    with chainer.reporter.Reporter().scope({}):
        optimizer.update(optimizer._lossfun, x, t)
    assert optimizer.stats[_UPDATE + 'replayed'] == 5
    assert not optimizer.last_step_skipped
    assert optimizer.guard.skipped_steps == 1


def test_the_stacks_take_the_refilled_inverses_before_the_end(monkeypatch):
    """Before each call of the end's graph (a replay runs no version
    check) the stacked batches take the inverses refreshed in place."""
    from chainerkfac.graphs import step as graphs_step
    from chainerkfac.optimizers import KFAC
    events = []
    prepare = KFAC.prepare_inverse_stacks
    monkeypatch.setattr(KFAC, 'prepare_inverse_stacks', lambda self, *a: (
        events.append('stacks'), prepare(self, *a))[1])
    call = graphs_step.StepGraph.__call__

    def called(graph, *inputs):
        events.append(graph.label)
        return call(graph, *inputs)
    monkeypatch.setattr(graphs_step.StepGraph, '__call__', called)
    _run(_every, _batches(6), graphed=True, refresh_steps=True)
    ends = [i for i, e in enumerate(events) if e == _UPDATE]
    assert len(ends) == 4
    assert all(events[i - 1] == 'stacks' for i in ends)


@pytest.mark.parametrize('make', [_kfac, _bounded],
                         ids=['kfac', 'kfac-bounded'])
def test_refresh_steps_and_the_stale_graph_take_turns(make):
    """A mixed schedule: the stale steps replayed from one graph, kept
    through each refresh, and the refresh steps' passes and end from
    others; to the bit the eager run (with the bounded step, its ν and
    metric reported from the graph that took the step)."""
    batches = _batches(17)
    modes, fake, optimizer = _passes_as_eager(make, batches)
    stats = optimizer.stats
    assert modes.count('replayed') == 10 and modes.count('eager') == 6
    assert stats['kept through: a refresh step (factors due)'] == 4
    # refreshes at t = 4, 8, 12, 16: warm-up, capture, two replays
    assert (stats[_PASSES + 'eager'], stats[_PASSES + 'captured'],
            stats[_PASSES + 'replayed']) == (1, 1, 2)
    assert (stats[_UPDATE + 'eager'], stats[_UPDATE + 'captured'],
            stats[_UPDATE + 'replayed']) == (1, 1, 1)
    assert fake.captures == 3
    assert not [k for k in stats if 'dropped' in k], stats


def test_refresh_steps_capture_again_where_their_buffers_moved():
    """A parameter given a new array between steps (as a loader might):
    the passes' graph sees it before its replay, drops and captures again
    (it must not read the old array); the run stays the eager one."""
    def move(step, model):
        if step == 5:
            model.conv.W.array = model.conv.W.array.copy()
    batches = _batches(8)
    modes, fake, optimizer = _passes_as_eager(_every, batches, between=move)
    stats = optimizer.stats
    assert stats[_PASSES + 'dropped: its buffers moved'] == 1
    assert stats[_PASSES + 'captured'] == 2


def test_refresh_steps_not_replayed_with_the_mc_fisher():
    batches = _batches(6)
    modes, fake, optimizer = _passes_as_eager(_mc_every, batches)
    stats = optimizer.stats
    assert stats[_PASSES + "eager: fisher='mc' (its passes read the "
                 'logits on the host)'] == 5
    assert fake.captures == 0


def _mc_every(model):
    return helpers.kfac(lr=0.05, momentum=0.9, damping=1e-1, fisher='mc',
                        seed=4).setup(model)


def test_a_failed_capture_of_the_passes_runs_them_eagerly(monkeypatch):
    batches = _batches(7)
    eager, eager_obs, _, _ = _run(_every, batches, graphed=False)
    monkeypatch.setitem(globals(), 'ReplayCupy', _Refusing)
    state, obs, modes, (_, optimizer) = _run(_every, batches, graphed=True,
                                             refresh_steps=True)
    stats = optimizer.stats
    assert stats[_PASSES + 'capture failed'] == 1
    assert stats[_PASSES + 'eager: its capture failed before'] == 4
    _assert_same_state(eager, state)
    numpy.testing.assert_equal(obs, eager_obs)


def test_a_capture_lets_go_of_its_forward_pass(monkeypatch):
    """The Variables a capture left on the model (the loss, as
    ``L.Classifier`` keeps it), which every replay hands out again, are
    cut from their computational graph, so that the arrays its functions
    kept for the backward pass go back to the pool (each graph of the
    passes would otherwise keep a forward pass of its own); an eager
    step's loss keeps its graph, as in Chainer. (The reporter keeps a copy
    without the graph itself.)"""
    made = []
    plain = _lossfun

    def keeping(model):
        inner = plain(model)

        def lossfun(x, t):
            model.loss = inner(x, t)
            made.append(model.loss)
            return model.loss
        return lossfun

    monkeypatch.setitem(globals(), '_lossfun', keeping)
    _, _, _, (_, optimizer) = _run(_every, _batches(5), graphed=True,
                                   refresh_steps=True)
    assert optimizer.stats[_PASSES + 'replayed'] == 2
    model = optimizer.target
    assert any(model.loss is loss for loss in made[1:])
    assert model.loss.creator is None
    assert made[0].creator is not None      # the first step's, eager


class _WithUnusedHead(helpers.ConvNet):
    """A ConvNet with a Linear the loss never reaches."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with helpers.float64_links(), self.init_scope():
            self.aux = chainer.links.Linear(3, 2)


def test_replayed_passes_leave_an_unreached_parameter_alone():
    """A replay runs no ``cleargrads``: a parameter the passes do not
    reach must have no gradient after it, as after eager passes, so that
    the step leaves it alone (it had the zeros of the step before)."""
    batches = _batches(8)
    modes, _, optimizer = _passes_as_eager(_every, batches,
                                           network=_WithUnusedHead)
    assert optimizer.stats[_PASSES + 'replayed'] == 5
    # the end too: the guard asks only the rules of what it updates
    assert optimizer.stats[_UPDATE + 'replayed'] == 4, dict(optimizer.stats)
    assert optimizer.target.aux.W.update_rule.t == 0   # and the eager run's
    assert not [k for k in optimizer.stats if 'dropped' in k]


def test_stale_steps_with_an_unreached_head_are_replayed_as_eager():
    """A head no loss reaches keeps its factors due (it is refreshed as
    soon as a step reaches it), but a step that does not reach it
    refreshes nothing: the stale graph replays such steps, as the eager
    run takes them (the head untouched)."""
    batches = _batches(12)
    eager, eager_obs, _, _ = _run(_kfac, batches, graphed=False,
                                  network=_WithUnusedHead)
    state, obs, modes, (_, optimizer) = _run(_kfac, batches, graphed=True,
                                             network=_WithUnusedHead)
    assert modes.count('replayed') >= 5, modes
    _assert_same_state(eager, state)
    numpy.testing.assert_equal(obs, eager_obs)
    assert optimizer.target.aux.W.update_rule.t == 0


def _a_every_third(model):
    """A refreshed every third step, G and F every step: two sets of
    factors due."""
    return helpers.kfac(lr=0.05, momentum=0.9, damping=1e-1,
                        refresh_interval_a=3).setup(model)


def test_one_passes_graph_per_set_of_factors_due():
    """Factors on intervals of their own: the due set alternates, and
    each set's passes are captured once and replayed (no capture at each
    change of set)."""
    batches = _batches(19)
    modes, fake, optimizer = _passes_as_eager(_a_every_third, batches)
    stats = optimizer.stats
    assert len(optimizer.adapter.passes_graphs) == 2
    assert stats[_PASSES + 'captured'] == stats[_UPDATE + 'captured'] == 2
    assert fake.captures == 4
    assert stats[_PASSES + 'replayed'] >= 12, dict(stats)
    assert not [k for k in stats if 'dropped' in k], dict(stats)


def test_passes_graphs_beyond_the_limit_are_closed(monkeypatch):
    """One graph kept (the limit at 1) for two sets due: each change of
    set closes the other's graph and captures again; the run stays the
    eager one."""
    from chainerkfac.graphs import kfac_step
    monkeypatch.setattr(kfac_step, 'PASSES_GRAPHS', 1)
    batches = _batches(19)
    modes, fake, optimizer = _passes_as_eager(_a_every_third, batches)
    assert len(optimizer.adapter.passes_graphs) == 1
    assert optimizer.stats[_PASSES + 'dropped: closed'] >= 4
    assert fake.captures >= 5


def test_closing_lets_go_of_the_captured_sums():
    _, _, _, (_, optimizer) = _run(_every, _batches(5), graphed=True,
                                   refresh_steps=True)
    passes, = [g.adapter for g in optimizer.adapter.passes_graphs.values()]
    assert passes.captured_arrays()
    optimizer.close()
    assert not optimizer.adapter.passes_graphs
    assert passes.captured_arrays() == []


def test_a_checkpoint_due_at_a_refresh_step_takes_update():
    """A step that must take the guard's checkpoint first (after a
    restore) goes through update(), not the passes' graph."""
    def due(step, model):
        if step == 4:
            holder[0]._checkpoint_due = True
    holder = []

    def make(model):
        holder[:] = [_every(model)]
        return holder[0]
    batches = _batches(7)
    modes, _, optimizer = _passes_as_eager(make, batches, between=due)
    assert not holder[0]._checkpoint_due
    assert optimizer.stats[_PASSES + 'replayed'] == 3


class _FailingEnd(ReplayCupy):
    """CUDA refuses the first capture of a refresh step's end (the
    stand-in computes during a capture; CUDA only records)."""

    def __init__(self, device_arrays, **kwargs):
        super().__init__(device_arrays, **kwargs)
        fake = self
        fake.failed = 0

        class Failing(self.cuda.Stream):
            def end_capture(self):
                graph = super().end_capture()
                if fake._owner.label == _UPDATE and not fake.failed:
                    fake.failed += 1
                    raise RuntimeError('cudaErrorStreamCaptureInvalidated')
                return graph
        self.cuda.Stream = Failing


def test_a_failed_capture_of_the_end_leaves_no_damping_behind(
        monkeypatch):
    """The device γ a failed capture of the step's end made were only
    recorded, never computed: the eager end that follows makes its own
    (it read the failed capture's before)."""
    from chainerkfac.optimizers import KFAC
    # the objects themselves, kept (an id() of a freed one is reused)
    fakes, made, used = [], [], []
    block_damping = KFAC._block_damping

    def spied(self, block):
        if not fakes:                      # the eager run
            return block_damping(self, block)
        cached = self._step_dampings.get(block.damping_scale(self.rho_bn))
        out = block_damping(self, block)
        if fakes[0].capturing is not None and cached is None:
            made.append(out)
        elif fakes[0].capturing is None:
            used.append(out)
        return out
    monkeypatch.setattr(KFAC, '_block_damping', spied)
    _record_fakes(monkeypatch, _FailingEnd, fakes)
    monkeypatch.setitem(globals(), 'ReplayCupy', _FailingEnd)
    modes, fake, optimizer = _passes_as_eager(_every, _batches(6))
    assert fake.failed == 1
    assert optimizer.stats[_UPDATE + 'capture failed'] == 1
    assert made and used
    assert not [a for a in used if any(a is m for m in made)]


class _Twins(helpers.ConvNet):
    """A ConvNet with two equal Linear layers of width 64 after it: a
    batch of two equal Kronecker blocks in stage 5 once their factors,
    averaged over refreshes from a batch of 6, went dense (at the eighth
    step; low rank, Woodbury, before)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        with helpers.float64_links(), self.init_scope():
            self.widen = chainer.links.Linear(4, 64)
            self.twin1 = chainer.links.Linear(64, 64)
            self.twin2 = chainer.links.Linear(64, 64)

    def forward(self, x):
        h = F.relu(self.widen(F.relu(super().forward(x))))
        return self.twin2(F.relu(self.twin1(h)))


def test_the_end_stacks_its_batches_before_its_capture(monkeypatch):
    """Stage 5 in batches (the GPU's way, forced here) with factors whose
    inverses change form (averaged low-rank factors growing dense): the
    end's graph, captured before, sees its inverses moved and captures
    again, but the new batch is stacked before (never inside a capture:
    a capture's stack would be the graph's memory, its copies only
    recorded); the run is the eager one in batches."""
    from chainerkfac.fisher_blocks import kronecker
    from chainerkfac.optimizers import KFAC
    monkeypatch.setattr(KFAC, 'batches_stage_5', lambda self: True)
    fakes, stacked = [], []
    get = kronecker.InverseStack.get

    def spied(stack, blocks):
        members = tuple(b.inverses[n] for b in blocks for n in stack.names)
        if fakes and (len(members) != len(stack._members) or any(
                a is not b for a, b in zip(members, stack._members))):
            stacked.append(fakes[0].capturing is not None)
        return get(stack, blocks)
    monkeypatch.setattr(kronecker.InverseStack, 'get', spied)
    _record_fakes(monkeypatch, ReplayCupy, fakes)
    modes, fake, optimizer = _passes_as_eager(_every_decayed, _batches(10),
                                              network=_Twins)
    stats = optimizer.stats
    assert stats[_UPDATE + 'dropped: its buffers moved'] >= 1, dict(stats)
    assert stats[_UPDATE + 'captured'] >= 2, dict(stats)
    assert stats[_UPDATE + 'replayed'] >= 1, dict(stats)
    assert stacked and not any(stacked), stacked


def test_a_new_bound_captures_again():
    """The bounded step's bound is a constant of the captured kernels: a
    new ``kl_clip`` (or none) captures the stale step and the refresh
    step's end again; the run is the eager one."""
    def change(step, model):
        if step == 9:
            holder[0].step_bound.kl_clip = 1e-3
        if step == 13:
            holder[0].step_bound = None
    holder = []

    def make(model):
        holder[:] = [_kfac(model, interval=2, kl_clip=1e-5)]
        return holder[0]
    modes, fake, optimizer = _passes_as_eager(make, _batches(17),
                                              between=change)
    stats = optimizer.stats
    assert stats['dropped: hyperparameters changed'] == 2, dict(stats)
    assert stats[_UPDATE + 'dropped: hyperparameters changed'] >= 1


def test_refresh_steps_are_for_kfac_and_its_plain_steps():
    model = helpers.ConvNet(bn=True)
    with pytest.raises(TypeError, match='for K-FAC'):
        graphs.graphed(chainer.optimizers.MomentumSGD().setup(model),
                       refresh_steps=True)
    optimizer = _every(model)
    with pytest.raises(RuntimeError, match='started K-FAC'):
        optimizer.run_passes(_lossfun(model), *_batches(1)[0])


def _frozen_between(frozen):
    """``between`` for :func:`_run`: the convolution frozen
    (``disable_update()``) at the steps in ``frozen``, updated at the
    others."""
    def between(step, model):
        if step in frozen:
            model.conv.disable_update()
        else:
            model.conv.enable_update()
    return between


@pytest.mark.parametrize('make,refresh_steps', [
    (_kfac, False), (_bounded, False), (_kfac, True), (_bounded, True),
    (_guarded, False)],
    ids=['kfac', 'kfac-bounded', 'kfac-refresh-steps',
         'kfac-bounded-refresh-steps', 'guarded'])
def test_a_link_frozen_and_unfrozen_mid_run_is_replayed_as_eager(
        make, refresh_steps):
    """A link frozen (``disable_update()``) at a stale step after the
    capture, and updated again (``enable_update()``) at a stale step whose
    factors were decided while it was frozen: a replay of a graph captured
    with the other set of updated links would update it where the eager
    step does not (or not where it does), and K-FAC's eager step decides
    its factors again, the link due. The graphed run takes the eager
    run's steps, to the bit."""
    batches = _batches(17)
    between = _frozen_between(range(5, 10))
    eager, eager_obs, _, _ = _run(make, batches, graphed=False,
                                  between=between)
    state, obs, modes, (fake, optimizer) = _run(
        make, batches, graphed=True, between=between,
        refresh_steps=refresh_steps)
    _assert_same_state(eager, state)
    numpy.testing.assert_equal(obs, eager_obs)
    # the run froze it: the weights moved neither at the frozen steps nor
    # in the eager run's ones
    assert modes.count('replayed') >= 4, modes
    stats = optimizer.stats
    assert stats['dropped: hyperparameters changed'] >= 1, dict(stats)
    if make is not _guarded:
        # step 10 (stale by the schedule) refreshes the unfrozen link's
        # factors: it runs as a refresh step
        assert modes[10] == 'eager', modes


def test_the_frozen_steps_of_a_graphed_run_leave_the_link_alone():
    """The frozen link's weights and velocity stay as they were through the
    frozen steps of a graphed run (its replays among them)."""
    frozen = range(5, 10)
    kept = {}

    def between(step, model):
        _frozen_between(frozen)(step, model)
        if step in (5, 10):
            kept[step] = {n: p.array.copy()
                          for n, p in model.conv.namedparams()}
    _, _, modes, _ = _run(_kfac, _batches(11), graphed=True,
                          between=between)
    assert 'replayed' in modes[5:10], modes
    for name in kept[5]:
        numpy.testing.assert_array_equal(kept[5][name], kept[10][name])


_CASES = [(_kfac, False), (_bounded, True), (_guarded, False)]
_CASE_IDS = ['kfac', 'kfac-bounded-refresh-steps', 'guarded']


def _as_eager(make, refresh_steps, between, n_steps=13, **kwargs):
    """The graphed run with ``between`` against the eager one: the same
    state and reports to the bit. Returns the graphed run's modes and
    counts."""
    batches = _batches(n_steps)
    try:
        eager, eager_obs, _, _ = _run(make, batches, graphed=False,
                                      between=between, **kwargs)
        chainer.config.train = True     # as the run found it
        state, obs, modes, (_, optimizer) = _run(
            make, batches, graphed=True, between=between,
            refresh_steps=refresh_steps, **kwargs)
    finally:
        chainer.config.train = True
    _assert_same_state(eager, state)
    numpy.testing.assert_equal(obs, eager_obs)
    return modes, dict(optimizer.stats)


@pytest.mark.parametrize('make,refresh_steps', _CASES, ids=_CASE_IDS)
@pytest.mark.parametrize('lr', [0.2, numpy.float64(0.2),
                                numpy.array(0.2, numpy.float64)],
                         ids=['float', 'numpy-scalar', 'numpy-0d'])
def test_a_layers_own_lr_given_mid_run_is_replayed_as_eager(
        make, refresh_steps, lr):
    """An lr of its own given to a layer at step 5, after the graphed
    run's rules held the device view of the optimizer's: the next step
    put the view back, silently (fc/W off by 1.6 after 13 steps)."""
    def between(step, model):
        if step == 5:
            for param in model.fc.params():
                param.update_rule.hyperparam.lr = lr
    modes, stats = _as_eager(make, refresh_steps, between)
    assert 'replayed' in modes[7:], modes
    assert stats['dropped: hyperparameters changed'] >= 1, stats


@pytest.mark.parametrize('make,refresh_steps', _CASES, ids=_CASE_IDS)
@pytest.mark.parametrize('train_from', [True, False],
                         ids=['train-then-test', 'test-then-train'])
def test_the_configs_train_changed_mid_run_is_replayed_as_eager(
        make, refresh_steps, train_from):
    """``chainer.config.train`` changed at step 6 (BN frozen to its
    running statistics for fine-tuning, or the reverse): the replays took
    the kernels of the mode they were captured in (BN's statistics 0.04-
    0.14 off). (K-FAC in test mode captures no BN factor, which stays due:
    its steps are refresh steps, eager.)"""
    def between(step, model):
        chainer.config.train = train_from if step < 6 else not train_from
    modes, stats = _as_eager(make, refresh_steps, between)
    if make is _guarded or train_from:
        # a graph of the first mode was there at the change
        assert stats['dropped: a host value of the model changed '
                     '(config.train)'] == 1, stats
    if make is _guarded or not train_from:
        assert 'replayed' in modes[8:], modes


@pytest.mark.parametrize('make,refresh_steps', _CASES, ids=_CASE_IDS)
@pytest.mark.parametrize('name,value', [('decay', 0.5), ('eps', 0.1)])
def test_a_links_host_value_changed_mid_run_is_replayed_as_eager(
        make, refresh_steps, name, value):
    """A BatchNormalization's ``decay`` or ``eps`` changed at step 6:
    kernel arguments of the captured step, which went on with the old
    ones."""
    def between(step, model):
        if step == 6:
            setattr(model.bn, name, value)
    modes, stats = _as_eager(make, refresh_steps, between)
    assert 'replayed' in modes[8:], modes
    assert stats['dropped: a host value of the model changed '
                 '(/bn.{})'.format(name)] == 1, stats


class _FineTuned(helpers.ConvNet):
    """ConvNet whose BN runs in fine-tune mode (``decay = 1 - 1/N``, N
    counted on the host at every forward pass)."""

    def features(self, x):
        return F.relu(self.bn(self.conv(x), finetune=True))


@pytest.mark.parametrize('make,refresh_steps', _CASES, ids=_CASE_IDS)
def test_a_host_value_that_moves_every_step_runs_eagerly(make,
                                                         refresh_steps):
    """BatchNormalization in fine-tune mode: its ``N`` moves at every
    step, so every capture would hold a stale decay; after three steps in
    a row the steps run eagerly, saying why, as the eager run."""
    modes, stats = _as_eager(make, refresh_steps, None, network=_FineTuned)
    assert 'replayed' not in modes[4:], modes
    assert stats['eager: host values of the model change at every step '
                 '(/bn.N)'] >= 6, stats


def _new_rules(step, model):
    """New update rules at step 6 (the optimizer's state started again),
    the run's optimizer being the model's ``_optimizer``."""
    if step == 6:
        for param in model.params():
            param.update_rule = model._optimizer.create_update_rule()


def _new_velocities(step, model):
    if step == 6:
        for param in model.params():
            state = param.update_rule.state
            state['v'] = state['v'] * 0


def _new_weight(step, model):
    if step == 6:
        model.fc.W.array = model.fc.W.array * 0.5


@pytest.mark.parametrize('make,refresh_steps', _CASES, ids=_CASE_IDS)
@pytest.mark.parametrize('between', [_new_velocities, _new_weight],
                         ids=['new-velocities', 'new-weight'])
def test_an_array_replaced_mid_run_is_replayed_as_eager(
        make, refresh_steps, between):
    """A parameter's array or a velocity replaced by a new array at step 6
    (a reset of the optimizer's state, a weight rescaled by assignment):
    the replays went on writing the captured arrays (fc/W 0.08-0.10
    off)."""
    modes, stats = _as_eager(make, refresh_steps, between)
    assert 'replayed' in modes[8:], modes
    assert stats['dropped: its buffers moved'] >= 1, stats


def _guarded_kept(model):
    optimizer = _guarded(model)
    model._optimizer = optimizer.actual_optimizer
    return optimizer


def _kfac_kept(model):
    optimizer = _kfac(model)
    model._optimizer = optimizer
    return optimizer


@pytest.mark.parametrize('make', [_guarded_kept, _kfac_kept],
                         ids=['guarded', 'kfac'])
def test_new_update_rules_mid_run_are_replayed_as_eager(make):
    """The rules replaced at step 6 (a stale step for K-FAC): the replays
    went on updating the old rules' velocities and the new ones never got
    a state (guarded), or a capture recorded the new rules' first update
    (K-FAC: fc/W 0.22 off)."""
    modes, stats = _as_eager(make, False, _new_rules)
    assert 'replayed' in modes[8:], modes
    assert stats.get('dropped: its buffers moved', 0) + stats.get(
        'dropped: hyperparameters changed', 0) == 1, stats
    # their first update (eager) makes their state; then captured again
    assert modes[6:8] == ['eager', 'captured'], modes
    assert stats['eager: an update rule without state yet (new rules: its '
                 'first update makes it)'] == 1, stats

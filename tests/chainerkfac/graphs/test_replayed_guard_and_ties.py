"""What 2026-11-27's second session changed, under the replay stand-in: a
load while the stale graph lives, statistics set between replayed steps,
parameters shared between links, a capture that fails after the guard's
check. Found by a read-only review of the session's changes against the
graphs' code (none of it ran on a GPU)."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import contextlib
import warnings

import chainer
import chainer.functions as F
import chainer.links as L
import numpy
import pytest
from chainer import serializers

from chainerkfac import graphs
from chainerkfac.optimizers import update_rule
from tests.chainerkfac import helpers
from tests.chainerkfac.graphs import test_kfac_step as T
from tests.chainerkfac.graphs.replay_fake import (ReplayCupy,
                                                 device_arrays_of, watched_of)


def _graphed(inner, model):
    fake = ReplayCupy(lambda: device_arrays_of(inner, model),
                      watched=lambda: watched_of(inner, model))
    return fake, graphs.graphed(inner, warmup=1, cupy=fake,
                                route_linear=contextlib.nullcontext)


def _step(fake, opt, lossfun, batch):
    x, t = (fake.asarray(a) for a in batch)
    with chainer.reporter.Reporter().scope({}):
        how = opt.update(lossfun, x, t)
    fake.step_graph = opt.graph
    return how


def test_a_load_while_the_stale_graph_lives_runs_the_next_step_eagerly():
    """A roll-back (optimizer and model loaded from a snapshot) recomputes
    the inverses into new arrays: the next stale step must not replay the
    graph on the old ones. The load's checkpoint of the statistics (so
    that a hand-written loop's skipped step restores them) had made the
    guard ready, which let the replay through."""
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    inner = T._kfac(model)
    fake, opt = _graphed(inner, model)
    lossfun = T._lossfun(model)
    batches = T._batches(9)
    for i in range(6):
        _step(fake, opt, lossfun, batches[i])
    snapshot = {}
    saving = serializers.DictionarySerializer(snapshot)
    inner.serialize(saving['opt'])
    model.serialize(saving['model'])
    _step(fake, opt, lossfun, batches[6])
    loading = serializers.NpzDeserializer(snapshot)
    inner.serialize(loading['opt'])
    model.serialize(loading['model'])
    opt.adapter.before_step()
    assert 'the guard takes its checkpoint' in opt.adapter.refusal()
    assert _step(fake, opt, lossfun, batches[7]) == 'eager'


def test_statistics_set_between_replayed_refresh_steps_are_kept():
    """A skipped refresh step through the passes' graph (the default of
    a graphed run) puts back the statistics the step found, not those of
    the last step's end: ``run_passes`` took no checkpoint."""
    k = 7

    def between(step, model):
        if step == k:
            model.bn.avg_mean[...] = 5.0
            model.bn.avg_var[...] = 3.0

    batches = T._batches(k + 1, nan_at=(k,))
    state, observations, modes, (fake, opt) = T._run(
        T._every, batches, graphed=True, refresh_steps=True,
        between=between)
    assert observations[-1]['kfac/skipped_step'] == 1.0
    assert opt.stats['refresh passes: replayed'] >= 1
    numpy.testing.assert_array_equal(state['avg_mean'], 5.0)
    numpy.testing.assert_array_equal(state['avg_var'], 3.0)


class Placed(helpers.ConvNet):
    """One link under two names."""

    def __init__(self, bn=True):
        super().__init__(bn=bn)
        with helpers.float64_links(), self.init_scope():
            self.mid = L.Linear(4, 4)
            self.mid_again = self.mid

    def forward(self, x):
        return self.mid_again(F.relu(self.mid(super().forward(x))))


class Tied(helpers.ConvNet):
    """Two links sharing a weight."""

    def __init__(self, bn=True):
        super().__init__(bn=bn)
        with helpers.float64_links(), self.init_scope():
            self.l2 = L.Linear(4, 4)
            self.l3 = L.Linear(4, 4)
        self.l3.W = self.l2.W

    def forward(self, x):
        return self.l3(F.relu(self.l2(super().forward(x))))


@pytest.mark.parametrize('network', [Placed, Tied])
@pytest.mark.parametrize('make, refresh_steps', [(T._kfac, False),
                                                  (T._every, True)],
                         ids=['stale', 'refresh-steps'])
def test_a_shared_parameter_replayed_as_eager(network, make, refresh_steps):
    """``model.params()`` yields a shared parameter twice: a replay
    advanced its rule's ``t`` twice (17 against 11 in 11 steps)."""
    batches = T._batches(11)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')     # the tie's warning
        eager, _, _, _ = T._run(make, batches, graphed=False,
                                network=network)
        replayed, _, _, (fake, opt) = T._run(
            make, batches, graphed=True, refresh_steps=refresh_steps,
            network=network)
    assert opt.stats['replayed'] + opt.stats.get(
        'refresh passes: replayed', 0) > 0
    assert sorted(eager) == sorted(replayed)
    for key in eager:
        numpy.testing.assert_array_equal(replayed[key], eager[key],
                                         err_msg=key)


def test_a_capture_failing_after_the_check_counts_a_skipped_step_once(
        monkeypatch):
    """A capture that raises between the guard's check and the step's
    end: the eager rerun's checkpoint settled the last step again and
    counted its skip twice."""
    numpy.random.seed(0)
    model = helpers.ConvNet(bn=True)
    inner = T._kfac(model)
    fake, opt = _graphed(inner, model)
    real = update_rule.apply_all

    def apply_all(pairs):
        if fake.capturing is not None:
            raise RuntimeError('cudaErrorStreamCaptureUnsupported (emulated)')
        return real(pairs)

    monkeypatch.setattr(update_rule, 'apply_all', apply_all)
    lossfun = T._lossfun(model)
    for batch in T._batches(4, nan_at=(1,)):
        _step(fake, opt, lossfun, batch)
    assert inner.guard.skipped_steps == 1

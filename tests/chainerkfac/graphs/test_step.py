"""StepGraph's decisions on a CPU, against a CuPy stand-in that emulates
stream capture (tests/chainerkfac/graphs/cupy_graph_fake.py): warm-up,
capture, replay with new inputs, the host bookkeeping of a replay,
refusals and their reasons, what drops a graph, a failed capture. The
optimizer adapter is checked on real Chainer optimizers."""
import logging

import numpy
import pytest

import chainer
import chainer.links as L

from chainerkfac.graphs import step as graphs_step
from tests.chainerkfac.graphs.cupy_graph_fake import FakeCupy, OutOfMemoryError


class Counting:
    """A routing context that counts its uses."""

    def __init__(self):
        self.entered = 0

    def __call__(self):
        import contextlib
        self.entered += 1
        return contextlib.nullcontext()


def _setup(optimizer=None, warmup=2):
    fake = FakeCupy()
    link = L.Linear(3, 2)
    optimizer = optimizer or chainer.optimizers.MomentumSGD(lr=0.1)
    optimizer.setup(link)
    for param in link.params():
        # the states a first (eager) update would make: the stand-in step
        # below makes none
        param.update_rule._init_states(param)
    weights = numpy.zeros(4)
    state = {'sync': False, 'oom': 0}

    def step(x):
        # host work of a Chainer update, then device work that reads the
        # input and a host value baked into the kernel (lr)
        optimizer.t += 1
        for param in link.params():
            param.update_rule.t += 1
        lr = optimizer.lr
        if state['sync']:
            fake.synchronize()
        if state['oom'] and fake.capturing is not None:
            state['oom'] -= 1       # the graph's pool cannot grow
            raise OutOfMemoryError('out of memory to allocate 512 bytes')
        fake.kernel(lambda: weights[:x.size].__isub__(lr * x))

    routing = Counting()
    graph = graphs_step.StepGraph(
        step, graphs_step.ChainerOptimizer(optimizer), warmup=warmup,
        cupy=fake, route_linear=routing)
    return fake, graph, optimizer, weights, state, routing


def _x(fake, value):
    return fake.asarray(numpy.full(4, float(value)))


def test_warmup_capture_replay_equal_eager():
    fake, graph, optimizer, weights, _, routing = _setup()
    modes = [graph(_x(fake, v)) for v in range(1, 7)]
    assert modes == ['eager', 'eager', 'captured', 'replayed', 'replayed',
                     'replayed']
    # every step applied once, the replays with their own inputs
    numpy.testing.assert_array_equal(weights, -0.1 * sum(range(1, 7)))
    assert optimizer.t == 6
    assert all(p.update_rule.t == 6 for p in optimizer.target.params())
    assert routing.entered == 3          # eager steps and the capture
    assert graph.stats['replayed'] == 3 and graph.stats['captured'] == 1
    log = fake.log
    begin = [e for e in log if e[0] == 'begin_capture']
    assert begin == [('begin_capture', 'side2', begin[0][2])]
    assert begin[0][2].startswith('private pool')   # the graph's own pool
    # each capture or launch: the side stream waits for the main stream,
    # the main stream for it after
    launches = [i for i, e in enumerate(log) if e[0] == 'launch']
    assert len(launches) == 4
    previous = -1
    for i in launches:
        assert ('wait', 'side2', 'main') in log[previous + 1:i]
        assert log[i + 1] == ('wait', 'main', 'side2')
        previous = i


def test_hyperparameters_changed_recaptures():
    fake, graph, optimizer, weights, _, _ = _setup()
    for v in range(3):
        graph(_x(fake, 1))
    optimizer.lr = 0.5
    assert graph(_x(fake, 1)) == 'captured'       # no warm-up again
    assert graph(_x(fake, 1)) == 'replayed'
    numpy.testing.assert_allclose(weights, -(3 * 0.1 + 2 * 0.5))
    assert graph.stats['dropped: hyperparameters changed'] == 1
    # the second capture allocates from the first one's pool (a pool per
    # capture leaked what arrays outliving a capture pinned)
    pools = [e[2] for e in fake.log if e[0] == 'begin_capture']
    assert len(pools) == 2 and pools[0] == pools[1]
    assert pools[0].startswith('private pool')


def test_signature_change_warms_up_again():
    fake, graph, _, _, _, _ = _setup()
    for _ in range(3):
        graph(_x(fake, 1))
    small = fake.asarray(numpy.ones(2))
    assert [graph(small) for _ in range(3)] == ['eager', 'eager',
                                                'captured']
    assert graph.stats['dropped: input signature changed'] == 1


def test_refusals_run_eagerly_and_drop_the_graph():
    fake, graph, optimizer, weights, _, _ = _setup()
    for _ in range(4):
        graph(_x(fake, 1))
    assert graph(numpy.ones(4)) == 'eager'         # a NumPy array
    assert graph.stats['eager: inputs are not CuPy arrays'] == 1
    assert graph.stats['dropped: an eager step ran'] == 1
    assert graph(_x(fake, 1)) == 'captured'
    numpy.testing.assert_allclose(weights, -0.1 * 6)
    assert optimizer.t == 6


def test_failed_capture_restores_host_state_and_runs_eagerly(caplog):
    fake, graph, optimizer, weights, state, _ = _setup()
    state['sync'] = True
    with caplog.at_level(logging.WARNING):
        modes = [graph(_x(fake, 1)) for _ in range(4)]
    assert modes == ['eager'] * 4
    assert 'could not be captured' in caplog.text
    assert 'cudaErrorStreamCaptureUnsupported' in caplog.text
    assert graph.stats['capture failed'] == 1     # not tried again
    assert graph.stats['eager: its capture failed before'] == 1
    # the failed capture's host effects were undone: 4 steps, not 5
    assert optimizer.t == 4
    numpy.testing.assert_allclose(weights, -0.4)


def test_a_capture_out_of_memory_is_tried_once_more(caplog):
    fake, graph, optimizer, weights, state, _ = _setup()
    state['oom'] = 1
    with caplog.at_level(logging.WARNING):
        modes = [graph(_x(fake, 1)) for _ in range(4)]
    assert modes == ['eager', 'eager', 'captured', 'replayed']
    assert 'ran out of device memory' in caplog.text
    assert graph.stats['capture out of memory'] == 1
    assert graph.stats['capture failed'] == 0
    # the default pool's cached blocks went back before the second try
    assert fake.default_pool.frees == 1 and fake.default_pool.cached == 0
    # the first try's host effects were undone: 4 steps, each once
    assert optimizer.t == 4
    numpy.testing.assert_allclose(weights, -0.4)


def test_a_child_out_of_memory_drops_the_graphs_on_its_pool_first():
    """A child captures into its parent's pool, whose free blocks include
    the temporaries every live graph on it rewrites at each replay: before
    a capture that ran out of memory gives them back, the other graphs on
    the pool go (their next replay would write freed memory); each is
    captured again later."""
    fake, parent, optimizer, weights, state, _ = _setup()
    child_oom = {'n': 0}
    side = numpy.zeros(4)

    def part(x):
        if child_oom['n'] and fake.capturing is not None:
            child_oom['n'] -= 1
            raise OutOfMemoryError('out of memory to allocate 512 bytes')
        fake.kernel(lambda: side[:x.size].__iadd__(x))

    class Part(graphs_step.ChainerOptimizer):
        def step_objects(self):
            return []

        def graph_buffers(self):
            return ()

        def after_replay(self):     # a part of a step: t is the parent's
            pass

    child = graphs_step.StepGraph(part, Part(optimizer), warmup=1,
                                  parent=parent, label='part: ')
    sibling = graphs_step.StepGraph(part, Part(optimizer), warmup=1,
                                    parent=parent, label='other: ')
    assert [parent(_x(fake, 1)) for _ in range(4)] == \
        ['eager', 'eager', 'captured', 'replayed']
    assert [sibling(_x(fake, 1)) for _ in range(2)] == ['eager', 'captured']
    child_oom['n'] = 1
    assert [child(_x(fake, 1)) for _ in range(3)] == \
        ['eager', 'captured', 'replayed']
    reason = 'dropped: the memory pool was given back (a capture on it ran ' \
        'out of memory)'
    assert parent.stats[reason] == 1
    assert parent.stats['other: ' + reason] == 1
    assert parent.stats['part: capture out of memory'] == 1
    assert parent._pool.frees == 1
    # dropped, not closed: each captures again at its next step
    assert parent(_x(fake, 1)) == 'captured'
    assert sibling(_x(fake, 1)) == 'captured'
    assert optimizer.t == 5
    numpy.testing.assert_allclose(weights, -0.5)
    numpy.testing.assert_allclose(side, 6.0)   # 3 + 3 steps of the parts


def test_a_capture_out_of_memory_twice_runs_eagerly():
    fake, graph, optimizer, weights, state, _ = _setup()
    state['oom'] = 2
    modes = [graph(_x(fake, 1)) for _ in range(5)]
    assert modes == ['eager'] * 5
    assert graph.stats['capture out of memory'] == 1
    assert graph.stats['capture failed'] == 1      # not tried again
    assert graph.stats['eager: its capture failed before'] == 2
    assert state['oom'] == 0 and optimizer.t == 5
    numpy.testing.assert_allclose(weights, -0.5)


def test_out_of_memory_is_told_from_other_refusals():
    out = graphs_step._out_of_memory
    assert out(OutOfMemoryError('out of memory to allocate 8 bytes'))
    assert out(RuntimeError('cudaErrorMemoryAllocation: out of memory'))
    assert out(RuntimeError('CUDNN_STATUS_ALLOC_FAILED'))
    assert not out(RuntimeError('cudaErrorStreamCaptureUnsupported: '
                                'operation not permitted when stream is '
                                'capturing'))
    assert not out(NotImplementedError('calling cuBLAS API during stream '
                                       'capture is currently unsupported'))
    # CuPy's pool frees its cached blocks when cudaMalloc fails, and CUDA
    # refuses that during a capture: the refusal's context is the cause
    try:
        try:
            raise RuntimeError('cudaErrorMemoryAllocation: out of memory')
        except RuntimeError:
            raise RuntimeError('cudaErrorStreamCaptureUnsupported')
    except RuntimeError as error:
        assert out(error)


def test_adapter_refuses_what_it_cannot_replay():
    adam = graphs_step.ChainerOptimizer(chainer.optimizers.Adam())
    adam.optimizer.setup(L.Linear(2, 2))
    assert 'AdamRule' in adam.refusal()
    sgd = chainer.optimizers.MomentumSGD()
    sgd.setup(L.Linear(2, 2))
    adapter = graphs_step.ChainerOptimizer(sgd)
    assert adapter.refusal() is None
    before = adapter.baked()
    sgd.lr = 0.5
    assert adapter.baked() != before
    sgd.add_hook(chainer.optimizer_hooks.WeightDecay(1e-4))
    assert 'WeightDecay' in adapter.refusal()
    sgd.loss_scaling()          # a host number the backward starts from
    assert 'loss scaling' in adapter.refusal()
    fake, graph, *_ = _setup(optimizer=chainer.optimizers.Adam())
    assert graph(_x(fake, 1)) == 'eager'
    assert any('AdamRule' in k for k in graph.stats)
    with pytest.raises(ValueError, match='warmup'):
        graphs_step.StepGraph(lambda: None, adapter, warmup=0, cupy=fake)


class _Releases:
    """Stands for the cuDNN runtime and the GEMMs: records the streams
    whose workspaces are let go."""

    def __init__(self):
        self.streams = []

    def release_stream(self, stream):
        self.streams.append(stream)


@pytest.mark.parametrize('how', ['close', 'garbage'])
def test_a_gone_step_graph_lets_go_of_its_streams_workspaces(how,
                                                             monkeypatch):
    """The workspaces cuDNN and cuBLAS keep for the graph's side stream
    are cut from the graph's pool: closing the StepGraph, or dropping it,
    lets them go (in a sweep of graphed runs in one process, 23 GB of an
    H200 stayed in use after two dropped ResNet-50 graphs at batch 64);
    after close(), the next eligible step captures afresh."""
    import gc
    from chainerkfac.cudnn import runtime
    from chainerkfac.graphs import gemm
    gc.collect()                # other tests' graphs: not reported here
    cudnn_rt, gemms = _Releases(), _Releases()
    monkeypatch.setattr(runtime, '_current', cudnn_rt)
    monkeypatch.setattr(gemm, '_gemm', gemms)
    fake, graph, _, weights, _, _ = _setup()
    modes = [graph(_x(fake, v)) for v in range(1, 4)]
    assert modes[-1] == 'captured'
    stream = graph._stream.ptr
    assert cudnn_rt.streams == gemms.streams == []
    if how == 'close':
        graph.close()
        assert cudnn_rt.streams == gemms.streams == [stream]
        assert graph(_x(fake, 4)) == 'captured'     # afresh: a new stream
        assert graph._stream.ptr != stream
        graph.close()
        graph.close()                                # once is enough
        assert len(cudnn_rt.streams) == 2
    else:
        del graph
        gc.collect()
        assert cudnn_rt.streams.count(stream) == 1
        assert gemms.streams.count(stream) == 1


def test_a_closed_step_graphs_pool_is_given_back(monkeypatch):
    """A dropped CuPy pool never frees its cached blocks (CuPy 14.1+): a
    closed StepGraph empties its pool, and one whose arrays live on (a
    gradient the last capture made) is kept until a later StepGraph's
    first capture finds it empty."""
    from chainerkfac.graphs import step as step_module
    monkeypatch.setattr(step_module, '_retired', [])
    fake, graph, _, _, _, _ = _setup()
    for v in range(1, 4):
        graph(_x(fake, v))
    pool = graph._pool
    graph.close()
    assert pool.frees == 1 and pool.total_bytes() == 0
    assert step_module._retired == []            # nothing left: forgotten
    assert graph(_x(fake, 4)) == 'captured'
    second = graph._pool
    assert second is not pool
    second.in_use = 512                          # arrays cut from it live
    graph.close()
    assert second.frees == 1 and step_module._retired == [second]
    other, other_graph, _, _, _, _ = _setup()
    for v in range(1, 4):
        other_graph(_x(other, v))                # its first capture sweeps
    assert second.frees == 2 and step_module._retired == [second]
    second.in_use = 0                            # those arrays are gone
    other_graph.close()
    assert second.frees == 2                     # swept at the next capture
    assert other_graph(_x(other, 5)) == 'captured'
    assert second.frees == 3 and step_module._retired == []


def _graphed_with_two_losses():
    """``(fake, optimizer, stepper, lossfun, other)``: a graphed momentum
    SGD (warm-up 1, on the CuPy stand-in) and two loss functions whose
    device work differs."""
    import contextlib
    from chainerkfac import graphs
    fake = FakeCupy()
    link = L.Linear(3, 2)
    optimizer = chainer.optimizers.MomentumSGD(lr=0.1).setup(link)
    stepper = graphs.graphed(optimizer, warmup=1, cupy=fake,
                             route_linear=contextlib.nullcontext)
    weights = numpy.zeros(4)

    def lossfun(x):
        fake.kernel(lambda: weights.__isub__(x))
        return chainer.functions.sum(link.W) * 0.0

    def other(x):
        fake.kernel(lambda: weights.__iadd__(x))
        return chainer.functions.sum(link.W) * 0.0
    return fake, optimizer, stepper, lossfun, other


def test_graphed_optimizer_closes_a_replaced_graph(monkeypatch):
    """A new loss function gets a new StepGraph: the old one is closed
    (its stream's workspaces let go) then, and close() closes the
    current one."""
    import gc
    from chainerkfac.cudnn import runtime
    gc.collect()
    released = _Releases()
    monkeypatch.setattr(runtime, '_current', released)
    fake, optimizer, stepper, lossfun, other = _graphed_with_two_losses()
    assert [stepper.update(lossfun, _x(fake, 1)) for _ in range(2)] == [
        'eager', 'captured']
    first = stepper.graph._stream.ptr
    assert stepper.update(other, _x(fake, 1)) == 'eager'
    assert released.streams.count(first) == 1
    assert stepper.update(other, _x(fake, 1)) == 'captured'
    second = stepper.graph._stream.ptr
    stepper.close()
    assert released.streams.count(second) == 1


def test_graphed_on_a_machine_without_cupy_runs_eagerly(monkeypatch):
    """``chainerkfac.graphs.graphed(optimizer)``, as the docs write it after
    ``import chainerkfac``, on a machine without CuPy: every step eager,
    with the reason, and the same weights as the optimizer alone."""
    import sys
    import chainerkfac
    monkeypatch.setitem(sys.modules, 'cupy', None)    # import fails
    rng = numpy.random.RandomState(0)
    x = rng.randn(8, 4).astype(numpy.float32)
    t = rng.randint(0, 3, 8).astype(numpy.int32)

    def run(wrap):
        numpy.random.seed(0)
        model = L.Classifier(L.Linear(4, 3))
        optimizer = chainerkfac.optimizers.KFAC(lr=0.05, verbose=False)
        optimizer.setup(model)
        stepper = chainerkfac.graphs.graphed(optimizer) if wrap \
            else optimizer
        modes = [stepper.update(model, x, t) for _ in range(3)]
        return model.predictor.W.array.copy(), modes, stepper

    wrapped, modes, stepper = run(True)
    plain, _, _ = run(False)
    assert modes == ['eager'] * 3
    reason, = [k for k in stepper.stats if k.startswith('eager: ')]
    assert 'CuPy cannot be imported' in reason
    numpy.testing.assert_array_equal(wrapped, plain)


def _reference_baked(rules, skip):
    return [tuple(sorted((k, v) for k, v in r.hyperparam.get_dict().items()
                         if k not in skip)) for r in rules]


@pytest.mark.parametrize('skip', [(), ('lr', 'momentum')])
def test_baked_hyperparameters_are_each_rules_own_over_its_optimizers(skip):
    """The fast form (each parent's dictionary read once) against Chainer's
    own ``get_dict()`` per rule: rules that inherit everything, a rule with
    values of its own (one skipped, one not), rules of two optimizers, a
    rule without a parent."""
    first, second = L.Linear(3, 2), L.Linear(2, 2)
    sgd = chainer.optimizers.MomentumSGD(lr=0.1).setup(first)
    adam = chainer.optimizers.Adam(alpha=0.01).setup(second)
    rules = [p.update_rule for p in first.params()] + [
        p.update_rule for p in second.params()]
    rules[0].hyperparam.lr = 0.5             # its own, maybe skipped
    rules[1].hyperparam.momentum = 0.8
    rules[1].hyperparam.lr = 0.25
    lone = chainer.optimizers.momentum_sgd.MomentumSGDRule(lr=0.3)
    orphan = chainer.optimizers.momentum_sgd.MomentumSGDRule()
    orphan.hyperparam = chainer.optimizer.Hyperparameter()
    orphan.hyperparam.lr = 0.2
    rules += [lone, orphan]
    assert orphan.hyperparam.parent is None
    got = graphs_step.baked_hyperparameters(rules, skip)
    assert got == _reference_baked(rules, skip)
    # a schedule on the optimizer moves what every inheriting rule holds
    # (unless the value is one on the device)
    sgd.hyperparam.momentum = 0.95
    moved = graphs_step.baked_hyperparameters(rules, skip)
    assert moved == _reference_baked(rules, skip)
    assert (moved == got) == ('momentum' in skip)
    adam.hyperparam.eps = 1e-6
    assert graphs_step.baked_hyperparameters(rules, skip)[3] == \
        _reference_baked(rules, skip)[3]


def test_the_adapters_order_of_parameters_is_stable_and_complete():
    """``ParameterWalk`` walks the model without names: every parameter
    with an update rule, once, the same order at every walk (host_state
    and restore_host_state zip against it)."""
    import chainer.links as links
    model = chainer.Sequential(L.Linear(4, 3), links.BatchNormalization(3),
                               L.Linear(3, 2))
    optimizer = chainer.optimizers.MomentumSGD().setup(model)
    model[1].gamma.update_rule = None        # frozen
    got = graphs_step.ParameterWalk(optimizer)()
    expected = [p for _, p in sorted(model.namedparams())
                if p.update_rule is not None]
    assert sorted(map(id, got)) == sorted(map(id, expected))
    assert len(got) == 5
    assert [id(p) for p in graphs_step.ParameterWalk(optimizer)()] == \
        [id(p) for p in got]
    adapter = graphs_step.ChainerOptimizer(optimizer)
    for i, param in enumerate(got):
        param.update_rule.t = i
    state = adapter.host_state()
    for param in got:
        param.update_rule.t = 99
    adapter.restore_host_state(state)
    assert [p.update_rule.t for p in got] == list(range(5))


def test_the_parameter_walk_is_shared_within_a_step_and_redone_after():
    """One walk of the model per optimizer step; a step (``t``) or a new
    target walks again, and each parameter's rule is read at every call."""
    model = chainer.Sequential(L.Linear(4, 3), L.Linear(3, 2))
    optimizer = chainer.optimizers.MomentumSGD().setup(model)
    walk = graphs_step.ParameterWalk(optimizer)
    walks = []
    original = chainer.Sequential.params

    def counted(self, *args):
        walks.append(1)
        return original(self, *args)
    chainer.Sequential.params = counted
    try:
        assert len(walk()) == len(walk()) == 4 and len(walks) == 1
        model[0].b.update_rule = None                 # read every call
        assert len(walk()) == 3 and len(walks) == 1
        optimizer.t += 1
        assert len(walk()) == 3 and len(walks) == 2   # a new step
        other = chainer.Sequential(L.Linear(2, 2))
        optimizer.setup(other)                        # a new target
        before = len(walks)
        assert len(walk()) == 2 and len(walks) == before + 1
    finally:
        chainer.Sequential.params = original


class _Holder:
    """An optimizer's state whose 'refresh' steps run eagerly: ``inverse``
    is what the captured kernel reads, ``out`` what each step writes."""

    def __init__(self, fake):
        self.inverse = fake.asarray(numpy.full(4, 1.0))
        self.out = None
        self.due = False
        self.refill = True


class _Refreshing:
    """The adapter of such an optimizer: its refresh steps may keep the
    graph (``keeps_graph``), which reads ``holder.inverse``."""

    REFRESH = 'a refresh'

    def __init__(self, holder):
        self.holder = holder

    def before_step(self):
        pass

    def refusal(self):
        return self.REFRESH if self.holder.due else None

    def baked(self):
        return ()

    def host_state(self):
        return ()

    def restore_host_state(self, state):
        pass

    def after_capture(self, before):
        pass

    def after_replay(self):
        pass

    def keeps_graph(self, reason):
        return reason == self.REFRESH

    def graph_buffers(self):
        return graphs_step.buffer_signature([self.holder.inverse])

    def step_objects(self):
        return [self.holder]


def _refreshing_setup():
    fake = FakeCupy()
    holder = _Holder(fake)
    weights = numpy.zeros(4)

    def step(x):
        if holder.due:      # a refresh: a new inverse, in place or not
            new = numpy.full(4, 10.0)
            if holder.refill:
                holder.inverse[...] = new
            else:
                holder.inverse = fake.asarray(new)
        inverse = holder.inverse    # the kernel reads this array
        out = holder.out = fake.asarray(numpy.zeros(4))

        def kernel():
            weights[...] += inverse * x
            out[...] = inverse * x
        fake.kernel(kernel)

    graph = graphs_step.StepGraph(step, _Refreshing(holder), warmup=1,
                                  cupy=fake, route_linear=Counting())
    return fake, graph, holder, weights


@pytest.mark.parametrize('refill', [True, False])
def test_an_eager_step_keeps_the_graph_where_its_buffers_stay(refill):
    """A refresh step that writes its new inverse into the array the graph
    reads keeps the graph: the replays after it apply the new inverse.
    One that puts a new array there drops it (the graph would read the
    old one), and the next step is captured again. Either way the
    weights are those of every step taken eagerly."""
    fake, graph, holder, weights = _refreshing_setup()
    holder.refill = refill
    modes = [graph(_x(fake, 1)), graph(_x(fake, 1)), graph(_x(fake, 1))]
    captured_out = holder.out
    holder.due = True
    modes.append(graph(_x(fake, 2)))
    eager_out = holder.out
    holder.due = False
    modes += [graph(_x(fake, 3)), graph(_x(fake, 4))]
    assert modes[:4] == ['eager', 'captured', 'replayed', 'eager']
    # steps 1-3 with the inverse 1, then 2, 3 and 4 with the new one (10)
    numpy.testing.assert_array_equal(weights, 1 + 1 + 1 + 10 * (2 + 3 + 4))
    reason = 'a refresh'
    if refill:
        assert modes[4:] == ['replayed', 'replayed']
        assert graph.stats['kept through: ' + reason] == 1
        assert not [k for k in graph.stats if k.startswith('dropped')]
        # the eager step's output stood until the next replay; then the
        # capture's, which each replay rewrites, is put back
        assert eager_out is not captured_out
        assert holder.out is captured_out
        numpy.testing.assert_array_equal(holder.out, 40.0)
    else:
        assert modes[4:] == ['captured', 'replayed']
        assert graph.stats[
            'dropped: an eager step moved its buffers (a refresh)'] == 1
        assert graph.stats['captured'] == 2


def test_an_eager_step_the_adapter_does_not_name_drops_the_graph():
    """Only the eager steps the adapter names keep the graph: any other
    reason (the guard's checkpoint, say) drops it as before."""
    fake, graph, holder, weights = _refreshing_setup()
    for _ in range(3):
        graph(_x(fake, 1))
    graph.adapter.refusal = lambda: 'another reason'
    assert graph(_x(fake, 1)) == 'eager'
    graph.adapter.refusal = lambda: None
    assert graph(_x(fake, 1)) == 'captured'
    assert graph.stats['dropped: an eager step ran'] == 1


def test_a_kept_eager_step_that_fails_drops_the_graph():
    """An eager step the adapter names that raises may have moved a buffer
    before it failed, and nothing checks them then: the graph goes, the
    error reaches the caller, and the next step is captured again."""
    fake, graph, holder, weights = _refreshing_setup()
    for _ in range(3):
        graph(_x(fake, 1))
    holder.due = True
    step = graph.step

    def failing(x):
        holder.inverse = fake.asarray(numpy.full(4, 5.0))   # moved ...
        raise MemoryError('out of memory')                   # ... then died
    graph.step = failing
    with pytest.raises(MemoryError):
        graph(_x(fake, 2))
    assert graph.stats['dropped: an eager step failed'] == 1
    graph.step, holder.due = step, False
    assert graph(_x(fake, 1)) == 'captured'
    numpy.testing.assert_array_equal(weights, 3 + 5)


def test_buffer_signature_names_where_arrays_are():
    a = numpy.zeros((2, 3), numpy.float32)
    signature = graphs_step.buffer_signature([a, None, a.T])
    assert signature == ((a.ctypes.data, (2, 3), '<f4'),
                         (a.ctypes.data, (3, 2), '<f4'))
    b = a.copy()
    assert graphs_step.buffer_signature([b]) != signature[:1]


def test_warmup_set_on_the_graphed_optimizer_is_its_own_and_checked():
    """``stepper.warmup = n`` sets the graph's warm-up (it used to be
    forwarded to the optimizer, where nothing reads it) for the current
    loss function's signatures and for a later one's; a value that is not
    an integer of at least 1 is refused, as at construction."""
    from chainerkfac import graphs
    fake, optimizer, stepper, lossfun, other = _graphed_with_two_losses()
    assert stepper.update(lossfun, _x(fake, 1)) == 'eager'
    stepper.warmup = 3
    assert 'warmup' not in vars(optimizer)
    assert stepper.warmup == 3 and stepper.graph.warmup == 3
    assert [stepper.update(lossfun, _x(fake, 1)) for _ in range(3)] == [
        'eager', 'eager', 'captured']
    assert [stepper.update(other, _x(fake, 1)) for _ in range(4)] == [
        'eager', 'eager', 'eager', 'captured']
    for bad in (0, 2.5, True, '3', None):
        with pytest.raises(ValueError, match='warmup'):
            stepper.warmup = bad
        with pytest.raises(ValueError, match='warmup'):
            graphs.graphed(optimizer, warmup=bad, cupy=fake)
    assert stepper.warmup == 3
    stepper.lr = 0.05                       # the rest still forwards
    assert optimizer.lr == 0.05 and 'lr' not in vars(stepper)

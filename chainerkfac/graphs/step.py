"""Capture a steady-state training step once as a CUDA graph and replay it.

:class:`StepGraph` wraps a function that takes one whole step (forward,
backward, update) on given input arrays. Each call decides:

* **eager**, the step as it is, when a refusal holds (inputs not CuPy
  arrays; the optimizer's step cannot be replayed, e.g. an update rule
  whose kernel reads a host value that changes every step — the adapter
  says why), for the first ``warmup`` steps of an input signature (shapes,
  dtypes, device: CuPy compiles its kernels, cuDNN's plans are built, the
  memory pool warms), and after a capture failed for that signature;
* **captured**: the inputs are copied into static buffers, the step runs
  once on a side stream under ``stream.begin_capture()`` with a memory
  pool of the graphs' own (what the step allocates stays the graph's), and
  the graph is launched — capture records work without running it. The
  pool is one per :class:`StepGraph`, reused by every capture: a dropped
  graph's memory serves the next capture. (A new pool per capture grew
  the device memory by 1.7 GB per capture on ResNet-50 at batch 32, H200,
  2026-11-26.) A CuPy pool that is merely dropped never gives its cached
  blocks back (CuPy 14.1's free-chunk index keeps them from the garbage
  collector), so a closed StepGraph's pool is emptied and, while arrays
  cut from it live on, kept until they are gone (:func:`_retire`).
* **replayed**: the inputs are copied into the static buffers and the
  graph is launched; the adapter then does the step's host-side
  bookkeeping (``optimizer.t``, each rule's ``t``), which no replay runs,
  and what the captured step reported (:mod:`chainer.reporter`: the loss,
  the accuracy, as device arrays the replay rewrites) is reported again.

Before every step, replayed or not, the adapter's ``before_step`` writes
the host values that the kernels read from device memory (learning rate,
momentum, damping: :mod:`chainerkfac.graphs.hyper`), so a schedule does
not force a new capture. The adapters: :class:`ChainerOptimizer` (a
Chainer optimizer), :class:`chainerkfac.graphs.guarded_step.
GuardedOptimizer` and :class:`chainerkfac.graphs.kfac_step.KFACOptimizer`
(K-FAC: its refresh steps run eagerly, its stale steps are replayed);
:func:`chainerkfac.graphs.graphed` picks one.

A graph is dropped (and the next eligible step captured again, without
warm-up) when an eager step ran after it (an eager step may reallocate
what the graph reads), when the inputs' signature changes, when a host
value baked into the graph's kernels changed (the adapter's
:meth:`~ChainerOptimizer.baked`: which parameters are updated, learning
rate and momentum unless they are on the device, a hook's rate), when a
host value of the model that its forward pass reads changed
(:func:`model_host_values`: ``chainer.config.train``, and every link's
plain attributes — a BatchNormalization's ``decay``, ``eps`` and ``N``,
a Chain's own dropout ratio), and when an array the graph reads is no
longer where the capture found it (the adapter's ``graph_buffers()``,
checked before every replay: a parameter's array or an update rule's
state replaced, new update rules). A host value of the model that
changes at every step (BatchNormalization in fine-tune mode counts
``N``) makes the steps run eagerly while it does. An adapter may keep
its graph through an eager step it names (``keeps_graph(reason)``:
K-FAC's refresh steps, whose new inverses go into the arrays the graph
reads): the graph is kept where every buffer the adapter lists
(``graph_buffers()``: addresses, shapes, dtypes) is where it was at the
capture, else dropped. The eager step left its own outputs in the
Python objects (a parameter's gradient, the model's loss); after the
next replay the references the
capture had made (every array or Variable attribute of the adapter's
``step_objects()`` that the capture set) are put back, as a replay
rewrites those arrays. A StepGraph may have children (``parent=``): a
graph of part of the parent's eager steps (K-FAC's refresh steps'
passes and end), on the parent's side stream and pool, which checks its
adapter's ``graph_buffers()`` before each replay (the parent's steps ran
in between) and rebinds its outputs after each. The side stream
waits for the current stream before each capture or launch and the
current stream for it after, so the code around the step needs no change.
Within a :class:`StepGraph` call, Chainer's Linear and ``cupy.matmul``
compute with :mod:`chainerkfac.graphs.gemm` (CuPy's own cuBLAS refuses
capture), eager steps too, so that eager and replayed steps make the same
GEMM calls.

What must not happen inside the step (as for PyTorch's
``torch.cuda.graphs``): a host synchronisation (``.get()``, ``float()`` of
a device array, a finite check read on the host), a copy from pageable
host memory, a new cuBLAS call through CuPy, Python control flow that
depends on device values. (Python values the step reads that are neither
the optimizer's nor attributes of the model's links — a global or a
closure's variable in the loss function or ``forward``, a Python branch
on them — are what the capture saw, at every replay: pass them as link
attributes, or run such steps eagerly.) A step that does one of the former
fails to capture:
the failure is logged with CUDA's reason, the optimizer's host state is
put back, the step runs eagerly and its signature is not captured
again. A capture that ran out of device memory is tried once more
first, after the free
blocks that CuPy's default pool (the eager steps' cache) and the graph's
own pool hold are given back.
:attr:`StepGraph.stats` counts eager, captured and replayed steps and
each refusal's reason; :attr:`StepGraph.capture_seconds` times each
capture.
"""
import collections
import contextlib
import functools
import logging
import numbers
import time
import weakref
from typing import Callable, List, Optional, Sequence

import numpy

import chainer

from chainerkfac import device_guard
from chainerkfac.graphs import hyper

logger = logging.getLogger(__name__)

#: Eager steps of a signature before it is captured (CuPy's kernels are
#: compiled, plans built and the pool warm after the first; the probe of
#: the issue captured after 3).
WARMUP = 3


class ChainerOptimizer:
    """What :class:`StepGraph` needs to know of a Chainer optimizer whose
    update it captures.

    Replayable: :class:`chainer.GradientMethod` with every update rule a
    :class:`chainer.optimizers.MomentumSGDRule` or ``SGDRule`` (their
    kernels read the hyperparameters alone) and no optimizer hooks but
    those of ``replayable_hooks``.

    Parameters
    ----------
    optimizer : chainer.GradientMethod
    hyperparameters_on_device : bool
        The rules read ``lr`` and ``momentum`` from device memory, written
        before each step (:mod:`chainerkfac.graphs.hyper`): a schedule
        needs no new capture. Otherwise they are baked into the graph,
        which is captured again when they change.
    replayable_hooks : sequence of type
        Hook types whose kernels read only their own attributes (e.g.
        :class:`chainer.optimizer_hooks.WeightDecay`: ``g += rate * p``);
        those attributes are part of :meth:`baked`.
    """

    #: The hyperparameters that go to the device.
    ON_DEVICE = ('lr', 'momentum')

    def __init__(self, optimizer, hyperparameters_on_device: bool = False,
                 replayable_hooks: Sequence[type] = ()):
        self.optimizer = optimizer
        self.hyperparameters_on_device = hyperparameters_on_device
        self.replayable_hooks = tuple(replayable_hooks)
        self._scalars = None
        self._walk = ParameterWalk(optimizer)

    def _rules(self):
        return [p.update_rule for p in self._walk()]

    def refusal(self) -> Optional[str]:
        """Why its step cannot be replayed, or None."""
        from chainer import optimizers
        why = loss_scaling_refusal(self.optimizer)
        if why is not None:
            return why
        replayable = (optimizers.momentum_sgd.MomentumSGDRule,
                      optimizers.sgd.SGDRule)
        rules = self._rules()
        others = sorted({type(r).__name__ for r in rules
                         if not isinstance(r, replayable)})
        if others:
            return ('update rules {} are not known to read only their '
                    'hyperparameters'.format(', '.join(others)))
        hooks = sorted(name for name, hook in
                       update_hooks(self.optimizer, rules)
                       if not isinstance(hook, self.replayable_hooks))
        if hooks:
            return 'optimizer hooks ({}) are not replayable'.format(
                ', '.join(hooks))
        return None

    def capture_refusal(self) -> Optional[str]:
        """Why the step, eligible otherwise, is not captured now (it runs
        eagerly): an update rule without state yet (new rules, after the
        warm-up) — its first update makes the state, zeros a capture would
        record and make again at every replay, and the guard decides such
        a step on the host."""
        if any(p.update_rule.enabled and p.update_rule.state is None and
               p.array is not None for p in self._walk()):
            return ('an update rule without state yet (new rules: its '
                    'first update makes it)')
        return None

    def baked(self) -> tuple:
        """The host values the captured kernels hold: which rules update
        their parameter (a link frozen with ``disable_update()``, or
        updated again, captures again), every rule's hyperparameters (but
        those on the device) and the replayable hooks' attributes."""
        device = self.ON_DEVICE if self.hyperparameters_on_device else ()
        rules = self._rules()
        return (tuple(r.enabled for r in rules),) + tuple(
            baked_hyperparameters(rules, device)) + tuple(
            (name, tuple(sorted(vars(hook).items())))
            for name, hook in update_hooks(self.optimizer, rules))

    def before_step(self) -> None:
        """Write the hyperparameters into device memory (with
        ``hyperparameters_on_device``), binding new rules to it."""
        if not self.hyperparameters_on_device:
            return
        hyperparam = self.optimizer.hyperparam
        names = [n for n in self.ON_DEVICE if hasattr(hyperparam, n)]
        params = [p for p in self._walk() if p.array is not None]
        if not params:
            return
        if self._scalars is None:
            self._scalars = hyper.DeviceScalars(names, params[0].device)
        hyper.bind_rule_hyperparameters(params, self._scalars, names)
        self._scalars.write({n: getattr(hyperparam, n) for n in names})

    def graph_buffers(self) -> tuple:
        """Where a captured step reads and writes what the code around it
        could replace: the parameters, their update rules' states, the
        model's persistent arrays (the running statistics)."""
        return buffer_signature(
            device_guard._update_arrays(self._walk()) +
            device_guard._persistent_arrays(self.optimizer.target))

    def after_capture(self, before) -> None:
        """Nothing to learn from a capture (every enabled rule advances
        its ``t`` at every step)."""

    def host_state(self) -> tuple:
        return self.optimizer.t, [r.t for r in self._rules()]

    def restore_host_state(self, state) -> None:
        t, rule_ts = state
        self.optimizer.t = t
        for rule, rule_t in zip(self._rules(), rule_ts):
            rule.t = rule_t

    def after_replay(self) -> None:
        """What ``update()`` does on the host and a replay does not."""
        self.optimizer.t += 1
        for rule in self._rules():
            if rule.enabled:
                rule.t += 1


def update_hooks(optimizer, rules) -> List:
    """``(name, hook)`` of the pre- and post-update hooks of ``optimizer``
    and of its update ``rules`` (Chainer keeps them in a private
    hookable)."""
    hooks = []
    for owner in [optimizer] + list(rules):
        hookable = owner._hookable
        if hookable._pre_update_hooks or hookable._post_update_hooks:
            hooks += list(hookable._pre_update_hooks.items()) + list(
                hookable._post_update_hooks.items())
    return hooks


class ParameterWalk:
    """The parameters of ``optimizer.target`` that have an update rule, in
    the model's own order (stable while the model is unchanged; no names
    built and sorted), with the model walked once per optimizer step: a
    replayed step's adapter calls (``before_step``, ``refusal``,
    ``baked``) share one walk (of ResNet-50's 161 parameters: 0.07 ms on
    a 2-core Xeon, once instead of three or four times before the
    launch). A new step (``optimizer.t``) or target walks again; each
    parameter's update rule is read at every call."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._t = None
        self._target = None
        self._params = []

    def __call__(self) -> List:
        optimizer = self.optimizer
        target = optimizer.target
        if optimizer.t != self._t or target is not self._target:
            self._params = list(target.params())
            self._t, self._target = optimizer.t, target
        return [p for p in self._params if p.update_rule is not None]


def baked_hyperparameters(rules, skip=()) -> List[tuple]:
    """Per rule, its hyperparameters (its own over its optimizer's) but
    those named in ``skip``, as sorted ``(name, value)`` tuples: what
    ``sorted(rule.hyperparam.get_dict().items())`` gives, each parent's
    read once for all its rules (this runs before every replayed step)."""
    parents = {}
    baked = []
    for rule in rules:
        hyperparam = rule.hyperparam
        parent = hyperparam.parent
        inherited = parents.get(id(parent))
        if inherited is None:
            values = {} if parent is None else {
                k: v for k, v in parent.get_dict().items() if k not in skip}
            inherited = parents[id(parent)] = (
                values, tuple(sorted(values.items())))
        # a rule's own value counts, unless it is a device view it was
        # given (hyper.bind_rule_hyperparameters)
        device = getattr(rule, 'device_hyperparameters', skip)
        own = [(k, v) for k, v in hyperparam.__dict__.items()
               if k != '_parent' and k not in device]
        if own:
            merged = dict(inherited[0])
            merged.update(own)
            baked.append(tuple(sorted(merged.items())))
        else:
            baked.append(inherited[1])
    return baked


def checked_warmup(value) -> int:
    """``value`` as a number of warm-up steps (:attr:`StepGraph.warmup`).

    Raises
    ------
    ValueError
        For anything but an integer of at least 1.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError('warmup must be an integer, got {!r}'.format(value))
    if value < 1:
        raise ValueError('warmup must be at least 1 (the first step of a '
                         'signature builds what capture must not), got '
                         '{}'.format(value))
    return int(value)


class StepGraph:
    """One training step, captured once per input signature and replayed
    (module docstring).

    Parameters
    ----------
    step : callable
        ``step(*inputs)``: one whole step on these arrays.
    adapter : ChainerOptimizer
        Of the optimizer the step updates.
    warmup : int
        Eager steps of a signature before its capture.
    cupy : module, optional
        CuPy (the tests pass a stand-in).
    route_linear : callable, optional
        A context manager routing the step's GEMMs (Chainer's Linear,
        ``cupy.matmul``) through capturable ones around every step
        (default :func:`chainerkfac.graphs.gemm.route_step`).
    parent : StepGraph, optional
        A graph of part of ``parent``'s eager steps (K-FAC's refresh
        steps' passes and end, :mod:`chainerkfac.graphs.kfac_step`): it
        captures on ``parent``'s side stream into ``parent``'s memory pool
        (one pool for all: they are never replayed at once, and what one
        step's replay writes is read before another's next replay), its
        counts go into ``parent``'s :attr:`stats` with ``label`` before
        each key, and its GEMMs are routed by ``parent``'s eager step that
        calls it.
    label : str
        See ``parent``.
    """

    def __init__(self, step: Callable, adapter, warmup: int = WARMUP,
                 cupy=None, route_linear=None,
                 parent: Optional['StepGraph'] = None, label: str = ''):
        self.step = step
        self.adapter = adapter
        self.warmup = warmup
        self.parent = parent
        self.label = label
        #: The live children (``parent=self``): graphs on this one's pool.
        self._children = weakref.WeakSet()
        if parent is not None:
            parent._children.add(self)
            cupy = parent._cupy
            route_linear = contextlib.nullcontext    # the parent routes
            if cupy is None:
                self._no_cupy = parent._no_cupy
        if cupy is None and parent is None:
            try:
                import cupy
            except ImportError as error:    # a CPU machine: every step eager
                cupy = None
                self._no_cupy = 'CuPy cannot be imported ({}: {})'.format(
                    type(error).__name__, error)
        self._cupy = cupy
        if route_linear is None and cupy is None:
            route_linear = contextlib.nullcontext     # nothing to route
        elif route_linear is None:
            from chainerkfac.graphs import gemm
            route_linear = functools.partial(gemm.route_step, cupy)
        self._route_linear = route_linear
        self._signature = None
        self._warm = 0
        self._graph = None
        self._baked = None
        self._static = ()
        self._pool = None
        self._stream = None
        self._finalizer = None
        self._failed = set()
        self._reported = {}
        self._buffers = None
        self._outputs = []
        self._rebind = False
        # a child checks its buffers before each replay and rebinds its
        # outputs after it (its parent's steps ran in between)
        self._verify = parent is not None
        # any graph checks its adapter's buffers before each replay (the
        # code around the steps may replace an array)
        self._check_buffers = hasattr(adapter, 'graph_buffers')
        # the model's host values (model_host_values) at the capture and
        # at the last step, and how many steps in a row they changed
        self._host = None
        self._last_host = None
        self._host_before = None
        self._host_moves = 0
        #: Counts: 'eager', 'captured', 'replayed', and each refusal and
        #: drop reason (``parent``'s, with ``label`` before each key).
        self.stats = collections.Counter() if parent is None else \
            parent.stats
        #: Wall seconds of each capture (with the first launch).
        self.capture_seconds: List[float] = []

    def _count(self, key: str) -> None:
        self.stats[self.label + key] += 1

    def __call__(self, *inputs) -> str:
        """Take one step on ``inputs``; returns ``'eager'``,
        ``'captured'`` or ``'replayed'``."""
        self.adapter.before_step()
        host = self._host_values()
        reason = self._refusal(inputs)
        if reason is None and self._host_moves >= HOST_MOVES:
            reason = ('host values of the model change at every step '
                      '({})'.format(self._host_changes(self._host_before,
                                                       host)))
        signature = self._signature_of(inputs) if reason is None else None
        if reason is None and signature in self._failed:
            reason = 'its capture failed before'
        if reason is not None:
            return self._eager(inputs, reason)
        if signature != self._signature:
            if self._signature is not None:
                self._drop('input signature changed')
            self._signature, self._warm = signature, 0
        baked = self.adapter.baked()
        if self._graph is not None and baked != self._baked:
            self._drop('hyperparameters changed')
        if self._graph is not None and host != self._host:
            self._drop('a host value of the model changed ({})'.format(
                self._host_changes(self._host, host)))
        if self._graph is not None and self._check_buffers and \
                self.adapter.graph_buffers() != self._buffers:
            # moved by a step this graph did not see (a parent's), or by
            # the code around the steps (a state or an array replaced)
            self._drop('its buffers moved')
        if self._graph is not None:
            self._launch(inputs)
            if self._rebind or self._verify:
                # the captured step's outputs, which the replay rewrote
                for owner, name, value in self._outputs:
                    vars(owner)[name] = value
                self._rebind = False
            observation = _observation()
            if observation is not None:
                observation.update(self._reported)
            self.adapter.after_replay()
            self._count('replayed')
            return 'replayed'
        if self._warm < self.warmup:
            self._warm += 1
            return self._eager(inputs, None)
        refusal = getattr(self.adapter, 'capture_refusal', None)
        why = refusal() if refusal is not None else None
        if why is not None:
            return self._eager(inputs, why)
        return self._capture(inputs, signature, baked, host)

    @property
    def warmup(self) -> int:
        """Eager steps of a signature before its capture: an integer, at
        least 1 (the first step of a signature builds what capture must
        not). A new value counts for the signatures not captured yet."""
        return self._warmup

    @warmup.setter
    def warmup(self, value: int) -> None:
        self._warmup = checked_warmup(value)

    # -- the model's host values ------------------------------------------
    def _host_values(self) -> tuple:
        """:func:`model_host_values` of the adapter's model now, counting
        the steps in a row at which they changed."""
        host = model_host_values(self._model())
        if self._last_host is not None and host != self._last_host:
            self._host_moves += 1
            self._host_before = self._last_host
        else:
            self._host_moves = 0
        self._last_host = host
        return host

    def _host_changes(self, old, new) -> str:
        """Which of the model's host values differ (their names)."""
        return ', '.join(host_value_changes(self._model(), old, new)[:4])

    def _model(self):
        """The model the step trains: the adapter's ``optimizer.target``
        (None where it has none)."""
        return getattr(getattr(self.adapter, 'optimizer', None), 'target',
                       None)

    # -- the three ways ---------------------------------------------------
    def _eager(self, inputs, reason) -> str:
        if reason is not None:
            self._count('eager: ' + reason)
        keep = self._graph is not None and self._keeps(reason)
        if self._graph is not None and not keep:
            self._drop('an eager step ran')
        try:
            with self._route_linear():
                self.step(*inputs)
            if keep:
                settle = getattr(self.adapter, 'after_kept_eager', None)
                if settle is not None:
                    settle()
                stayed = self.adapter.graph_buffers() == self._buffers
        except BaseException:
            # it may have moved a buffer before it failed: nothing checks
            # them now, so the graph goes
            if keep:
                self._drop('an eager step failed')
            raise
        self._count('eager')
        if keep:
            if stayed:
                self._count('kept through: ' + reason)
                self._rebind = True
            else:
                self._drop('an eager step moved its buffers ({})'.format(
                    reason))
        return 'eager'

    def _keeps(self, reason) -> bool:
        keeps = getattr(self.adapter, 'keeps_graph', None)
        return reason is not None and keeps is not None and \
            bool(keeps(reason))

    def _capture(self, inputs, signature, baked, values,
                 retry: bool = True) -> str:
        start = time.perf_counter()
        cuda = self._cupy.cuda
        self._stream, self._pool = self._resources()
        self._static = tuple(self._cupy.empty(a.shape, a.dtype)
                             for a in inputs)
        pool = self._pool
        host = self.adapter.host_state()
        keeps = getattr(self.adapter, 'keeps_graph', None) is not None or \
            self._verify
        before = _attributes(self.adapter.step_objects()) if keeps else []
        main = cuda.get_current_stream()
        observation = _observation()
        reported = dict(observation or {})
        failure = None
        with self._on_side_stream(main):
            for static, array in zip(self._static, inputs):
                static[...] = array
            try:
                with cuda.using_allocator(pool.malloc), \
                        self._route_linear():
                    self._stream.begin_capture()
                    try:
                        self.step(*self._static)
                    except BaseException:
                        # CUDA may refuse to end it too: the step's error
                        # is the one to report
                        with contextlib.suppress(Exception):
                            self._stream.end_capture()
                        raise
                    graph = self._stream.end_capture()
            except Exception as error:   # CUDA's refusal, in its words
                failure = error
            else:
                graph.launch(self._stream)
        if failure is not None:
            self.adapter.restore_host_state(host)
            self._static = ()
            if retry and _out_of_memory(failure):
                # the pool's free blocks include what the other live graphs
                # on it use at each replay (a capture's temporaries go back
                # to the pool when Python drops them): those graphs go first
                for other in self._on_the_same_pool():
                    other._drop('the memory pool was given back (a capture '
                                'on it ran out of memory)')
                freed = self._free_cached_blocks()
                logger.warning('CUDA graph: the capture ran out of device '
                               'memory (%s); %d MiB of cached free blocks '
                               'given back, capturing once more', failure,
                               freed >> 20)
                self._count('capture out of memory')
                return self._capture(inputs, signature, baked, values,
                                     retry=False)
            self._failed.add(signature)
            logger.warning('CUDA graph: the step could not be captured '
                           '(%s: %s); it runs eagerly',
                           type(failure).__name__, failure)
            self._count('capture failed')
            return self._eager(inputs, 'capture failed')
        self._graph, self._baked, self._host = graph, baked, values
        # What the step reported (device arrays that every replay
        # rewrites, and host values the adapter reports again itself).
        self._reported = {k: v for k, v in (observation or {}).items()
                          if k not in reported or reported[k] is not v}
        if keeps or self._check_buffers:
            # what the graph reads
            self._buffers = self.adapter.graph_buffers()
        if keeps:
            # the outputs it left in Python
            self._outputs = _outputs(before, self._cupy.ndarray)
            self._rebind = False
        # The Variables the capture left (``L.Classifier``'s loss and
        # predictions; the reporter keeps copies without the graph) hold
        # its forward pass: every array kept for the backward one. Cut off,
        # those arrays go back to the pool, for the next capture on it too
        # (a replay writes them before it reads them), instead of a copy of
        # the activations kept per graph on the pool.
        _cut_from_graph(list(self._reported.values()) +
                        [value for _, _, value in self._outputs])
        self.adapter.after_capture(host)
        self._count('captured')
        self.capture_seconds.append(time.perf_counter() - start)
        return 'captured'

    def _resources(self) -> tuple:
        """The side stream and the graphs' memory pool (a child's are its
        parent's), made at the first capture."""
        if self.parent is not None:
            return self.parent._resources()
        if self._stream is None:
            _sweep_retired()
            cuda = self._cupy.cuda
            self._stream = cuda.Stream(non_blocking=True)
            self._pool = cuda.MemoryPool()
            # the workspaces cuDNN and cuBLAS keep for this stream are cut
            # from this graph's pool: let them go with the StepGraph, then
            # the pool's blocks (_retire)
            self._finalizer = weakref.finalize(
                self, self._release, self._stream.ptr, self._pool)
            self._finalizer.atexit = False   # the process's memory goes
        return self._stream, self._pool

    def _on_the_same_pool(self) -> List['StepGraph']:
        """The other live graphs that capture into this one's pool: its
        parent's family (the parent and its children)."""
        root = self.parent if self.parent is not None else self
        return [g for g in [root, *root._children] if g is not self]

    def _free_cached_blocks(self) -> int:
        """Give the free blocks of CuPy's default pool and of the graph's
        own back to the device (each pool frees only its own when an
        allocation fails, and the eager steps' cache is the default
        pool's); returns the bytes freed."""
        pools = [self._cupy.get_default_memory_pool(), self._pool]
        before = sum(p.total_bytes() for p in pools)
        for pool in pools:
            pool.free_all_blocks()
        return before - sum(p.total_bytes() for p in pools)

    def _launch(self, inputs) -> None:
        main = self._cupy.cuda.get_current_stream()
        with self._on_side_stream(main):
            for static, array in zip(self._static, inputs):
                static[...] = array
            self._graph.launch(self._stream)

    @contextlib.contextmanager
    def _on_side_stream(self, main):
        self._stream.wait_event(main.record())
        try:
            with self._stream:
                yield
        finally:
            main.wait_event(self._stream.record())

    # -- decisions --------------------------------------------------------
    def _refusal(self, inputs) -> Optional[str]:
        if self._cupy is None:
            return self._no_cupy
        if not all(isinstance(a, self._cupy.ndarray) for a in inputs):
            return 'inputs are not CuPy arrays'
        return self.adapter.refusal()

    def _signature_of(self, inputs: Sequence) -> tuple:
        return (self._cupy.cuda.runtime.getDevice(),) + tuple(
            (tuple(a.shape), a.dtype.str) for a in inputs)

    def close(self) -> None:
        """Drop the graph and let go of its memory: the pool, the side
        stream, and the workspaces the cuDNN backend and the GEMMs keep for
        that stream (cut from the pool, they would keep part of it alive).
        Also done when the StepGraph is garbage-collected; a later step
        captures afresh. The adapter's ``close()``, where it has one, closes
        the graphs of its own (a child's pool and stream are its
        parent's)."""
        closer = getattr(self.adapter, 'close', None)
        if closer is not None:
            closer()
        self._drop('closed')
        self._pool = self._stream = None
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    @staticmethod
    def _release(stream: int, pool) -> None:
        from chainerkfac.cudnn import runtime
        from chainerkfac.graphs import gemm
        if runtime._current is not None:
            runtime._current.release_stream(stream)
        if gemm._gemm is not None:
            gemm._gemm.release_stream(stream)
        _retire(pool)

    def _drop(self, why: str) -> None:
        if self._graph is not None:
            self._count('dropped: ' + why)
            forget = getattr(self.adapter, 'after_drop', None)
            if forget is not None:
                forget()        # what it kept of the capture
        self._graph = self._baked = self._host = None   # the pool serves
        # the next one
        self._static = ()
        self._reported = {}
        self._buffers = None
        self._outputs = []
        self._rebind = False


def loss_scaling_refusal(optimizer) -> Optional[str]:
    """Why a step with Chainer's loss scaling is not replayed, or None: the
    backward starts from the scale, a host number a graph would keep (and
    the dynamic scale is decided from a host check of the gradients)."""
    if getattr(optimizer, '_loss_scale', None) is not None:
        return 'loss scaling (the backward starts from a host number)'
    return None


def _attributes(objects) -> List[tuple]:
    """``(object, {name: value})`` of each object's instance attributes
    (a shallow copy: what the capture will change)."""
    return [(owner, dict(vars(owner))) for owner in objects]


def _outputs(before, array_type) -> List[tuple]:
    """``(object, name, value)`` of each attribute the capture set to an
    array of ``array_type`` or a Variable (a parameter's gradient, the
    model's loss): what a replay rewrites."""
    out = []
    for owner, old in before:
        for name, value in vars(owner).items():
            if old.get(name, None) is value:
                continue
            if isinstance(value, array_type) or (
                    isinstance(value, chainer.Variable) and
                    isinstance(value.array, array_type)):
                out.append((owner, name, value))
    return out


def _cut_from_graph(values) -> None:
    """Cut each Variable among ``values`` from the computational graph
    that made it (:meth:`chainer.Variable.unchain_backward`): what its
    functions kept for the backward pass is let go."""
    for value in values:
        if isinstance(value, chainer.Variable):
            value.unchain_backward()


#: Steps in a row at which the model's host values changed before the
#: steps run eagerly (while they go on changing; a capture per step would
#: cost more than the eager steps).
HOST_MOVES = 3

#: The types of the link attributes :func:`model_host_values` reads.
_HOST_TYPES = frozenset([bool, int, float, str, type(None), numpy.bool_,
                         numpy.int32, numpy.int64, numpy.float16,
                         numpy.float32, numpy.float64])


def model_host_values(target) -> tuple:
    """The host values of ``target`` (the model) that a forward pass may
    read and a captured step holds: ``chainer.config.train`` (Chainer's
    BatchNormalization and dropout branch on it), then, link by link in
    ``target.links()`` order, each public attribute holding a bool, a
    number, a string or None, or a tuple of these (a BatchNormalization's
    ``decay``, ``eps``, ``N``; a Chain's own ``ratio``; a convolution's
    ``stride``). A change of any drops the graph. (ResNet-50's 778 such
    values: 0.23 ms a step on a 2-core Xeon.) ``target`` None: the
    configuration alone."""
    values = [chainer.config.train]
    for link in () if target is None else target.links():
        values += [value for _, value in _host_items(link)]
    return tuple(values)


def host_value_changes(target, old, new) -> List[str]:
    """The names (``'config.train'``, ``'/predictor/bn.decay'``) of the
    values of :func:`model_host_values` that differ between ``old`` and
    ``new`` (taken of ``target``); ``"the model's links"`` where they are
    not values of the same links."""
    names = ['config.train']
    for path, link in () if target is None else target.namedlinks():
        names += ['{}.{}'.format(path, name) for name, _ in _host_items(link)]
    if old is None or not len(old) == len(new) == len(names):
        return ["the model's links"]
    return [n for n, a, b in zip(names, old, new) if a != b]


def _host_items(link) -> List[tuple]:
    """``(name, value)`` of the attributes of ``link`` (not its children's)
    that :func:`model_host_values` reads."""
    types = _HOST_TYPES
    return [(name, value) for name, value in vars(link).items()
            if name[0] != '_' and name != 'name' and (
                type(value) in types or (type(value) is tuple and all(
                    type(v) in types for v in value)))]


def buffer_signature(arrays) -> tuple:
    """``(address, shape, dtype)`` of each array (None skipped): where a
    captured graph finds its buffers."""
    out = []
    for array in arrays:
        if array is None:
            continue
        ptr = getattr(getattr(array, 'data', None), 'ptr', None)
        if ptr is None:
            ptr = array.__array_interface__['data'][0]
        out.append((ptr, array.shape, array.dtype.str))
    return tuple(out)


#: Pools of closed StepGraphs that still hold blocks (arrays cut from them
#: are alive: a gradient made by the last capture, say).
_retired = []


def _retire(pool) -> None:
    """Give a closed StepGraph's pool back to the device. A CuPy pool that
    is merely dropped keeps its cached blocks allocated for the life of
    the process (since CuPy 14.1 its free chunks are held by an index the
    garbage collector cannot see, and an array freed after its pool is
    gone is never returned): so its free blocks are freed now, and a pool
    still holding live arrays is kept until they are gone
    (:func:`_sweep_retired`)."""
    pool.free_all_blocks()
    if pool.total_bytes():
        _retired.append(pool)


def _sweep_retired() -> None:
    """Free what the retired pools' arrays have given back since; forget
    the pools that hold nothing. Before each new StepGraph's first
    capture."""
    for pool in list(_retired):
        pool.free_all_blocks()
        if not pool.total_bytes():
            _retired.remove(pool)


def _out_of_memory(error: BaseException) -> bool:
    """Whether a failed capture ran out of device memory: CuPy's
    ``OutOfMemoryError`` (a ``MemoryError``), CUDA's or a library's
    allocation status, also as the context of what the pool's clean-up
    raised in turn (CuPy frees cached blocks when ``cudaMalloc`` fails,
    which CUDA refuses while a stream captures)."""
    markers = ('cudaErrorMemoryAllocation', 'out of memory',
               'STATUS_ALLOC_FAILED')
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, MemoryError) or any(
                m in str(error) for m in markers):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


def _observation():
    """The current reporter's observation (a Trainer's iteration), or
    None outside any reporter."""
    try:
        return chainer.reporter.get_current_reporter().observation
    except IndexError:
        return None

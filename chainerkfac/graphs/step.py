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
  pool of the graph's own (what the step allocates stays the graph's), and
  the graph is launched — capture records work without running it;
* **replayed**: the inputs are copied into the static buffers and the
  graph is launched; the adapter then does the step's host-side
  bookkeeping (``optimizer.t``, each rule's ``t``), which no replay runs.

A graph is dropped (and the next eligible step captured again, without
warm-up) when an eager step ran after it (an eager step may reallocate
what the graph reads), when the inputs' signature changes, and when a
host value baked into the graph's kernels changed (the adapter's
:meth:`~ChainerOptimizer.baked`: learning rate, momentum). The side stream
waits for the current stream before each capture or launch and the
current stream for it after, so the code around the step needs no change.
Within a :class:`StepGraph` call, Chainer's Linear computes with
:mod:`chainerkfac.graphs.gemm` (CuPy's own cuBLAS refuses capture), eager
steps too, so that eager and replayed steps make the same GEMM calls.

What must not happen inside the step (as for PyTorch's
``torch.cuda.graphs``): a host synchronisation (``.get()``, ``float()`` of
a device array, a finite check read on the host), a copy from pageable
host memory, a new cuBLAS call through CuPy, Python control flow that
depends on device values. Such a step fails to capture: the failure is
logged with CUDA's reason, the optimizer's host state is put back, the
step runs eagerly and its signature is not captured again.
:attr:`StepGraph.stats` counts eager, captured and replayed steps and
each refusal's reason.
"""
import collections
import contextlib
import logging
from typing import Callable, Optional, Sequence

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
    kernels read the hyperparameters alone) and no optimizer hooks.

    Parameters
    ----------
    optimizer : chainer.GradientMethod
    """

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def _rules(self):
        return [p.update_rule for _, p in
                sorted(self.optimizer.target.namedparams())
                if p.update_rule is not None]

    def refusal(self) -> Optional[str]:
        """Why its step cannot be replayed, or None."""
        from chainer import optimizers
        replayable = (optimizers.momentum_sgd.MomentumSGDRule,
                      optimizers.sgd.SGDRule)
        others = sorted({type(r).__name__ for r in self._rules()
                         if not isinstance(r, replayable)})
        if others:
            return ('update rules {} are not known to read only their '
                    'hyperparameters'.format(', '.join(others)))
        hooks = []   # Chainer keeps them in a private hookable
        for owner in [self.optimizer] + self._rules():
            hookable = owner._hookable
            hooks += list(hookable._pre_update_hooks) + list(
                hookable._post_update_hooks)
        if hooks:
            return 'optimizer hooks ({}) are not replayable'.format(
                ', '.join(sorted(hooks)))
        return None

    def baked(self) -> tuple:
        """The host values the captured kernels hold: every rule's
        hyperparameters."""
        return tuple(tuple(sorted(r.hyperparam.get_dict().items()))
                     for r in self._rules())

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
        A context manager routing Chainer's Linear through capturable
        GEMMs around every step (default
        :func:`chainerkfac.graphs.gemm.route_linear`).
    """

    def __init__(self, step: Callable, adapter, warmup: int = WARMUP,
                 cupy=None, route_linear=None):
        if warmup < 1:
            raise ValueError('warmup must be at least 1 (the first step of '
                             'a signature builds what capture must not)')
        self.step = step
        self.adapter = adapter
        self.warmup = warmup
        if cupy is None:
            import cupy
        self._cupy = cupy
        if route_linear is None:
            from chainerkfac.graphs import gemm
            route_linear = gemm.route_linear
        self._route_linear = route_linear
        self._signature = None
        self._warm = 0
        self._graph = None
        self._baked = None
        self._static = ()
        self._pool = None
        self._stream = None
        self._failed = set()
        #: Counts: 'eager', 'captured', 'replayed', and each refusal and
        #: drop reason.
        self.stats = collections.Counter()

    def __call__(self, *inputs) -> str:
        """Take one step on ``inputs``; returns ``'eager'``,
        ``'captured'`` or ``'replayed'``."""
        reason = self._refusal(inputs)
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
        if self._graph is not None:
            self._launch(inputs)
            self.adapter.after_replay()
            self.stats['replayed'] += 1
            return 'replayed'
        if self._warm < self.warmup:
            self._warm += 1
            return self._eager(inputs, None)
        return self._capture(inputs, signature, baked)

    # -- the three ways ---------------------------------------------------
    def _eager(self, inputs, reason) -> str:
        if reason is not None:
            self.stats['eager: ' + reason] += 1
        if self._graph is not None:
            self._drop('an eager step ran')
        with self._route_linear():
            self.step(*inputs)
        self.stats['eager'] += 1
        return 'eager'

    def _capture(self, inputs, signature, baked) -> str:
        cuda = self._cupy.cuda
        self._stream = self._stream or cuda.Stream(non_blocking=True)
        self._static = tuple(self._cupy.empty(a.shape, a.dtype)
                             for a in inputs)
        pool = cuda.MemoryPool()
        host = self.adapter.host_state()
        main = cuda.get_current_stream()
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
            self._failed.add(signature)
            self._static = ()
            logger.warning('CUDA graph: the step could not be captured '
                           '(%s: %s); it runs eagerly',
                           type(failure).__name__, failure)
            self.stats['capture failed'] += 1
            return self._eager(inputs, 'capture failed')
        self._graph, self._baked, self._pool = graph, baked, pool
        self.stats['captured'] += 1
        return 'captured'

    def _launch(self, inputs) -> None:
        main = self._cupy.cuda.get_current_stream()
        with self._on_side_stream(main):
            for static, array in zip(self._static, inputs):
                static[...] = array
            self._graph.launch(self._stream)

    @contextlib.contextmanager
    def _on_side_stream(self, main):
        self._stream.wait_event(main.record())
        with self._stream:
            yield
        main.wait_event(self._stream.record())

    # -- decisions --------------------------------------------------------
    def _refusal(self, inputs) -> Optional[str]:
        if not all(isinstance(a, self._cupy.ndarray) for a in inputs):
            return 'inputs are not CuPy arrays'
        return self.adapter.refusal()

    def _signature_of(self, inputs: Sequence) -> tuple:
        return (self._cupy.cuda.runtime.getDevice(),) + tuple(
            (tuple(a.shape), a.dtype.str) for a in inputs)

    def _drop(self, why: str) -> None:
        if self._graph is not None:
            self.stats['dropped: ' + why] += 1
        self._graph = self._baked = self._pool = None
        self._static = ()

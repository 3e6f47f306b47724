"""K-FAC's stale steps replayed as a CUDA graph; its refresh steps run
eagerly.

A K-FAC step that refreshes no factor (a stale step, eqs. 22-23) launches
the same kernels on the same buffers every time: the forward and backward
passes, stage 5's preconditioning GEMMs (routed to capturable GEMMs by
:mod:`chainerkfac.graphs.gemm`), the skipped-step guard and eqs. (19)-(20).
:class:`KFACOptimizer` tells :class:`~chainerkfac.graphs.step.StepGraph`
so, and makes that step capturable:

* the guard is :class:`~chainerkfac.device_guard.DeviceStepGuard` (the
  finite check, its flag and the restore of a skipped step on the
  device);
* η, m (every update rule's) and γ (stage 5's eq. 13,
  :attr:`KFAC.device_damping <chainerkfac.optimizers.KFAC>`) are read from
  device memory, written before each step: the learning-rate and damping
  schedules need no new capture.

A refresh step (a factor due), the first step, a step after a restore
(the guard takes its checkpoint) and any step of an optimizer set up in a
way not replayed yet run eagerly, with the reason counted in
:attr:`StepGraph.stats`. An eager step drops the graph, but a refresh
step keeps it: the optimizer writes each refreshed inverse into its
predecessor's arrays where it fits them, and the stacked batches' slots
likewise (:attr:`KFAC.refill_inverses
<chainerkfac.optimizers.KFAC>`), so the replayed stale steps read the new
inverses where the captured one read the old. The graph is kept only
where every array stage 5 and the update read (the inverses, a Woodbury
inverse's arrays and ``1/γ``, the stacks, the parameters, their states,
the running statistics) is where the capture found it; otherwise (a
factor whose low-rank form changed its rank, say) it is dropped and the
next stale step captured again. (A capture took 0.1-0.2 s on ResNet-50
on an H100, once per refresh.) After a replay, :meth:`KFACOptimizer.
after_replay` does the step's host side: ``t``, the damping schedule, the
report (:meth:`KFAC.finish_replayed_step
<chainerkfac.optimizers.KFAC.finish_replayed_step>`), and the ``t`` of
the update rules the captured step advanced.

With ``refresh_steps`` (:func:`chainerkfac.graphs.graphed`'s option,
opt-in) a refresh step is replayed too but for its factors' average and
inverse stage: its forward and backward passes (with the capture of the
factors) from one graph (:class:`RefreshPasses`), then, after the eager
stages 3-4, its end (stage 5 and the update) from another
(:class:`RefreshUpdate`), both children of the stale steps' StepGraph.

Not replayed yet: several processes (the transport's collectives and its
agreement on the flag), ``acc_iters > 1``, ``loss_reduction='sum'``,
optimizer hooks, synchronised stage timers. The bounded step
(``kl_clip``, K-FAC's default) is: η and γ are read from the device, and
ν is computed there (:meth:`chainerkfac.step_bound.StepBound.
apply_on_device`), the same arithmetic as the host's.
"""
from typing import Dict, Optional

from chainerkfac import device_guard
from chainerkfac.device_guard import DeviceStepGuard
from chainerkfac.graphs import hyper, step


class KFACOptimizer:
    """What :class:`~chainerkfac.graphs.step.StepGraph` needs to know of a
    :class:`~chainerkfac.optimizers.KFAC` optimizer (module docstring).

    Parameters
    ----------
    optimizer : chainerkfac.optimizers.KFAC
        Set up with its model.
    refresh_steps : bool
        Replay the refresh steps too but for their inverse stage: their
        forward and backward passes (:class:`RefreshPasses`) and their
        end (:class:`RefreshUpdate`); the factors' average and inverses
        run eagerly in between.
    """

    #: The values written to the device before each step.
    NAMES = ('lr', 'momentum', 'damping')

    def __init__(self, optimizer, refresh_steps: bool = False):
        self.optimizer = optimizer
        self.refresh_steps = refresh_steps
        self._scalars = None
        self._advanced = []
        self._params = step.ParameterWalk(optimizer)
        self._reason = None
        # capture_refusal: the stateless rules at the last step, and
        # whether this one has new ones
        self._stateless = None
        self._new_stateless = False
        self._lossfun = None
        self._parent = None
        #: The graphs of the refresh steps' passes (children of the stale
        #: steps' StepGraph), by the factors due (a graph forms those), the
        #: latest used last: at most :data:`PASSES_GRAPHS`.
        self.passes_graphs: Dict[tuple, step.StepGraph] = {}

    def step_function(self, lossfun, graph: step.StepGraph):
        """The step :class:`~chainerkfac.graphs.step.StepGraph` ``graph``
        takes on its inputs: ``update(lossfun, *inputs)``; with
        ``refresh_steps``, a refresh step's passes go through a child
        graph of ``graph``, then :meth:`KFAC.finish_step
        <chainerkfac.optimizers.KFAC.finish_step>` with the step's end
        through another once the passes' gradients are a graph's.
        """
        opt = self.optimizer
        if not self.refresh_steps:
            return lambda *inputs: opt.update(lossfun, *inputs)
        self.close()
        self._lossfun, self._parent = lossfun, graph

        def take(*inputs):
            if self._reason != self.REFRESH or opt._checkpoint_due:
                # update() takes the guard's checkpoint (a restore)
                opt.update(lossfun, *inputs)
                return
            opt.timer.start()
            passes = self._passes_graph()
            how = passes(*inputs)
            # the gradients where a graph wrote them: the step's end may
            # be replayed too, from a graph of these passes' own
            opt.finish_step(passes.adapter.update_function(passes)
                            if how != 'eager' else None)
        return take

    def _passes_graph(self) -> step.StepGraph:
        """The passes' graph for the factors due now (made, and the least
        recently used closed beyond :data:`PASSES_GRAPHS`)."""
        key = RefreshPasses.due_key(self.optimizer)
        graph = self.passes_graphs.pop(key, None)
        if graph is None:
            if len(self.passes_graphs) >= PASSES_GRAPHS:
                oldest = next(iter(self.passes_graphs))
                self.passes_graphs.pop(oldest).close()
            opt, lossfun = self.optimizer, self._lossfun
            graph = step.StepGraph(
                lambda *inputs: opt.run_passes(lossfun, *inputs),
                RefreshPasses(opt, self._params, self),
                warmup=CHILD_WARMUP, parent=self._parent,
                label='refresh passes: ')
        self.passes_graphs[key] = graph      # the latest used last
        return graph

    def close(self) -> None:
        """Drop the refresh passes' graphs (their parent closes)."""
        for graph in self.passes_graphs.values():
            graph.close()
        self.passes_graphs = {}

    # -- decisions --------------------------------------------------------
    def refusal(self) -> Optional[str]:
        """Why the coming step runs eagerly, or None."""
        self._reason = self._refusal()
        return self._reason

    def _refusal(self) -> Optional[str]:
        opt = self.optimizer
        if opt.transport.size > 1:
            return ('K-FAC on {} processes (its collectives are not '
                    'captured yet)'.format(opt.transport.size))
        if opt.acc_iters != 1:
            return 'acc_iters={} (micro-batches are not captured yet)'.format(
                opt.acc_iters)
        if opt.loss_reduction != 'mean':
            return "loss_reduction='{}'".format(opt.loss_reduction)
        if opt.synchronize_stage_timers:
            return 'the stage timers synchronise the device'
        why = step.loss_scaling_refusal(opt)
        if why is not None:
            return why
        hooks = [name for name, _ in step.update_hooks(
            opt, [p.update_rule for p in self._params()])]
        if hooks:
            return 'optimizer hooks ({}) are not replayable'.format(
                ', '.join(sorted(set(hooks))))
        if not opt.started:
            return 'the first step (it sets up the transport and eq. 20)'
        # a link updated again (enable_update()) since the factors were
        # decided is due now, as update(lossfun) would decide
        opt._decide_again_if_unfrozen(True)
        if opt.refresh_due():
            return 'a refresh step (factors due)'
        if opt._checkpoint_due or not isinstance(opt.guard, DeviceStepGuard) \
                or not opt.guard.ready:
            return 'the guard takes its checkpoint (first step, or restored)'
        return None

    def capture_refusal(self) -> Optional[str]:
        """Why an eligible stale step is not captured now: an update rule
        without state that the step before did not have (new rules, after
        the warm-up): its first update makes the state, and the guard
        decides such a step on the host. (A head no loss reaches keeps a
        rule without state for good, and is replayed.)"""
        if self._new_stateless:
            return ('an update rule without state yet (new rules: its '
                    'first update makes it)')
        return None

    def _note_stateless_rules(self) -> None:
        """Which enabled rules have no state now, and whether one of them
        is new since the last step (:meth:`capture_refusal`)."""
        stateless = {id(p.update_rule) for p in self._params()
                     if p.update_rule.enabled and p.update_rule.state is None}
        seen = self._stateless
        self._new_stateless = seen is not None and bool(stateless - seen)
        self._stateless = stateless

    #: The eager step that keeps the graph (:meth:`keeps_graph`).
    REFRESH = 'a refresh step (factors due)'

    def keeps_graph(self, reason: str) -> bool:
        """A refresh step keeps the graph (its inverses go where the graph
        reads them); :class:`~chainerkfac.graphs.step.StepGraph` checks
        :meth:`graph_buffers` after it."""
        return reason == self.REFRESH

    def after_kept_eager(self) -> None:
        """After a refresh step that keeps the graph: every stacked batch
        of inverses up to date, also one the step did not precondition."""
        self.optimizer.refresh_inverse_stacks()

    def graph_buffers(self) -> tuple:
        """Where a captured stale step reads what an eager step could
        move: the inverses and their stacks, the parameters, their update
        rules' states, the model's persistent arrays (the running
        statistics)."""
        opt = self.optimizer
        # the parameters, states and statistics as the device guard copies
        # them (the arrays an update writes, the persistent ones)
        return step.buffer_signature(
            opt.inverse_buffers() +
            device_guard._update_arrays(self._params()) +
            device_guard._persistent_arrays(opt.target))

    def step_objects(self) -> list:
        """The objects whose array attributes a step sets (its outputs:
        the model's links' loss and predictions, each parameter's
        gradient, the bounded step's ν and metric)."""
        opt = self.optimizer
        objects = list(opt.target.links()) + list(opt.target.params())
        objects.append(opt)
        if opt.step_bound is not None:
            objects.append(opt.step_bound)
        return objects

    def baked(self) -> tuple:
        """The host values a captured stale step holds: which parameters
        it updates (a link frozen with ``disable_update()``, or updated
        again, captures again), ρ_BN, eq. (20)'s norms, which blocks have
        inverses, the bounded step's bound (None: no bound) and the
        parameters' hyperparameters of their own (a layer's own lr: the
        update's kernels and the bound read it)."""
        opt = self.optimizer
        bound = opt.step_bound
        params = self._params()
        return (tuple(p.update_rule.enabled for p in params),
                opt.rho_bn,
                tuple(getattr(p.update_rule, 'rescale_norm', None)
                      for p in params),
                tuple(b.has_inverses() for b in opt.blocks),
                None if bound is None else bound.kl_clip,
                tuple(step.baked_hyperparameters(
                    [p.update_rule for p in params], ('lr', 'momentum'))))

    # -- before and after a step ------------------------------------------
    def before_step(self) -> None:
        """Install the device guard and the device hyperparameters (once
        the parameters exist), then write η, m and γ to the device."""
        self._reason = None
        self._note_stateless_rules()
        opt = self.optimizer
        params = [p for p in self._params() if p.array is not None]
        if not params:
            return
        if self._scalars is None:
            self._scalars = hyper.DeviceScalars(self.NAMES, params[0].device)
            if not isinstance(opt.guard, DeviceStepGuard):
                guard = DeviceStepGuard()
                guard.count_from(opt.guard.skipped_steps)
                guard.checkpoint(opt.target)
                opt.guard = guard
            opt.device_damping = self._scalars.view('damping', 'float64')
            opt.device_lr = self._scalars.view('lr', 'float64')
            opt.refill_inverses = True
        hyper.bind_rule_hyperparameters(params, self._scalars,
                                        ('lr', 'momentum'))
        self._scalars.write({'lr': opt.lr, 'momentum': opt.momentum,
                             'damping': opt.damping})

    def host_state(self) -> tuple:
        opt = self.optimizer
        return (opt.t, [p.update_rule.t for p in self._params()],
                opt.damping, dict(opt.fisher_diffs), opt.estimator.due,
                getattr(opt.guard, '_open', False))

    def restore_host_state(self, state) -> None:
        opt = self.optimizer
        t, rule_ts, damping, diffs, due, guard_open = state
        opt.t, opt.damping, opt.fisher_diffs = t, damping, diffs
        if hasattr(opt.guard, '_open'):
            opt.guard._open = guard_open
        for param, rule_t in zip(self._params(), rule_ts):
            param.update_rule.t = rule_t
        opt.estimator.start_step(due)

    def after_capture(self, before) -> None:
        """Learn which update rules a stale step advances (those of the
        parameters with a direction)."""
        self._advanced = _advanced_rules(self._params(), before[1])

    def after_replay(self) -> None:
        """The host side of the replayed stale step."""
        for rule in self._advanced:
            rule.t += 1
        self.optimizer.finish_replayed_step()


#: Eager calls of a refresh graph before its capture: one (the steps before
#: ran its kernels, and timed cuDNN's algorithms and the convolutions' A,
#: eagerly: the first step is a refresh step).
CHILD_WARMUP = 1
#: Graphs of the refresh steps' passes kept at once, one per set of factors
#: due (the paper's schedules refresh every factor together: one; A and G
#: on intervals of their own: two).
PASSES_GRAPHS = 4


class RefreshPasses:
    """What a :class:`~chainerkfac.graphs.step.StepGraph` of a K-FAC
    refresh step's forward and backward passes
    (:meth:`KFAC.run_passes <chainerkfac.optimizers.KFAC.run_passes>`: the
    loss, its backward pass, the capture of the factors due) needs to know.
    A child of the stale steps' graph (``KFACOptimizer(...,
    refresh_steps=True)``); the rest of the step runs on what the replay
    wrote: stages 3-4 eagerly, the end through :class:`RefreshUpdate`.

    A replay runs no Python: what the passes leave on the host — each
    block's captured sums (the arrays the replay rewrites) and counts, the
    estimator's samples, the optimizer's open micro-batch — is put back
    after each replay as the capture left it (:meth:`after_replay`), and
    the gradients and the model's outputs are rebound by the StepGraph.
    Replayed: the empirical Fisher (the default). Not replayed: ``fisher=
    'mc'`` (its labels are drawn on the host from the logits) and
    ``'exact'``, a step whose capture records its graph (the first steps,
    for eq. 20 'auto'). (A step after a restore takes the guard's
    checkpoint in :meth:`KFAC.update`, eagerly.) Which factors are due is
    baked into the graph: :class:`KFACOptimizer` keeps one graph per set.
    A parameter the passes do not reach has no gradient after the capture,
    and none after a replay (the eager step leaves it alone).
    """

    def __init__(self, optimizer, params: step.ParameterWalk,
                 stale: 'KFACOptimizer'):
        self.optimizer = optimizer
        self._params = params
        self._stale = stale
        self._captured = None
        self._unreached = []
        #: The graph of the step's end on these passes' gradients, once
        #: made (:meth:`update_function`).
        self.update_graph: Optional[step.StepGraph] = None

    def update_function(self, passes: step.StepGraph):
        """``update(grads, present)`` for :meth:`KFAC.finish_step
        <chainerkfac.optimizers.KFAC.finish_step>`: stage 5 and the update
        through a graph of their own (:class:`RefreshUpdate`, a child of
        the stale steps' graph, as these passes' graph), on the gradients
        these passes' graph wrote."""
        opt = self.optimizer
        if self.update_graph is None:
            adapter = RefreshUpdate(opt, self._params, self._stale)
            self.update_graph = step.StepGraph(
                lambda: opt.update_step(*adapter.args), adapter,
                warmup=CHILD_WARMUP, parent=passes.parent,
                label='refresh update: ')
        graph = self.update_graph

        def update(grads, present):
            graph.adapter.args = (grads, present)
            # every batch the graph reads stacked now (not in a capture),
            # with the inverses refilled in place copied into its slots (a
            # replay runs no version check)
            opt.prepare_inverse_stacks(grads, present)
            try:
                graph()
            finally:
                graph.adapter.args = None
        return update

    def refusal(self) -> Optional[str]:
        opt = self.optimizer
        if opt.estimator.fisher != 'emp':
            return ("fisher='{}' (its passes read the logits on the "
                    'host)'.format(opt.estimator.fisher))
        if opt.estimator.capture_hook.record_graph:
            return 'the passes record their graph (eq. 20, the table)'
        return None

    @staticmethod
    def due_key(optimizer) -> tuple:
        """Which factors of which blocks are due."""
        due = optimizer.estimator.due
        return tuple(tuple(sorted(due.get(b, ())))
                     for b in optimizer.estimator.blocks)

    def baked(self) -> tuple:
        """Which factors of which blocks are due (the captured kernels
        form those)."""
        return self.due_key(self.optimizer)

    def before_step(self) -> None:
        """Nothing: the parent's ``before_step`` wrote the device values."""

    def graph_buffers(self) -> tuple:
        """What the passes read that a step could move: the parameters and
        the model's persistent arrays (the running statistics)."""
        opt = self.optimizer
        return step.buffer_signature(
            [p.array for p in opt.target.params()] +
            device_guard._persistent_arrays(opt.target))

    def step_objects(self) -> list:
        """The objects whose array attributes the passes set: the model's
        links (loss, predictions) and the parameters (gradients)."""
        target = self.optimizer.target
        return list(target.links()) + list(target.params())

    def host_state(self) -> tuple:
        """What the passes change on the host: the optimizer's open
        micro-batch, the estimator's counts, each block's capture."""
        opt = self.optimizer
        estimator = opt.estimator
        blocks = tuple(
            (block, {name: _copied(getattr(block, name))
                     for name in _BLOCK_CAPTURE})
            for block in estimator.blocks)
        return (opt._micro,
                {name: _copied(getattr(estimator, name))
                 for name in _ESTIMATOR_CAPTURE},
                blocks)

    def restore_host_state(self, state) -> None:
        opt = self.optimizer
        micro, estimator, blocks = state
        opt._micro = micro
        for name, value in estimator.items():
            setattr(opt.estimator, name, _copied(value))
        for block, values in blocks:
            for name, value in values.items():
                setattr(block, name, _copied(value))

    def after_capture(self, before) -> None:
        """Keep what the captured passes left on the host, and which
        parameters they left without a gradient."""
        self._captured = self.host_state()
        self._unreached = [p for p in self.optimizer.target.params()
                           if p.grad is None]

    def after_replay(self) -> None:
        """Leave on the host what the captured passes left (module
        docstring): the captured sums, now rewritten by the replay, and no
        gradient where the passes give none (a replay runs no
        ``cleargrads``)."""
        self.restore_host_state(self._captured)
        for param in self._unreached:
            param.cleargrad()

    def after_drop(self) -> None:
        """Let go of the captured sums (their memory is the graph's), and
        of the update's graph, which read these passes' gradients."""
        self._captured = None
        self._unreached = []
        if self.update_graph is not None:
            self.update_graph.close()
            self.update_graph = None

    def captured_arrays(self) -> list:
        """The arrays of the captured sums (which a replay rewrites), in
        the blocks' order (none before the first capture): for an
        emulated replay."""
        return [] if self._captured is None else \
            _sum_arrays(self._captured[2])

    def current_arrays(self) -> list:
        """The arrays of the blocks' sums now, in the same order."""
        return _sum_arrays(self.host_state()[2])


class RefreshUpdate:
    """What a :class:`~chainerkfac.graphs.step.StepGraph` of a refresh
    step's end needs to know: :meth:`KFAC.update_step
    <chainerkfac.optimizers.KFAC.update_step>` (stage 5, the bounded step,
    the update) on the gradients that a replay of the refresh passes
    wrote, after the eager inverse stage (whose inverses go into the
    arrays the graph reads: ``refill_inverses``). A child of the stale
    steps' graph, one per graph of the passes (:class:`RefreshPasses`).
    Eagerly this end is mostly host time (on an H100 at batch 32: 0.028 s
    for stage 5 and 0.010 s for the update, against a few ms of
    kernels).

    The step's ``(grads, present)`` are set in :attr:`args` around each
    call. Its host side after a replay is the stale step's: ``t`` and the
    update rules' ``t`` advanced, and the device guard's step left open
    for its checkpoint to settle (undo where not finite).
    """

    def __init__(self, optimizer, params: step.ParameterWalk,
                 stale: 'KFACOptimizer'):
        self.optimizer = optimizer
        self._params = params
        self._stale = stale
        self._advanced = []
        #: ``(grads, present)`` of the step being taken.
        self.args = None

    def refusal(self) -> Optional[str]:
        opt = self.optimizer
        if not isinstance(opt.guard, DeviceStepGuard):
            return 'the guard is not on the device'
        updated = opt.updated_params(opt.blocks, self.args[1])
        if any(p.grad is not None and p.update_rule.state is None
               for p in updated):
            return ('an update rule without state yet (the guard decides '
                    'on the host)')
        return None

    def baked(self) -> tuple:
        """The stale step's host values and which parameters have a
        gradient."""
        present = self.args[1]
        return (self._stale.baked(), tuple(
            tuple(present.get(b, ())) for b in self.optimizer.blocks))

    def before_step(self) -> None:
        """Nothing: the parent's ``before_step`` wrote the device values."""

    def graph_buffers(self) -> tuple:
        """What the step's end reads that could move: the gradients, the
        inverses and their stacks, the parameters and their states."""
        opt = self.optimizer
        grads = self.args[0]
        return step.buffer_signature(
            [g for b in opt.blocks for g in grads.get(b, ())] +
            opt.inverse_buffers() +
            device_guard._update_arrays(self._params()))

    def step_objects(self) -> list:
        """The bounded step's ν and metric (what the report reads)."""
        bound = self.optimizer.step_bound
        return [] if bound is None else [bound]

    def host_state(self) -> tuple:
        opt = self.optimizer
        return (opt.t, [p.update_rule.t for p in self._params()],
                getattr(opt.guard, '_open', False))

    def restore_host_state(self, state) -> None:
        opt = self.optimizer
        t, rule_ts, guard_open = state
        opt.t = t
        for param, rule_t in zip(self._params(), rule_ts):
            param.update_rule.t = rule_t
        opt.guard._open = guard_open

    def after_capture(self, before) -> None:
        """Learn which update rules the step advances."""
        self._advanced = _advanced_rules(self._params(), before[1])

    def after_replay(self) -> None:
        """``t``, the rules' ``t``, and the guard's check made."""
        opt = self.optimizer
        opt.t += 1
        for rule in self._advanced:
            rule.t += 1
        opt.guard._open = True


#: The attributes of a block and of the estimator that the passes of one
#: micro-batch change.
def _advanced_rules(params, rule_ts) -> list:
    """The update rules whose ``t`` moved from ``rule_ts`` (taken before
    the captured step), each once: a parameter of two links is walked
    twice, and its rule was advanced twice a replay."""
    advanced = {id(p.update_rule): p.update_rule
                for p, t in zip(params, rule_ts) if p.update_rule.t != t}
    return list(advanced.values())


_BLOCK_CAPTURE = ('_open', '_calls', '_step_sums', '_step_counts',
                  '_scales', '_collect')
_ESTIMATOR_CAPTURE = ('batch_size', 'samples', '_passes', '_touched',
                      '_summed_passes', '_summed_blocks')


def _copied(value):
    """A shallow copy of a dict or set (what the passes rebuild or
    mutate), else the value."""
    if isinstance(value, (dict, set)):
        return type(value)(value)
    return value


def _sum_arrays(blocks) -> list:
    arrays = []
    for _, values in blocks:
        sums = values['_step_sums']
        for name in sorted(sums):
            value = sums[name]
            arrays.append(getattr(value, 'columns', value))
    return arrays

"""Any Chainer optimizer with K-FAC's accumulation, skipped-step guard and
multi-process averaging: the first-order baselines driven like K-FAC.

A training harness that compares K-FAC with momentum SGD or LARS wants one
way of driving them: ``update`` per micro-batch, a step every ``acc_iters``
calls, gradients averaged over the micro-batches and the processes, a step
with a non-finite gradient skipped (weights and running statistics as they
were), and a public signal that it was. :class:`GuardedOptimizer` gives a
Chainer optimizer exactly what :class:`~chainerkfac.optimizers.KFAC` does
for itself, with the same pieces (:mod:`chainerkfac.accumulation`,
:mod:`chainerkfac.step_guard`).

With ``shard_update=True`` the update is sharded over the processes
(:mod:`chainerkfac.sharding`): the gradients are reduce-scattered to the
parameters' owners instead of all-reduced, each process updates the
parameters it owns (and keeps only their optimizer state), and the new
weights are all-gathered.
"""
import contextlib
import logging
import warnings
from typing import Optional

import numpy

import chainer

from chainerkfac import sharding
from chainerkfac.accumulation import GradientAccumulator
from chainerkfac.optimizers import loss_scaling, options, registration
from chainerkfac.serializers import loaded
from chainerkfac.stage_timer import StageTimer
from chainerkfac.step_guard import StepGuard

logger = logging.getLogger(__name__)


class GuardedOptimizer:
    """A Chainer optimizer stepped every ``acc_iters`` micro-batches, on
    gradients averaged over them and the processes, skipping non-finite
    steps.

    Attribute reads and writes it does not define go to the wrapped
    optimizer (``optimizer.lr = ...`` from a Trainer extension works).

    Parameters
    ----------
    actual_optimizer : chainer.Optimizer
        An instance of a :class:`chainer.GradientMethod` (MomentumSGD,
        :class:`~chainerkfac.optimizers.LARS`, Adam, ...); not
        :class:`~chainerkfac.optimizers.KFAC`, which accumulates, averages
        over processes and guards its steps itself (``KFAC(acc_iters=k)``,
        :func:`chainerkfac.create_multi_node_optimizer`).
    acc_iters : int, default 1
        Micro-batches per step.
    comm : ChainerMN communicator, optional
        Gradients are averaged over its processes
        (``multi_node_mean_grad``) and the finite check agreed by all.
        None: one process.
    shard_update : bool, default False
        Weight-update sharding with ``comm`` (:mod:`chainerkfac.sharding`):
        gradients reduce-scattered to their owners (each parameter has
        one, balancing the elements per process), the update applied by
        the owner alone, which alone keeps the parameter's optimizer state,
        the new weights all-gathered; the steps equal those without it. The
        optimizer's hooks must act on each parameter alone
        (``call_for_each_param``: WeightDecay, Lasso, GradientHardClipping,
        GradientLARS, ...; not GradientClipping, which needs the norm of
        the whole gradient), loss scaling and an optimizer with its own
        ``update`` are refused. After a step ``param.grad`` is the mean
        gradient on the parameter's owner only. One process: no effect.

    Attributes
    ----------
    last_step_skipped : bool
        Whether the last step was skipped (a non-finite gradient).
    pending_micro_batches : int
        Micro-batches accumulated towards the coming step.
    owners : chainerkfac.sharding.ParameterOwners or None
        With ``shard_update``, the parameters' owners (from the first
        step).
    stage_times : dict
        Seconds of the last step's stages: ``'mean'`` (the gradients'
        average over processes: all-reduce, or reduce-scatter when
        sharded), ``'update'``, ``'all_gather'`` (sharded).
    """

    def __init__(self, actual_optimizer, acc_iters: int = 1, comm=None,
                 shard_update: bool = False):
        _check_wrapped(actual_optimizer)
        options.check_option('acc_iters', acc_iters, 'GuardedOptimizer')
        options.check_option('shard_update', shard_update, 'GuardedOptimizer')
        shard_update = bool(shard_update)
        if comm is not None and not all(
                hasattr(comm, name) for name in ('rank', 'size')):
            raise TypeError(
                'GuardedOptimizer: comm={!r} is not a ChainerMN '
                'communicator (chainermn.create_communicator(...), or '
                'chainerkfac.create_communicator); None for one process'
                .format(comm))
        if comm is not None and comm.size > 1:
            # one failing process ends the job (ChainerMN's global except
            # hook; a communicator of ChainerMN's own does not install it)
            from chainerkfac.communicators import install_except_hook
            install_except_hook()
        state = self.__dict__
        state['actual_optimizer'] = actual_optimizer
        state['acc_iters'] = acc_iters
        state['comm'] = comm
        state['shard_update'] = shard_update
        state['guard'] = StepGuard()
        state['accumulator'] = GradientAccumulator()
        state['timer'] = StageTimer()
        self._forget_model()

    def _forget_model(self) -> None:
        """What this wrapper holds of a model, as it is before the first
        micro-batch: the micro-batches accumulated, the processes'
        agreement and rank 0's weights, the owners of a sharded update."""
        state = self.__dict__
        state['pending_micro_batches'] = 0
        #: The coming step's micro-batches over all processes, where they
        #: differ between processes (:meth:`flush_accumulation`).
        state['global_micro_batches'] = None
        self.accumulator.reset()
        self.accumulator.forget_load()
        state['owners'] = None
        state['_shard'] = None
        state['_agreed'] = False
        state['_agreed_uninitialised'] = False
        state['_joined'] = False

    def __getattr__(self, name):
        try:
            actual = self.__dict__['actual_optimizer']
        except KeyError:    # a copy or unpickling, before its state is set
            raise AttributeError(name) from None
        return getattr(actual, name)

    def __setattr__(self, name, value):
        if name == 'acc_iters':
            value = options.integral(value)     # a shift extension's 2.0
            options.check_option('acc_iters', value, 'GuardedOptimizer')
        if name in self.__dict__:
            self.__dict__[name] = value
        else:
            setattr(self.actual_optimizer, name, value)

    @property
    def last_step_skipped(self) -> bool:
        return self.guard.skipped

    @property
    def stage_times(self):
        return self.timer.times

    @property
    def sharded(self) -> bool:
        """Whether the update is sharded (``shard_update`` with several
        processes)."""
        return self.shard_update and self.comm is not None and \
            self.comm.size > 1

    def setup(self, link):
        """Set the wrapped optimizer up on ``link``; what this wrapper held
        of a model set up before (the micro-batches accumulated, the
        processes' agreement and rank 0's weights, the owners of a
        sharded update) starts again, as the optimizer's state does."""
        self.actual_optimizer.setup(link)
        self._forget_model()
        self.guard.checkpoint(link)
        return self

    def update(self, lossfun=None, *args, **kwds):
        """One micro-batch: with ``lossfun``, clear the gradients, run it
        on the arguments and backpropagate; without, take the gradients of
        the loop's own backward. Every ``acc_iters`` calls, one step."""
        target = self.actual_optimizer.target
        multi = self.comm is not None and self.comm.size > 1
        if multi and not self._agreed:
            self._check_agreement()
        join = multi and not self._joined
        if join and lossfun is not None and all(
                p.array is not None for p in target.params()):
            # rank 0's weights before the first forward (as ChainerMN's
            # multi-node optimizer and K-FAC's give every process)
            self._broadcast_weights()
            join = False
        if lossfun is not None and (
                self.pending_micro_batches == 0 or
                self.accumulator.resumed_from is not None):
            # the running statistics as the step's forward finds them (a
            # load's model's, too: loaded inside a step, as the resumed
            # micro-batch finds them)
            self.guard.checkpoint(target)
        self.accumulator.forget_load()
        if lossfun is not None:
            self._run_loss(lossfun, args, kwds)
        if join and self._broadcast_weights(discard_forward=True):
            # the micro-batch was computed with each process's own weights
            # (lazily initialised links, or the loop's own backward)
            if lossfun is not None:
                logger.warning(
                    'GuardedOptimizer: lazily initialised parameters '
                    "differed between processes; rank 0's were broadcast "
                    'and the first micro-batch recomputed with them')
                self._run_loss(lossfun, args, kwds)
            else:
                logger.warning(
                    "GuardedOptimizer: parameters differed between "
                    "processes; rank 0's were broadcast, and the first "
                    'micro-batch, computed before, is dropped on every '
                    'process')
                target.cleargrads()
                return
        self.pending_micro_batches += 1
        if self.pending_micro_batches < self.acc_iters:
            self.accumulator.hold(target)
            return
        self._step()

    def _run_loss(self, lossfun, args, kwds) -> None:
        target = self.actual_optimizer.target
        target.cleargrads()
        loss = lossfun(*args, **kwds)
        loss.backward(loss_scale=self.actual_optimizer._loss_scale)
        del loss

    def _broadcast_weights(self, discard_forward: bool = False) -> bool:
        """Give every process rank 0's parameters (once, at the first
        micro-batch); returns whether any process's changed (agreed). The
        parameters' names, shapes and dtypes are agreed first (lazily
        initialised links were not, at :meth:`_check_agreement`: a
        mismatch aborted MPI in the broadcast). ``discard_forward``: a
        forward pass ran since the guard's checkpoint with each process's
        own weights; where any changed, its running statistics are put
        back (the micro-batch is recomputed or dropped)."""
        from chainerkfac.transport import broadcast_params
        from chainerkfac.transport import check_same_everywhere
        target = self.actual_optimizer.target
        if self._agreed_uninitialised:
            check_same_everywhere(self.comm.mpi_comm,
                                  registration.parameter_fingerprint(target),
                                  'GuardedOptimizer')
        changed = broadcast_params(self.comm, target)
        self.__dict__['_joined'] = True
        if changed:
            if discard_forward:
                self.guard.restore()
            self.guard.checkpoint(target)
        return changed

    def flush_accumulation(self, global_micro_batches: Optional[int] = None
                           ) -> int:
        """Take the step now with the micro-batches accumulated since the
        last one (fewer than ``acc_iters``), averaged over them. Returns
        their number (0: no step). ``global_micro_batches``: the step's
        micro-batches over all processes where they differ between
        processes; every process then steps, one with none of its own too,
        and the average is over them (as :meth:`KFAC.flush_accumulation
        <chainerkfac.optimizers.KFAC.flush_accumulation>`)."""
        pending = self.pending_micro_batches
        if self.accumulator.resumed_from is not None:
            # loaded inside a step, no micro-batch since: param.grad holds
            # nothing of the step (Chainer's NaN of a new parameter)
            self.actual_optimizer.target.cleargrads()
        if global_micro_batches is not None:
            self.global_micro_batches = global_micro_batches
            if global_micro_batches > 0:
                if not pending:         # nothing of its own: no gradient
                    self.actual_optimizer.target.cleargrads()
                self._step()
            return pending
        if pending:
            self._step()
        return pending

    def _step(self) -> None:
        target = self.actual_optimizer.target
        self.timer.start()
        n_micro, self.pending_micro_batches = self.pending_micro_batches, 0
        total, self.global_micro_batches = self.global_micro_batches, None
        self.accumulator.collect(target)
        if self.comm is not None or total is not None:
            # every process the same list of gradients: a parameter no loss
            # reached on one process (a branch it did not take, a flush
            # with no micro-batch of its own) is a zero there, in the mean
            # (left out, ChainerMN's all-reduce reduced different lists on
            # different processes: a hang)
            self.actual_optimizer.reallocate_cleared_grads()
        if total is not None:
            # the processes' micro-batches differ: each one's gradient
            # weighs by its share (the mean over processes follows); one
            # with none sends zeros
            size = 1 if self.comm is None else self.comm.size
            scale = size / float(total)
            for param in target.params():
                if param.grad is not None:
                    param.grad *= param.grad.dtype.type(scale)
        elif n_micro > 1:
            for param in target.params():
                if param.grad is not None:
                    param.grad /= n_micro
        if self.comm is not None and self.comm.size > 1:
            if not self._agreed:        # a flush before any update
                self._check_agreement()
            if not self._joined and self._broadcast_weights():
                logger.warning(
                    "GuardedOptimizer: parameters differed between "
                    "processes; rank 0's were broadcast before the first "
                    "step, whose gradients were computed with each "
                    "process's own")
        if self.sharded:
            taken = self._sharded_update()
        else:
            taken = self._update_everywhere()
        if not taken:
            self.guard.restore()
            # (a step taken runs the optimizer's update, which follows a
            # dynamic scale itself)
            loss_scaling.follow_step(self.actual_optimizer, skipped=True)
            logger.warning('step %d: non-finite gradient, update skipped '
                           '(weights and running statistics unchanged)',
                           self.actual_optimizer.t + 1)
        chainer.reporter.report({'skipped_step': self.guard.observation()})
        self.guard.checkpoint(target)

    def _check_agreement(self) -> None:
        """At the first micro-batch (or step), before any collective: the
        processes must agree on ``shard_update`` (one that does not would
        wait in the all-reduce while the others gather: a hang),
        ``acc_iters``, the
        optimizer, its hyperparameters, hooks and loss scaling (a refusal
        of one rank's hook hung the others; a scale on one rank only
        averaged scaled and unscaled gradients), and on the parameters'
        names, shapes and dtypes (a 4×6 weight on one, 6×4 on another
        averaged as the same array, silently)."""
        from chainerkfac.transport import check_same_everywhere
        optimizer = self.actual_optimizer
        pre, post = _hooks(optimizer)
        items = {'shard_update': repr(self.shard_update),
                 'acc_iters': repr(self.acc_iters),
                 'optimizer': type(optimizer).__name__,
                 'hyperparameters': repr(sorted(
                     optimizer.hyperparam.get_dict().items())),
                 'hooks': repr((sorted(pre), sorted(post))),
                 'loss scaling': loss_scaling.loss_scaling_of(optimizer)}
        items.update(registration.parameter_fingerprint(optimizer.target))
        check_same_everywhere(self.comm.mpi_comm, items, 'GuardedOptimizer')
        self._agreed = True
        # lazily initialised links are agreed again before the broadcast
        self._agreed_uninitialised = any(
            p.array is None for p in optimizer.target.params())

    def _agree(self, ok: bool) -> bool:
        return all(self.comm.mpi_comm.allgather(bool(ok)))

    def _update_everywhere(self) -> bool:
        """Average the gradients over processes, check, update every
        parameter. Returns whether the step was taken."""
        target = self.actual_optimizer.target
        if self.comm is not None:
            self.comm.multi_node_mean_grad(target)
        self.timer.mark('mean')
        grads = [p.grad for p in target.params()]
        if not self.guard.check(
                grads, None if self.comm is None else self._agree):
            return False
        self.actual_optimizer.update()
        self.timer.mark('update')
        return True

    def _sharded_update(self) -> bool:
        """Reduce-scatter the gradients to their owners, check, update the
        owned parameters, all-gather the weights. Returns whether the step
        was taken."""
        check = getattr(self.actual_optimizer, 'check_update', None)
        if check is not None:
            check()              # before anything moves (LARS's values)
        self._check_shardable()
        if self._shard is None:
            self._start_sharding()
        params, collectives = self._shard
        owners, rank = self.owners, self.comm.rank
        reduced = sharding.reduce_scatter_mean(
            collectives, [p.grad for p in params], owners.owners,
            self.comm.size)
        for param, grad in zip(params, reduced):
            if grad is not None:
                param.grad = grad
        self.timer.mark('mean')
        if not self.guard.check([g for g in reduced if g is not None],
                                self._agree):
            return False
        self._update_owned([p for i, p in enumerate(params)
                            if owners.owns(rank, i)],
                           [p for i, p in enumerate(params)
                            if not owners.owns(rank, i)])
        self.timer.mark('update')
        sharding.all_gather_weights(collectives, params, owners.owners, rank)
        self.timer.mark('all_gather')
        return True

    def _update_owned(self, owned, others) -> None:
        """Chainer's ``GradientMethod.update`` for the parameters this
        process owns: the optimizer's hooks (each acts on one parameter:
        checked at the start) and the update rules run on those only; the
        others' rules count the step (``rule.t``: Adam's bias correction),
        so every process and every snapshot file agree on it."""
        optimizer = self.actual_optimizer
        pre, post = _hooks(optimizer)
        for hook in pre.values():
            for param in owned:
                hook(param.update_rule, param)
        optimizer.t += 1
        for param in owned:
            param.update()
        for param in others:
            rule = param.update_rule
            if rule is not None and rule.enabled:
                rule.t += 1
        for hook in post.values():
            for param in owned:
                hook(param.update_rule, param)

    def _check_shardable(self) -> None:
        """At every sharded step, before anything moves: that sharding can
        give the unsharded step (a hook or loss scaling added after the
        first step was not refused: a GradientClipping then failed with a
        TypeError, a dynamic loss scale stayed at 1)."""
        optimizer = self.actual_optimizer
        if type(optimizer).update is not chainer.GradientMethod.update \
                and not getattr(optimizer, 'gradient_method_update', False):
            # (FusedMomentumSGD's update is GradientMethod.update's, fused)
            raise ValueError(
                'GuardedOptimizer(shard_update=True): {} has its own update '
                '(the sharded step runs chainer.GradientMethod.update on the '
                'owned parameters)'.format(type(optimizer).__name__))
        pre, post = _hooks(optimizer)
        whole = [name for name, hook in list(pre.items()) +
                 list(post.items())
                 if not getattr(hook, 'call_for_each_param', False)]
        if whole:
            raise ValueError(
                'GuardedOptimizer(shard_update=True): the optimizer hook(s) '
                '{} see the whole model (not call_for_each_param); with a '
                'sharded update a process holds the mean gradient of its '
                'own parameters only'.format(', '.join(whole)))
        if optimizer._loss_scale is not None:
            raise ValueError(
                'GuardedOptimizer(shard_update=True): loss scaling is not '
                'supported (dynamic scaling decides from every gradient)')

    def _start_sharding(self) -> None:
        """At the first sharded step: decide the owners, drop the state of
        the others' parameters (a restore that merged every process's
        file)."""
        from chainerkfac.communicators.adapter import kfac_collectives
        optimizer = self.actual_optimizer
        named = sorted(optimizer.target.namedparams())
        params = [p for _, p in named]
        self.owners = sharding.ParameterOwners.balanced(
            [p.size for p in params], self.comm.size,
            [n for n, _ in named])
        self._shard = (params, kfac_collectives(self.comm))
        self._drop_unowned_state()

    @contextlib.contextmanager
    def _states_for_saving(self):
        """While saving, a state (zeros, as its first update makes it) for
        each enabled rule that never updated, taken away afterwards (saving
        changes nothing): Chainer's loader needs the state of every enabled
        rule, so a snapshot saved before the first step (inside the first
        accumulation) did not load (``KeyError: 'l1/W/v'``). Not with a
        sharded update, whose files hold the states their process owns
        (a sharded loader takes what a file has)."""
        made = []
        if not self.sharded:
            for param in self.actual_optimizer.target.params():
                rule = param.update_rule
                if rule is None or not rule.enabled or rule.t or \
                        rule.state is not None or param.array is None:
                    continue
                like = param
                if rule._use_fp32_update and param.dtype == numpy.float16:
                    # the float32 master's state, made on a copy (the
                    # master itself comes at the first update, from the
                    # weights of then)
                    like = chainer.Variable(param.array.astype(
                        numpy.float32))
                rule._init_states(like)
                made.append(rule)
        try:
            yield
        finally:
            for rule in made:
                rule._state = None

    def _serialize_accumulation(self, serializer, loading: bool) -> int:
        """The step so far of a snapshot inside an accumulation (a
        Trainer's snapshot at an iteration that ends no step, whose
        iterator has gone past those micro-batches): their number and
        their gradients' sums (:meth:`GradientAccumulator.save_step`);
        returns the number loaded. A file the accumulator does not take
        (:meth:`GradientAccumulator.load_step`) starts a new step, said."""
        target = self.actual_optimizer.target
        if not loading:
            serializer('micro_batch', self.pending_micro_batches)
            if self.pending_micro_batches:
                self.accumulator.save_step(serializer['accumulation'],
                                           target, self._origin())
            return self.pending_micro_batches
        pending = loaded(serializer, 'micro_batch')
        if not pending:         # a step's end, or an earlier version's file
            self.accumulator.reset()
            self.accumulator.forget_load()
            return 0
        why = self.accumulator.load_step(serializer['accumulation'], target)
        if why is None:
            return int(pending)
        warnings.warn(
            'GuardedOptimizer state saved after {} of {} accumulated '
            'micro-batches {}: they are dropped and the next update starts '
            'a new step'.format(int(pending), self.acc_iters, why))
        return 0

    def _origin(self) -> tuple:
        """``(rank, processes)`` of this optimizer's communicator."""
        if self.comm is None:
            return (0, 1)
        return (int(self.comm.rank), int(self.comm.size))

    def _drop_unowned_state(self) -> None:
        params = self._shard[0]
        sharding.drop_unowned_state(
            params, [self.owners.owns(self.comm.rank, i)
                     for i in range(len(params))], self.owners.names)

    def serialize(self, serializer):
        loading = isinstance(serializer, chainer.serializer.Deserializer)
        if loading and self.sharded:
            # each process's file holds the velocities it owned
            self.actual_optimizer.serialize(
                sharding.PartialStateDeserializer(serializer))
        elif loading:
            self.actual_optimizer.serialize(serializer)
        else:
            with self._states_for_saving():
                self.actual_optimizer.serialize(serializer)
        pending = self._serialize_accumulation(serializer, loading)
        if loading:
            # The model is loaded after its optimizer (Chainer's updaters):
            # its running statistics are taken at the next update(lossfun),
            # and until then those of now (a loop that runs its own
            # forward).
            self.pending_micro_batches = pending
            self.guard.checkpoint(self.actual_optimizer.target)
            if self._shard is not None:
                self._drop_unowned_state()


def _check_wrapped(optimizer) -> None:
    """Refuse what GuardedOptimizer cannot drive: anything but an
    instance of a Chainer optimizer, and K-FAC (its factors come from the
    backward passes since the gradients were last cleared, which the
    accumulation here clears at every micro-batch: the factors of the last
    micro-batch only, with the gradient of all; a step 37 % off
    ``KFAC(acc_iters=2)``'s in an auditor's run)."""
    from chainerkfac.optimizers.kfac import KFAC
    if isinstance(optimizer, KFAC):
        raise TypeError(
            'GuardedOptimizer: KFAC accumulates micro-batches, averages '
            'over processes and skips non-finite steps itself: use '
            'KFAC(acc_iters=k) and chainerkfac.create_multi_node_optimizer'
            '(optimizer, comm), not GuardedOptimizer(KFAC(...))')
    if not isinstance(optimizer, chainer.Optimizer):
        raise TypeError(
            'GuardedOptimizer: actual_optimizer={!r} is not a Chainer '
            'optimizer instance (e.g. chainer.optimizers.MomentumSGD(lr=0.1)'
            ' or chainerkfac.optimizers.LARS())'.format(optimizer))


def _hooks(optimizer):
    """The optimizer's pre- and post-update hooks, ``{name: hook}`` each
    (Chainer keeps them in its ``_hookable``; there is no public reader)."""
    hookable = optimizer._hookable
    return hookable._pre_update_hooks, hookable._post_update_hooks

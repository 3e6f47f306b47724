""":class:`~chainerkfac.optimizers.GuardedOptimizer`'s steps replayed as a
CUDA graph.

The guarded first-order step (the baselines K-FAC is compared with) reads
its finite check on the host; :class:`GuardedOptimizer` gives it
:class:`~chainerkfac.device_guard.DeviceStepGuard` instead (the check,
its flag and the undoing of a skipped step on the device, the flag read
only when asked) and the wrapped optimizer's ``lr`` and ``momentum`` in
device memory, then drives it as :class:`~chainerkfac.graphs.step.
ChainerOptimizer` drives a Chainer optimizer: MomentumSGD or SGD, with
:class:`chainer.optimizer_hooks.WeightDecay` allowed (its kernel reads its
constant rate).

Not replayed yet: a communicator (the gradients averaged and the flag
agreed over processes), ``acc_iters > 1``.
"""
from typing import Optional

from chainerkfac.device_guard import DeviceStepGuard
from chainerkfac.graphs.step import ChainerOptimizer


class GuardedOptimizer(ChainerOptimizer):
    """What :class:`~chainerkfac.graphs.step.StepGraph` needs to know of a
    :class:`chainerkfac.optimizers.GuardedOptimizer` (module docstring).

    Parameters
    ----------
    guarded : chainerkfac.optimizers.GuardedOptimizer
        Set up with its model.
    """

    def __init__(self, guarded):
        from chainer import optimizer_hooks
        super().__init__(guarded.actual_optimizer,
                         hyperparameters_on_device=True,
                         replayable_hooks=(optimizer_hooks.WeightDecay,))
        self.guarded = guarded

    def refusal(self) -> Optional[str]:
        guarded = self.guarded
        if guarded.comm is not None:
            return ('a communicator (gradients averaged and the flag agreed '
                    'over processes: not captured yet)')
        if guarded.acc_iters != 1:
            return 'acc_iters={} (micro-batches are not captured yet)'.format(
                guarded.acc_iters)
        if not isinstance(guarded.guard, DeviceStepGuard) or \
                not guarded.guard.ready:
            return 'the guard takes its checkpoint (first step, or restored)'
        return super().refusal()

    def before_step(self) -> None:
        """Install the device guard (once the parameters exist), then the
        hyperparameters as :class:`ChainerOptimizer` does."""
        guarded = self.guarded
        target = self.optimizer.target
        if not isinstance(guarded.guard, DeviceStepGuard) and any(
                p.array is not None for p in target.params()):
            guard = DeviceStepGuard()
            guard.count_from(guarded.guard.skipped_steps)
            guard.checkpoint(target)
            guarded.guard = guard
        super().before_step()

    def host_state(self) -> tuple:
        return super().host_state(), self.guarded.pending_micro_batches

    def restore_host_state(self, state) -> None:
        chainer_state, pending = state
        super().restore_host_state(chainer_state)
        self.guarded.pending_micro_batches = pending

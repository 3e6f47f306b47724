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
"""
import logging
import chainer

from chainerkfac.accumulation import GradientAccumulator
from chainerkfac.optimizers import options
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
        A :class:`chainer.GradientMethod` (MomentumSGD, LARS via a hook, ...).
    acc_iters : int
        Micro-batches per step.
    comm : ChainerMN communicator, optional
        Gradients are averaged over its processes
        (``multi_node_mean_grad``) and the finite check agreed by all.

    Attributes
    ----------
    last_step_skipped : bool
        Whether the last step was skipped (a non-finite gradient).
    pending_micro_batches : int
        Micro-batches accumulated towards the coming step.
    """

    def __init__(self, actual_optimizer, acc_iters: int = 1, comm=None):
        options.check_option('acc_iters', acc_iters)
        state = self.__dict__
        state['actual_optimizer'] = actual_optimizer
        state['acc_iters'] = acc_iters
        state['comm'] = comm
        state['guard'] = StepGuard()
        state['accumulator'] = GradientAccumulator()
        state['pending_micro_batches'] = 0
        state['_checkpoint_due'] = False

    def __getattr__(self, name):
        return getattr(self.__dict__['actual_optimizer'], name)

    def __setattr__(self, name, value):
        if name in self.__dict__:
            self.__dict__[name] = value
        else:
            setattr(self.actual_optimizer, name, value)

    @property
    def last_step_skipped(self) -> bool:
        return self.guard.skipped

    def setup(self, link):
        self.actual_optimizer.setup(link)
        self.guard.checkpoint(link)
        return self

    def update(self, lossfun=None, *args, **kwds):
        """One micro-batch: with ``lossfun``, clear the gradients, run it
        on the arguments and backpropagate; without, take the gradients of
        the loop's own backward. Every ``acc_iters`` calls, one step."""
        target = self.actual_optimizer.target
        if self._checkpoint_due and lossfun is not None:
            self.guard.checkpoint(target)
            self._checkpoint_due = False
        if lossfun is not None:
            target.cleargrads()
            loss = lossfun(*args, **kwds)
            loss.backward(loss_scale=self.actual_optimizer._loss_scale)
            del loss
        self.pending_micro_batches += 1
        if self.pending_micro_batches < self.acc_iters:
            self.accumulator.hold(target)
            return
        self._step()

    def flush_accumulation(self) -> int:
        """Take the step now with the micro-batches accumulated since the
        last one (fewer than ``acc_iters``), averaged over them. Returns
        their number (0: no step)."""
        pending = self.pending_micro_batches
        if pending:
            self._step()
        return pending

    def _step(self) -> None:
        target = self.actual_optimizer.target
        n_micro, self.pending_micro_batches = self.pending_micro_batches, 0
        self.accumulator.collect(target)
        if n_micro > 1:
            for param in target.params():
                if param.grad is not None:
                    param.grad /= n_micro
        if self.comm is not None:
            self.comm.multi_node_mean_grad(target)
        agree = (None if self.comm is None else
                 lambda ok: all(self.comm.mpi_comm.allgather(bool(ok))))
        grads = [p.grad for p in target.params()]
        if self.guard.check(grads, agree):
            self.actual_optimizer.update()
        else:
            self.guard.restore()
            logger.warning('step %d: non-finite gradient, update skipped '
                           '(weights and running statistics unchanged)',
                           self.actual_optimizer.t + 1)
        chainer.reporter.report({'skipped_step': self.guard.observation()})
        self.guard.checkpoint(target)

    def serialize(self, serializer):
        self.actual_optimizer.serialize(serializer)
        if isinstance(serializer, chainer.serializer.Deserializer):
            # The model is loaded after its optimizer (Chainer's updaters):
            # its running statistics are taken at the next update.
            self.pending_micro_batches = 0
            self.accumulator.reset()
            self.guard.forget()
            self._checkpoint_due = True

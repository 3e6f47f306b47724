"""The gradient of a step of several micro-batches.

Between the micro-batches of a step, :class:`GradientAccumulator` holds the
sum of their gradients and leaves zeros in ``param.grad``, so the step is
the same whether the training loop clears the gradients before each
backward (a hand-written loop, ChainerMN's multi-node optimizer) or lets
them add up, and a reader of ``param.grad`` between two micro-batches
(Chainer's ``ParameterStatistics``, which raised on None) finds an array;
before the step, the sum goes back into ``param.grad``. The additions are
those Chainer makes when gradients add up in ``param.grad`` (``g1 + g2``,
then ``+ g3``, ...), so either way gives the same numbers.
"""
from typing import Dict


class GradientAccumulator:
    """The held sum of a step's micro-batch gradients, per parameter."""

    def __init__(self):
        self._sums: Dict[int, object] = {}

    def hold(self, link) -> None:
        """End of a micro-batch that is not the step's last: add each
        parameter's gradient to the held sum and zero it (a new array:
        the first micro-batch's is the sum)."""
        for param in link.params():
            grad = param.grad
            if grad is None:
                continue
            held = self._sums.get(id(param))
            if held is None:
                self._sums[id(param)] = grad
            else:
                held += grad
            param.grad = param.device.xp.zeros_like(grad)

    def collect(self, link) -> None:
        """Before the step: ``param.grad`` becomes the held sum plus the
        last micro-batch's gradient."""
        if not self._sums:
            return
        for param in link.params():
            held = self._sums.get(id(param))
            if held is None:
                continue
            grad = param.grad
            if grad is not None:
                # in place: NumPy's ``held + grad`` of two 0-d arrays is a
                # scalar, which Chainer refuses as a gradient
                held += grad
            param.grad = held
        self._sums = {}

    def reset(self) -> None:
        """Forget the held sums (a restored state starts a new step)."""
        self._sums = {}

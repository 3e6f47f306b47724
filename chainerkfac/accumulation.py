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

import numpy

import chainer


class GradientAccumulator:
    """The held sum of a step's micro-batch gradients, per parameter."""

    def __init__(self):
        self._sums: Dict[int, object] = {}
        #: The parameters of the held sums, by ``id`` (a copy re-keys).
        self._params: Dict[int, object] = {}

    def __getstate__(self):
        """The held sums with their parameters (``copy.deepcopy`` and
        pickle give the parameters other ``id``; a copy keyed by the old
        ones had lost its sums)."""
        return {'held': [(self._params[key], value)
                         for key, value in self._sums.items()]}

    def __setstate__(self, state):
        held = state['held']
        self._sums = {id(param): value for param, value in held}
        self._params = {id(param): param for param, _ in held}

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
                self._params[id(param)] = param
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
        self._sums, self._params = {}, {}

    def reset(self) -> None:
        """Forget the held sums (a restored state starts a new step)."""
        self._sums, self._params = {}, {}

    def serialize(self, serializer, link) -> None:
        """Save or load the held sums of ``link``'s parameters (a snapshot
        inside a step): a flag per parameter (by name) and the sums held,
        loaded onto each parameter's device."""
        params = sorted(link.namedparams())
        if not isinstance(serializer, chainer.serializer.Deserializer):
            held = numpy.array([int(id(p) in self._sums) for _, p in params],
                               numpy.int8)
            serializer('held', held)
            for (name, param), has in zip(params, held):
                if has:
                    serializer(name.lstrip('/'), self._sums[id(param)])
            return
        held = serializer('held', None)
        if held is None:                    # strict=False, none stored
            raise KeyError('held')
        held = numpy.asarray(held)
        if len(held) != len(params):
            raise ValueError(
                'the snapshot holds the gradients of {} parameters of an '
                'unfinished step, this model has {}: a snapshot of another '
                'model'.format(len(held), len(params)))
        self.reset()
        for (name, param), has in zip(params, held):
            if has:
                value = serializer(name.lstrip('/'), None)
                self._sums[id(param)] = param.device.send(numpy.asarray(value))
                self._params[id(param)] = param

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
from typing import Dict, Optional, Tuple

import numpy

import chainer

from chainerkfac.serializers import loaded


class GradientAccumulator:
    """The held sum of a step's micro-batch gradients, per parameter."""

    def __init__(self):
        self._sums: Dict[int, object] = {}
        #: The parameters of the held sums, by ``id`` (a copy re-keys).
        self._params: Dict[int, object] = {}
        #: Until the next micro-batch (:meth:`forget_load`): the origin
        #: ``(rank, processes)`` of a step loaded from a file saved inside
        #: it (:meth:`load_step`), or None.
        self.resumed_from: Optional[Tuple[int, int]] = None
        #: Until the next micro-batch: several processes' files were
        #: loaded inside a step, so none of their steps is taken.
        self.merged = False

    def __getstate__(self):
        """The held sums with their parameters (``copy.deepcopy`` and
        pickle give the parameters other ``id``; a copy keyed by the old
        ones had lost its sums)."""
        return {'held': [(self._params[key], value)
                         for key, value in self._sums.items()],
                'resumed_from': self.resumed_from, 'merged': self.merged}

    def __setstate__(self, state):
        held = state['held']
        self._sums = {id(param): value for param, value in held}
        self._params = {id(param): param for param, _ in held}
        self.resumed_from = state['resumed_from']
        self.merged = state['merged']

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

    def forget_load(self) -> None:
        """A micro-batch has run since the last load (or the model was set
        up again): a later file is no longer another process's."""
        self.resumed_from, self.merged = None, False

    def save_step(self, serializer, link, origin: Tuple[int, int]) -> None:
        """Save the step so far of a snapshot inside an accumulation: the
        process that saved it (``origin``, ``(rank, processes)``) and the
        held sums (under ``'gradients'``)."""
        serializer('origin', numpy.array(origin, numpy.int64))
        self.serialize(serializer['gradients'], link)

    def load_step(self, serializer, link) -> Optional[str]:
        """Load the step so far that :meth:`save_step` saved. Returns None
        where it was taken, else why not (the caller starts a new step and
        says so): a file of an earlier version (no sums), or several
        processes' files loaded into one optimizer (a resume on another
        number of processes: their partial steps are other processes').
        The same file loaded again replaces the step it gave."""
        earlier = self.resumed_from
        origin = loaded(serializer, 'origin')
        if origin is not None:
            origin = tuple(int(v) for v in numpy.ravel(origin))
            if not self.merged and earlier in (None, origin):
                self.serialize(serializer['gradients'], link)
                self.resumed_from = origin
                return None
            why = 'in several files (of other processes)'
        else:
            why = 'by an earlier version, without their gradients'
        self.reset()
        self.merged = self.merged or earlier is not None or \
            origin is not None
        self.resumed_from = None
        return why

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

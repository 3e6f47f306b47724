"""The skipped-step guard: a step with a non-finite direction changes
nothing.

A step whose (preconditioned) gradient holds a NaN or an Inf is not taken:
the weights stay, and so do the running statistics that the step's forward
passes moved (BatchNormalization's mean and variance, any link's
persistent values). :class:`StepGuard` keeps one copy of those values from
the end of the last step (:meth:`checkpoint`), checks a step's arrays
(:meth:`check`) and puts the values back when the step is skipped
(:meth:`restore`). :attr:`skipped` says whether the last step was skipped.
"""
from typing import Callable, Optional, Sequence

import numpy

import chainer
from chainer.backend import get_array_module

from chainerkfac import fused


class StepGuard:
    """Backup of a link's persistent values and the finite check of a step.

    Attributes
    ----------
    skipped : bool
        Whether the last :meth:`check` found a non-finite value (the step
        was skipped).
    skipped_steps : int
        How many steps were skipped.
    """

    #: The finite check is read on the host during the step (see
    #: :class:`chainerkfac.device_guard.DeviceStepGuard` for the guard
    #: whose flag stays on the device).
    checks_on_host = True

    def __init__(self):
        self.skipped = False
        self.skipped_steps = 0
        self._backup = None

    def checkpoint(self, link) -> None:
        """Keep the persistent values of ``link`` and its children: one
        concatenated copy per array type and dtype (one kernel on the
        GPU)."""
        arrays, scalars = [], []
        for _, child in link.namedlinks():
            for name in child._persistent:
                value = getattr(child, name)
                if isinstance(value, chainer.get_array_types()):
                    arrays.append((child, name, value))
                elif isinstance(value, (int, float, numpy.generic)):
                    scalars.append((child, name, value))
        groups = {}
        for child, name, value in arrays:
            key = (type(value), numpy.dtype(value.dtype))
            groups.setdefault(key, []).append((child, name, value))
        copies = []
        for members in groups.values():
            xp = get_array_module(members[0][2])
            flat = xp.concatenate([v.ravel() for _, _, v in members])
            copies.append(([(c, n, v.shape) for c, n, v in members], flat))
        self._backup = (copies, scalars)

    def forget(self) -> None:
        """Drop the backup (a restored model: a skipped step before the
        next :meth:`checkpoint` leaves the running statistics as they
        are)."""
        self._backup = None

    def restore(self) -> None:
        """Put the values of the last :meth:`checkpoint` back."""
        copies, scalars = self._backup or ((), ())
        for members, flat in copies:
            start = 0
            for child, name, shape in members:
                size = int(numpy.prod(shape))
                getattr(child, name)[...] = flat[start:start + size].reshape(
                    shape)
                start += size
        for child, name, value in scalars:
            setattr(child, name, value)

    def check(self, arrays: Sequence,
              agree: Optional[Callable[[bool], bool]] = None,
              updated: Optional[Sequence] = None) -> bool:
        """Whether every array is finite (on every process, with ``agree``,
        a logical and over processes); records :attr:`skipped`. On the GPU
        one kernel and one host synchronisation for all arrays.
        ``updated`` (the parameters the update writes) is for
        :meth:`DeviceStepGuard.check
        <chainerkfac.device_guard.DeviceStepGuard.check>`; unused here."""
        finite = fused.all_finite(arrays)
        if agree is not None:
            finite = agree(finite)
        self.skipped = not finite
        self.skipped_steps += int(self.skipped)
        return finite

    def observation(self) -> float:
        """The last step's flag for :func:`chainer.reporter.report` (1.0:
        skipped)."""
        return float(self.skipped)

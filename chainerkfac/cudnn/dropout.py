"""Dropout with cuDNN's random states, as CuPy 13's
``cupyx.cudnn.DropoutStates`` (Chainer 7.8.1's ``F.dropout`` on a GPU takes
it through ``chainer.backends.cuda.get_cudnn_dropout_states()``, one per
device and thread).

The states (cuDNN's RNG, seeded once) and the dropout descriptor live as
long as the object; the mask of a forward pass travels in the reserve
space it returns, which the backward pass (and a re-run of the forward
pass on the same mask) gets back.
"""
import weakref

import numpy

from chainerkfac.cudnn import plans
from chainerkfac.cudnn import runtime


class DropoutStates:
    """cuDNN's dropout RNG states and descriptor on the current device.

    Parameters
    ----------
    handle : int or None
        A cuDNN handle; None (what Chainer passes) for the backend's own.
    seed : int
        Seed of cuDNN's generator.
    """

    def __init__(self, handle, seed):
        rt = runtime.current()
        lib = rt.lib
        handle = rt.handle(handle)
        self._states = rt.arrays.alloc(lib.size('cudnnDropoutGetStatesSize',
                                                handle))
        self._desc = lib.create('DropoutDescriptor')
        weakref.finalize(self, lib.destroy, 'DropoutDescriptor', self._desc)
        lib.call('cudnnSetDropoutDescriptor', self._desc, handle, 0.0,
                 self._states.ptr, self._states.nbytes, int(seed))

    def set_dropout_ratio(self, dropout_ratio):
        rt = runtime.current()
        self._set_ratio(rt.lib, rt.handle(), dropout_ratio)

    def _set_ratio(self, lib, handle, dropout_ratio):
        # NULL states: cuDNN keeps the generator's state, sets the ratio.
        lib.call('cudnnSetDropoutDescriptor', self._desc, handle,
                 float(dropout_ratio), None, 0, 0)

    def _plan(self, rt, array):
        key = ('dropout', array.shape, array.dtype.char,
               rt.arrays.device_id())
        return rt.plans.get(key, _build, rt, array)

    def forward(self, handle, x, dropout_ratio):
        """Drop elements of ``x`` with probability ``dropout_ratio`` and
        scale the rest by ``1 / (1 − ratio)``.

        Returns
        -------
        reserve_space, y
            ``reserve_space`` (bytes holding the mask) for :meth:`backward`.
        """
        rt = runtime.current()
        arrays = rt.arrays
        x = arrays.contiguous(x)
        plan = self._plan(rt, x)
        handle = rt.handle(handle)
        self._set_ratio(rt.lib, handle, dropout_ratio)
        y = arrays.empty(x.shape, x.dtype)
        reserve = arrays.empty((plan.reserve,), numpy.int8)
        rt.lib.call('cudnnDropoutForward', handle, self._desc, plan.x,
                    arrays.pointer(x), plan.x, arrays.pointer(y),
                    arrays.pointer(reserve), reserve.size)
        return reserve, y

    def backward(self, handle, dy, dropout_ratio, reserve_space):
        """``dy`` masked and scaled as the forward pass that returned
        ``reserve_space``."""
        rt = runtime.current()
        arrays = rt.arrays
        dy = arrays.contiguous(dy)
        plan = self._plan(rt, dy)
        handle = rt.handle(handle)
        self._set_ratio(rt.lib, handle, dropout_ratio)
        dx = arrays.empty(dy.shape, dy.dtype)
        rt.lib.call('cudnnDropoutBackward', handle, self._desc, plan.x,
                    arrays.pointer(dy), plan.x, arrays.pointer(dx),
                    arrays.pointer(reserve_space), reserve_space.size)
        return dx


def _build(d, rt, array):
    """The ``(shape[0], size / shape[0], 1, 1)`` view of ``array`` and the
    size of its mask."""
    plan = plans.Plan(d)
    plan.x = d.as_4d(array)
    plan.reserve = rt.lib.size('cudnnDropoutGetReserveSpaceSize', plan.x)
    return plan

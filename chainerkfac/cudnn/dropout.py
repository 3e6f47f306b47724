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

    def forward(self, handle, x, dropout_ratio):
        """Drop elements of ``x`` with probability ``dropout_ratio`` and
        scale the rest by ``1 / (1 − ratio)``.

        Returns
        -------
        reserve_space, y
            ``reserve_space`` (bytes holding the mask) for :meth:`backward`.
        """
        with runtime.call(x.dtype, handle) as c:
            lib, arrays = c.lib, c.arrays
            self._set_ratio(lib, c.handle, dropout_ratio)
            x = arrays.contiguous(x)
            y = arrays.empty(x.shape, x.dtype)
            desc = c.d.as_4d(x)
            reserve = arrays.empty(
                (lib.size('cudnnDropoutGetReserveSpaceSize', desc),),
                numpy.int8)
            lib.call('cudnnDropoutForward', c.handle, self._desc, desc,
                     arrays.pointer(x), desc, arrays.pointer(y),
                     arrays.pointer(reserve), reserve.size)
        return reserve, y

    def backward(self, handle, dy, dropout_ratio, reserve_space):
        """``dy`` masked and scaled as the forward pass that returned
        ``reserve_space``."""
        with runtime.call(dy.dtype, handle) as c:
            arrays = c.arrays
            self._set_ratio(c.lib, c.handle, dropout_ratio)
            dy = arrays.contiguous(dy)
            dx = arrays.empty(dy.shape, dy.dtype)
            desc = c.d.as_4d(dy)
            c.lib.call('cudnnDropoutBackward', c.handle, self._desc, desc,
                       arrays.pointer(dy), desc, arrays.pointer(dx),
                       arrays.pointer(reserve_space), reserve_space.size)
        return dx

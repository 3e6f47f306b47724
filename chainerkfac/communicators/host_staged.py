"""K-FAC collectives over MPI for CuPy arrays, staged through host memory.

Each collective copies its packed buffer from the GPU to the host, runs the
MPI collective of :mod:`chainerkfac.communicators.naive` on it, and copies
the result back to the GPU it came from (as the naive flavour does for any
CuPy buffer); this flavour also stages ChainerMN's own ``bcast_data`` and
``multi_node_mean_grad``. The packing and unpacking (the
gather-and-cast kernel, the triangles, the padding) stay on the GPU, exactly
as with NCCL.

Two uses:

* **Several ranks on one GPU.** NCCL refuses two processes on the same
  device, so ``pure_nccl`` cannot run ``mpiexec -n 2..4`` on a one-GPU
  machine; this flavour can, and with ``pad_segments=True`` it packs the
  padded segments of ``pure_nccl``, so the GPU side of the multi-rank path
  is exercised as NCCL would exercise it.
* **A fallback without NCCL** (CuPy built without it, or an MPI that is not
  CUDA-aware): correct everywhere MPI runs, but every collective pays two
  host↔device copies and a synchronisation.

Importing this module does not need CuPy. NumPy arrays pass straight
through (it then behaves as the ``naive`` flavour).
"""
import collections

import numpy

import chainer
from chainermn.communicators import _memory_utility

from chainerkfac.communicators.naive import KfacNaiveCommunicator


def _to_host(array):
    """``array`` in host memory (itself if it is a NumPy array)."""
    return chainer.backend.CpuDevice().send(array)


def _to_device_of(host, like):
    """``host`` sent to the device of ``like`` (itself if that is the
    CPU)."""
    return chainer.backend.get_device_from_array(like).send(host)


def _all_numpy(arrays) -> bool:
    return all(isinstance(a, numpy.ndarray) for a in arrays)


class KfacHostStagedCommunicator(KfacNaiveCommunicator):
    """ChainerMN's ``NaiveCommunicator`` with K-FAC's collectives, for CuPy
    arrays through host memory (see the module docstring).

    Overrides ChainerMN's ``bcast_data`` and ``multi_node_mean_grad`` to
    stage CuPy parameters and gradients the same way. ChainerMN's other
    array collectives (``allreduce``, ``bcast``, ``send`` ...) are
    ``NaiveCommunicator``'s: with CuPy arrays they need a CUDA-aware MPI.

    Parameters
    ----------
    mpi_comm : mpi4py.MPI.Comm
    wire_dtype : str, numpy.dtype or None
        Element type of ``reduce_scatter_v`` / ``all_gather_v`` on the wire:
        None (default) the arrays' common type, at least float32; or
        'float16', 'float32', 'float64'.
    pad_segments : bool
        Pad every rank's segment to the longest one, as ``pure_nccl`` must
        (its collectives take one count for all ranks). Only worth it to
        test the GPU packing of ``pure_nccl`` where NCCL cannot run: the
        padding is sent too.
    """

    def __init__(self, mpi_comm, wire_dtype=None,
                 pad_segments: bool = False):
        super(KfacHostStagedCommunicator, self).__init__(
            mpi_comm, wire_dtype=wire_dtype)
        self._pad_segments = bool(pad_segments)

    @property
    def pad_segments(self) -> bool:
        """Whether segments are padded to equal lengths (``pure_nccl``'s
        layout)."""
        return self._pad_segments

    def split(self, color, key):
        return self.__class__(mpi_comm=self.mpi_comm.Split(color, key),
                              wire_dtype=self.wire_dtype,
                              pad_segments=self._pad_segments)

    # K-FAC's collectives are the naive flavour's, which stage CuPy
    # buffers through the host (chainerkfac.communicators.naive).

    # -- ChainerMN's collectives ----------------------------------------------
    def bcast_data(self, model):
        """Broadcast rank 0's parameters (bit for bit, every dtype)."""
        params = [param for _, param in sorted(model.namedparams())
                  if param.array is not None]
        if _all_numpy(p.array for p in params):
            return super(KfacHostStagedCommunicator, self).bcast_data(model)
        for param in params:
            host = numpy.ascontiguousarray(_to_host(param.array))
            self.mpi_comm.Bcast(host.reshape(-1).view(numpy.uint8))
            param.array[...] = _to_device_of(host, param.array)

    def multi_node_mean_grad(self, model, zero_fill=False):
        """Average the gradients over ranks: one MPI ``Allreduce`` per
        gradient dtype over all gradients packed on the device."""
        params = _memory_utility.extract_params_set_grad(model, zero_fill)
        if _all_numpy(p.array for p in params):
            return super(KfacHostStagedCommunicator,
                         self).multi_node_mean_grad(model, zero_fill)
        groups = collections.defaultdict(list)
        for param in params:
            if zero_fill and param.grad is None:
                param.grad = param.xp.zeros_like(param.array)
            groups[numpy.dtype(param.grad.dtype)].append(param.grad)
        for grads in groups.values():
            xp = chainer.backend.get_array_module(grads[0])
            flat = xp.concatenate([g.ravel() for g in grads])
            host = _to_host(flat)
            # Allreduce in place, then × 1/size (float16 summed as float32).
            self._multi_node_mean(None, host)
            flat = _to_device_of(host, flat)
            start = 0
            for grad in grads:
                grad[...] = flat[start:start + grad.size].reshape(grad.shape)
                start += grad.size

"""Several processes, one global batch.

With a ChainerMN communicator every process holds a local batch, and the
global batch is the local batches in rank order. Everything is scaled to
the global batch size ``N`` (the mean loss's ``1/N``), so that a
per-sample quantity of a process equals the rows one process computes on
the global batch, and a quantity that sums over samples equals it after a
sum over processes (one ``Allreduce`` of all of them packed together).
"""
from typing import List, NamedTuple, Optional

import numpy

import chainer


class Batch(NamedTuple):
    """The local batch within the global one."""
    local: int
    total: int
    offset: int
    comm: Optional[object] = None

    @classmethod
    def of(cls, local: int, comm=None) -> 'Batch':
        """The local batch of ``local`` samples of this process."""
        if comm is None or comm.size == 1:
            return cls(local, local, 0, comm)
        sizes = comm.mpi_comm.allgather(int(local))
        return cls(local, int(sum(sizes)), int(sum(sizes[:comm.rank])), comm)

    @property
    def distributed(self) -> bool:
        return self.comm is not None and self.comm.size > 1


def sum_over_processes(batch: Batch, arrays: List) -> List:
    """The element-wise sums over processes of ``arrays`` (the same shapes
    and dtypes on every process), in one collective per dtype."""
    if not batch.distributed or not arrays:
        return list(arrays)
    out = [None] * len(arrays)
    by_dtype = {}
    for i, array in enumerate(arrays):
        by_dtype.setdefault(numpy.dtype(array.dtype), []).append(i)
    for dtype, indices in sorted(by_dtype.items(), key=lambda d: d[0].str):
        xp = chainer.backend.get_array_module(arrays[indices[0]])
        packed = xp.concatenate([arrays[i].ravel() for i in indices])
        total = batch.comm.allreduce(packed)
        start = 0
        for i in indices:
            size = arrays[i].size
            out[i] = total[start:start + size].reshape(arrays[i].shape)
            start += size
    return out


def shared_seed(batch: Batch, seed: Optional[int]) -> Optional[int]:
    """``seed``, or one drawn by rank 0 for all processes when it is None
    and the batch is distributed (every process then draws its rows of the
    same global draw)."""
    if seed is not None or not batch.distributed:
        return seed
    drawn = int(numpy.random.randint(2 ** 31)) if batch.comm.rank == 0 \
        else None
    return batch.comm.bcast_obj(drawn)

"""Stages 3 and 6: how gradients, factors and preconditioned gradients
travel between processes.

The optimizer talks to one object with the :class:`Transport` interface:

* :class:`LocalTransport` — one process: nothing travels, this process owns
  every block (a null object, so one and N processes share one code path);
* :class:`MultiNodeTransport` — Algorithm 1 over a ChainerMN communicator:
  one ReduceScatterV of gradients and due factors, model-parallel
  ownership of the blocks (:mod:`chainerkfac.assignment`), one AllGatherV of
  the preconditioned gradients — or, with weight-update sharding
  (:mod:`chainerkfac.sharding`), of the weights the owners updated.

Both return *sums* over processes; the optimizer averages (gradients over
processes, factors over the micro-batches that captured them).
"""
import hashlib
import logging
from typing import Dict, List, Optional, Sequence

import numpy
from chainer.backend import get_array_module

try:
    from typing import Protocol
except ImportError:  # pragma: no cover  (Python < 3.8)
    Protocol = object

from chainerkfac import sharding
from chainerkfac.assignment import Assignment

logger = logging.getLogger(__name__)


class Transport(Protocol):
    """What the optimizer needs from a transport.

    Attributes
    ----------
    rank, size : int
        This process and the number of processes.
    """

    rank: int
    size: int

    def setup(self, optimizer) -> bool:
        """Once, at the first update, when the optimizer's blocks and
        parameters exist: make the processes consistent and decide the
        owners. Returns whether any process's parameters changed (they
        were replaced by rank 0's): the same on every process."""

    def owns(self, block) -> bool:
        """Whether this process inverts and preconditions ``block``."""

    def all_sum(self, vector: numpy.ndarray) -> numpy.ndarray:
        """Element-wise sum of a small host int64 vector over processes."""

    def all_sum_float(self, vector: numpy.ndarray) -> numpy.ndarray:
        """Element-wise sum of a small host float64 vector over processes,
        added in rank order: the same bits on every process."""

    def sends(self, block) -> bool:
        """Whether this process is ``block``'s first owner (the one whose
        direction every process receives)."""

    def reduce_scatter(self, blocks: Sequence, grads: Dict[object, List],
                       factors: Dict[object, Dict]):
        """Sum gradients and factors over processes, for the owned blocks.

        ``grads[block]`` aligns with ``block.params``; an entry of None (no
        process has that gradient) does not travel. ``factors[block]`` maps
        factor names to arrays; only those present travel. Returns
        ``(grads, factors)`` for the blocks this process owns.
        """

    def all_gather(self, blocks: Sequence, directions: Dict[object, List],
                   present: Dict[object, List[bool]]) -> Dict[object, List]:
        """Give every process each owned block's directions, aligned with
        ``block.params``; parameters whose ``present`` flag is False (no
        gradient on any process) do not travel and come back as None."""

    def agree(self, flag: bool) -> bool:
        """Logical and of ``flag`` over processes."""

    def updates(self, block) -> bool:
        """Weight-update sharding: whether this process updates
        ``block``'s parameters and keeps their optimizer state (its first
        owner)."""

    def gather_weights(self, blocks: Sequence,
                       present: Dict[object, List[bool]]) -> None:
        """Weight-update sharding: give every process the weights each
        block's updating process holds (in place), for the parameters
        whose ``present`` flag is True."""


class LocalTransport:
    """One process: every block is owned here and nothing is sent."""

    rank = 0
    size = 1

    def setup(self, optimizer) -> bool:
        return False

    def owns(self, block) -> bool:
        return True

    def all_sum(self, vector):
        return vector

    def all_sum_float(self, vector):
        return numpy.asarray(vector, numpy.float64)

    def sends(self, block) -> bool:
        return True

    def reduce_scatter(self, blocks, grads, factors):
        return grads, factors

    def all_gather(self, blocks, directions, present):
        return directions

    def agree(self, flag: bool) -> bool:
        return flag

    def updates(self, block) -> bool:
        return True

    def gather_weights(self, blocks, present) -> None:
        return None


class MultiNodeTransport:
    """ReduceScatterV / AllGatherV of K-FAC over a ChainerMN communicator.

    Parameters
    ----------
    comm : ChainerMN communicator
        Used for ChainerMN's own collectives (``bcast_data``) and MPI.
    collectives : object with ``reduce_scatter_v`` / ``all_gather_v``
        K-FAC's collectives over the same processes (the communicator
        itself when it has them; see
        :func:`chainerkfac.communicators.kfac_collectives`).

    Attributes
    ----------
    assignment : Assignment
        Block owners, built at :meth:`setup`.
    """

    def __init__(self, comm, collectives):
        self.comm = comm
        self.collectives = collectives
        self.rank = comm.rank
        self.size = comm.size
        self.assignment: Optional[Assignment] = None
        self._owners: Dict[object, tuple] = {}

    # -- set-up ---------------------------------------------------------------
    def setup(self, optimizer) -> bool:
        """Check the processes agree, broadcast rank 0's parameters, assign
        the blocks.

        Raises
        ------
        ValueError
            on every process, if the model structure or the optimizer's
            configuration differ between processes (naming what differs).
        """
        target = optimizer.target
        items = optimizer.config_fingerprint()
        wire = getattr(self.collectives, 'wire_dtype', None)
        items['wire_dtype'] = 'the data\'s' if wire is None else \
            str(numpy.dtype(wire))
        check_same_everywhere(self.comm.mpi_comm, items, 'K-FAC multi-node')
        changed = broadcast_params(self.comm, target)
        blocks = optimizer.blocks
        self.assignment = Assignment.from_blocks(blocks, self.size)
        self._owners = {b: self.assignment.owners[i]
                        for i, b in enumerate(blocks)}
        if optimizer.verbose and self.rank == 0:
            logger.info('%s', self.assignment.describe())
        return changed

    # -- stages 3 and 6 -------------------------------------------------------
    def owns(self, block) -> bool:
        return self.rank in self._owners[block]

    def all_sum(self, vector):
        from mpi4py import MPI
        vector = numpy.ascontiguousarray(vector, dtype=numpy.int64)
        out = numpy.empty_like(vector)
        self.comm.mpi_comm.Allreduce(vector, out, op=MPI.SUM)
        return out

    def all_sum_float(self, vector):
        # Gathered and added in rank order: MPI's Allreduce may add in
        # another order on each rank, and every rank must get equal bits.
        parts = self.comm.mpi_comm.allgather(
            numpy.ascontiguousarray(vector, dtype=numpy.float64))
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
        return total

    def sends(self, block) -> bool:
        return self._owners[block][0] == self.rank

    def reduce_scatter(self, blocks, grads, factors):
        """One ReduceScatterV of every present gradient and factor; factors
        travel packed when symmetric."""
        arrays, owners, symmetric, slots = [], [], [], []
        for block in blocks:
            owner = self._owners[block]
            for i, grad in enumerate(grads[block]):
                if grad is None:
                    continue
                arrays.append(grad)
                owners.append(owner)
                symmetric.append(False)
                slots.append((block, i))
            due = factors.get(block, {})
            for name in block.factor_names:
                if name in due:
                    arrays.append(due[name])
                    owners.append(owner)
                    # Not a square: a low-rank factor's columns.
                    symmetric.append(block.symmetric(name) and
                                     due[name].shape[0] == due[name].shape[-1])
                    slots.append((block, name))
        reduced = self.collectives.reduce_scatter_v(arrays, owners, symmetric)
        mine = [b for b in blocks if self.owns(b)]
        out_grads = {b: [None] * len(grads[b]) for b in mine}
        out_factors = {b: {} for b in mine}
        for (block, key), value in zip(slots, reduced):
            if value is None:
                continue
            if isinstance(key, int):
                out_grads[block][key] = value
            else:
                out_factors[block][key] = value
        return out_grads, out_factors

    def all_gather(self, blocks, directions, present):
        """One AllGatherV of the preconditioned gradients (first owners
        send)."""
        arrays, owners, slots = [], [], []
        for block in blocks:
            owner = self._owners[block]
            sends = owner[0] == self.rank
            mine = directions.get(block)
            for i, param in enumerate(block.params):
                if not present[block][i]:
                    continue
                # Non-senders pass the parameter: only shape and dtype are
                # read, and those must match on every rank.
                arrays.append(mine[i].astype(param.dtype, copy=False)
                              if sends else param.array)
                owners.append(owner)
                slots.append((block, i))
        gathered = self.collectives.all_gather_v(arrays, owners)
        out = {b: [None] * len(b.params) for b in blocks}
        for (block, i), value in zip(slots, gathered):
            out[block][i] = value
        return out

    def agree(self, flag: bool) -> bool:
        """Logical and of ``flag`` over all ranks."""
        return all(self.comm.mpi_comm.allgather(bool(flag)))

    def updates(self, block) -> bool:
        return self._owners[block][0] == self.rank

    def gather_weights(self, blocks, present) -> None:
        """One AllGatherV of the updated weights (first owners send), at
        the parameters' dtype (:func:`chainerkfac.sharding.
        all_gather_weights`)."""
        params, owners = [], []
        for block in blocks:
            for param, has in zip(block.params, present[block]):
                if has:
                    params.append(param)
                    owners.append(self._owners[block])
        sharding.all_gather_weights(self.collectives, params, owners,
                                    self.rank)


def broadcast_params(comm, target) -> bool:
    """Give every process of ``comm`` rank 0's parameters of ``target``
    (``comm.bcast_data``); returns whether any process's changed, agreed
    by all: a process that drops its first micro-batch for it takes one
    step fewer, so every process must drop it (rank 0, whose values never
    change, included), or rank 0 would wait in a collective of a step the
    others never take."""
    before = [p.array.copy() for _, p in sorted(target.namedparams())
              if p.array is not None]
    comm.bcast_data(target)
    after = [p.array for _, p in sorted(target.namedparams())
             if p.array is not None]
    changed = any(not _same(a, b) for a, b in zip(before, after))
    return bool(comm.mpi_comm.allreduce(int(changed)))


def _same(a, b) -> bool:
    return bool(get_array_module(a).array_equal(a, b))


def check_same_everywhere(mpi_comm, items: Dict[str, str],
                          who: str) -> None:
    """Raise on every process where the processes' ``items`` differ,
    naming each differing key and the ranks of each value (a digest is
    compared first: one small collective when they agree).

    Raises
    ------
    ValueError
        ``'<who>: the processes disagree on the model or the optimizer'``,
        the same on every process.
    """
    digest = hashlib.sha256(repr(sorted(items.items())).encode())
    digests = mpi_comm.allgather(digest.hexdigest())
    if len(set(digests)) == 1:
        return
    # Every rank gets the same lists, so every rank raises the same.
    everyone = mpi_comm.allgather(items)
    keys = sorted(set().union(*everyone))
    lines = []
    for key in keys:
        values = [d.get(key, '<absent>') for d in everyone]
        if len(set(values)) > 1:
            lines.append('  {}: {}'.format(key, '; '.join(
                '{} on {}'.format(value, _ranks_text(
                    [r for r, v in enumerate(values) if v == value]))
                for value in sorted(set(values), key=values.index))))
    shown = lines[:20] + (['  ... {} more'.format(len(lines) - 20)]
                          if len(lines) > 20 else [])
    raise ValueError(
        '{}: the processes disagree on the model or the optimizer ({} '
        'differences):\n'.format(who, len(lines)) + '\n'.join(shown))


def _ranks_text(ranks: List[int]) -> str:
    """'rank 3' or 'ranks 0-2,5'."""
    runs = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ','.join(str(a) if a == b else '{}-{}'.format(a, b)
                    for a, b in runs)
    return ('rank ' if len(ranks) == 1 else 'ranks ') + text

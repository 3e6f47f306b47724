"""Weight-update sharding (seed 002, "weight update sharding"): each
process applies the update to the parameters it owns, and the new weights
travel to every process in one AllGatherV.

Without sharding every process applies the whole update (momentum, weight
decay, the LARS trust ratio, K-FAC's eq. 20 rescaling) to every parameter
and keeps every parameter's optimizer state (velocities). With it:

* one process *owns* each parameter (:class:`ParameterOwners`): it alone
  updates the parameter and holds its optimizer state, so the update's work
  and the state's memory are divided among the processes;
* the first-order baselines (:class:`~chainerkfac.optimizers.
  GuardedOptimizer`) reduce-scatter the gradients to the owners (instead of
  all-reducing them) and all-gather the new weights: the all-reduce's bytes,
  split in two;
* K-FAC already leaves each block's gradient on its owner (Algorithm 1):
  the owner updates the block's parameters, and the new weights travel in
  place of the preconditioned gradients (the same bytes at the same dtype),
  so the update is done once.

Who owns what is pure logic (:class:`ParameterOwners`, no MPI); the
collectives are a communicator's ``reduce_scatter_v`` / ``all_gather_v``
(:mod:`chainerkfac.communicators`), called by :func:`reduce_scatter_mean`
and :func:`all_gather_weights`.

Weights travel at the parameters' own dtype whatever the communicator's
wire dtype (a float16 wire would round every weight, and an update
smaller than the rounding would be lost): sharded and unsharded runs
then agree to the arithmetic's rounding, every process holds the owner's
weights bit for bit.

Optimizer state: each process's snapshot holds the state of the
parameters it owns; loading every process's file into each process
(``load_npz(..., strict=False)``: absent keys leave the state alone)
merges them, and :func:`drop_unowned_state` keeps the owned ones only —
how a run resumes on another number of processes.
"""
import logging
from typing import Iterable, List, Optional, Sequence

import numpy

import chainer

from chainerkfac.assignment import Assignment

logger = logging.getLogger(__name__)


class ParameterOwners:
    """Per parameter, the one process that updates it and keeps its state.

    Parameters
    ----------
    owners : sequence of int
        Per parameter, its owner rank in ``[0, size)``.
    size : int
        Number of processes.
    sizes : sequence of int, optional
        Per parameter, its number of elements (for :attr:`loads` and
        :meth:`describe`).
    names : sequence of str, optional
        Per parameter, its name (for :meth:`describe`).
    """

    def __init__(self, owners: Sequence[int], size: int,
                 sizes: Optional[Sequence[int]] = None,
                 names: Optional[Sequence[str]] = None):
        if size < 1:
            raise ValueError('size must be >= 1, got {}'.format(size))
        self.owners = tuple(int(o) for o in owners)
        self.size = int(size)
        bad = [i for i, o in enumerate(self.owners) if not 0 <= o < size]
        if bad:
            raise ValueError('parameter {} has owner {} outside [0, {})'
                             .format(bad[0], self.owners[bad[0]], size))
        n = len(self.owners)
        self.sizes = tuple(int(s) for s in sizes) if sizes is not None \
            else (1,) * n
        self.names = tuple(names) if names is not None else tuple(
            str(i) for i in range(n))
        if not len(self.sizes) == len(self.names) == n:
            raise ValueError('owners, sizes and names need one entry per '
                             'parameter')

    @classmethod
    def balanced(cls, sizes: Sequence[int], size: int,
                 names: Optional[Sequence[str]] = None
                 ) -> 'ParameterOwners':
        """Owners that balance the elements per process (the update's
        work and state are proportional to them): longest processing time
        first (:class:`~chainerkfac.assignment.Assignment`), one owner per
        parameter."""
        assignment = Assignment(sizes, size, names,
                                curvature=[False] * len(sizes))
        return cls([o[0] for o in assignment.owners], size, sizes, names)

    @classmethod
    def of_blocks(cls, block_owners: Sequence[Sequence[int]],
                  block_sizes: Sequence[Sequence[int]], size: int,
                  names: Optional[Sequence[str]] = None
                  ) -> 'ParameterOwners':
        """K-FAC: each parameter is owned by its Fisher block's first owner
        (the process that sends the block in the all-gather; blocks
        computed redundantly are updated once).

        Parameters
        ----------
        block_owners : sequence of sequence of int
            Per block, its owners (:attr:`Assignment.owners`).
        block_sizes : sequence of sequence of int
            Per block, the sizes of its parameters, in order.
        """
        owners, sizes = [], []
        for ranks, params in zip(block_owners, block_sizes):
            owners += [ranks[0]] * len(params)
            sizes += list(params)
        return cls(owners, size, sizes, names)

    def owns(self, rank: int, index: int) -> bool:
        return self.owners[index] == rank

    def params_of(self, rank: int) -> List[int]:
        """Indices of the parameters ``rank`` owns."""
        return [i for i, o in enumerate(self.owners) if o == rank]

    @property
    def loads(self) -> tuple:
        """Per rank, the elements of the parameters it owns."""
        loads = [0] * self.size
        for owner, n in zip(self.owners, self.sizes):
            loads[owner] += n
        return tuple(loads)

    def describe(self) -> str:
        """Rank → parameters and share of the elements (start-up log)."""
        total = sum(self.sizes) or 1
        lines = ['weight-update sharding: {} parameters ({} elements) over '
                 '{} processes'.format(len(self.owners), sum(self.sizes),
                                       self.size)]
        for rank, load in enumerate(self.loads):
            mine = self.params_of(rank)
            lines.append('rank {}: {:5.1f}% of elements, {} parameters'
                         .format(rank, 100.0 * load / total, len(mine)))
        return '\n'.join(lines)


def wire_dtype_of(arrays: Iterable) -> numpy.dtype:
    """The dtype in which ``arrays`` travel unrounded: their common type."""
    return numpy.result_type(*[a.dtype for a in arrays])


def reduce_scatter_mean(collectives, grads: Sequence, owners: Sequence[int],
                        size: int) -> List:
    """The gradients averaged over processes, on their owners.

    Parameters
    ----------
    collectives : object with ``reduce_scatter_v``
    grads : sequence of arrays
        This process's gradient of each parameter (the same list of shapes
        and dtypes on every process).
    owners : sequence of int
    size : int
        Number of processes.

    Returns
    -------
    list
        Aligned with ``grads``: the mean over processes where this process
        owns the parameter, else None. Summed at the gradients' own dtype.
    """
    if not grads:
        return []
    reduced = collectives.reduce_scatter_v(
        list(grads), list(owners), wire_dtype=wire_dtype_of(grads))
    if size > 1:
        for grad in reduced:
            if grad is not None:
                grad *= grad.dtype.type(1.0 / size)
    return reduced


def all_gather_weights(collectives, params: Sequence, owners: Sequence,
                       rank: int) -> None:
    """Give every process the owners' weights (in place).

    Parameters
    ----------
    collectives : object with ``all_gather_v``
    params : sequence of chainer.Parameter
        The same list (shapes, dtypes, order) on every process.
    owners : sequence of int or tuple of int
        Per parameter its owner, or owners with the sender first (K-FAC's
        redundantly computed blocks).
    rank : int
        This process.
    """
    if not params:
        return
    arrays = [p.array for p in params]
    gathered = collectives.all_gather_v(arrays, list(owners),
                                        wire_dtype=wire_dtype_of(arrays))
    for param, owner, value in zip(params, owners, gathered):
        sender = owner if isinstance(owner, (int, numpy.integer)) \
            else owner[0]
        if sender != rank:
            param.array[...] = value


def drop_state(rule) -> None:
    """Forget the optimizer state of one update rule (a parameter owned by
    another process). Chainer has no public call for it: ``None`` is the
    rule's own "not initialised yet" (state created at its next update,
    filled by a deserializer)."""
    rule._state = None


class PartialStateDeserializer(chainer.serializer.Deserializer):
    """What a sharded optimizer's update rules are loaded through: a
    state entry the file lacks is left as it is, where ``inner`` (strict,
    as ``load_npz``'s default and Chainer's ``snapshot(autoload=True)``)
    would raise. Each process's file holds the velocities it owned only,
    and before the first sharded step which are owned is not decided; the
    owned ones still missing then are warned about
    (:func:`drop_unowned_state`). Everything else — the optimizer's and
    each rule's step count, and what is not under a parameter's path — is
    read as ``inner`` reads it."""

    def __init__(self, inner, under_parameter: bool = False):
        self.inner = inner
        self.under_parameter = under_parameter

    def __getitem__(self, key):
        return PartialStateDeserializer(self.inner[key], True)

    def __call__(self, key, value):
        if not self.under_parameter or key == 't':
            return self.inner(key, value)
        try:
            return self.inner(key, value)
        except KeyError:
            return value


def drop_unowned_state(params: Sequence, owned: Sequence[bool],
                       names: Optional[Sequence[str]] = None) -> int:
    """Drop the state of the parameters this process does not own; warn
    about owned ones that have taken steps but hold no state (a snapshot
    whose files were not all loaded: their velocities restart at zero),
    naming them by ``names`` (default: the parameters' own names).
    Returns how many states were dropped."""
    dropped, lost = 0, []
    if names is None:
        names = [p.name for p in params]
    for param, mine, name in zip(params, owned, names):
        rule = param.update_rule
        if rule is None:
            continue
        if not mine:
            if rule.state is not None:
                drop_state(rule)
                dropped += 1
        elif rule.enabled and rule.t > 0 and rule.state is None:
            # (A rule without state, plain SGD's, holds {} once used.)
            lost.append(name)
    if lost:
        logger.warning(
            'weight-update sharding: %d owned parameters have taken steps '
            'but have no optimizer state %s; it restarts from zero: %s',
            len(lost), PER_PROCESS_HINT, ', '.join(map(str, lost[:5])))
    return dropped


#: Where a restored per-process state lacks what its process owns.
PER_PROCESS_HINT = (
    "(a snapshot of another number of processes whose files were not all "
    "loaded, or another process's file loaded, as "
    "chainermn.extensions.multi_node_snapshot does with replica_sets=[] "
    "(rank 0's everywhere) or [0] on 3 or more processes (rank 1's on "
    "ranks 2 and up): the files are per process, replica_sets=[[r] for r "
    "in range(comm.size)])")


def state_nbytes(params: Iterable) -> int:
    """Bytes of the optimizer state held for ``params`` (the arrays of
    their update rules' states)."""
    total = 0
    for param in params:
        rule = param.update_rule
        if rule is None or rule.state is None:
            continue
        total += sum(int(v.nbytes) for v in rule.state.values()
                     if hasattr(v, 'nbytes'))
    return total

"""Distributed K-FAC: stages 3 and 6 over a ChainerMN communicator.

The one-line swap for ``chainermn.create_multi_node_optimizer``::

    comm = chainerkfac.communicators.create_communicator('naive')
    optimizer = create_multi_node_optimizer(
        chainerkfac.optimizers.KFAC(lr=..., momentum=...), comm)
    optimizer.setup(model)        # before or after the line above
    optimizer.update(lossfun, x_local, t_local)

Every process feeds its own part of the global mini-batch; the update equals
the one a single process takes with ``acc_iters = comm.size`` (times the
processes' own ``acc_iters``) fed the same parts in rank order. At the first
update :class:`MultiNodeTransport` checks that every process has the same
model and hyperparameters, broadcasts rank 0's parameters (that update is
*not* skipped, unlike ChainerMN's multi-node optimizer), and assigns the
blocks to processes (:mod:`chainerkfac.assignment`).

Snapshots are per process: each process holds the factors and inverses of
the blocks it owns only, so save every rank's optimizer (for a Trainer,
``chainermn.extensions.multi_node_snapshot(comm, snapshot,
replica_sets=[[r] for r in range(comm.size)])``, or one
``save_npz(f'optimizer_rank{comm.rank}.npz', optimizer)`` per rank) and
resume with the same number of processes. Resuming on a different number of
processes works too: blocks whose new owner lacks their factors make the
first step refresh every factor (a warning says so).

BatchNormalization's running statistics stay per process, as with
ChainerMN (``chainermn.extensions.AllreducePersistent`` averages them).
"""
import hashlib
import sys
from typing import Dict, List, Sequence

import numpy

from chainerkfac.assignment import Assignment
from chainerkfac.optimizers.kfac import KFAC

#: Epochs at which refresh-interval callables are compared across ranks.
_SCHEDULE_PROBE_EPOCHS = (0, 1, 2, 5, 10, 20, 30, 40, 50, 60, 80, 100)


def create_multi_node_optimizer(kfac_optimizer: KFAC, comm) -> KFAC:
    """Make a :class:`~chainerkfac.optimizers.KFAC` optimizer distributed.

    Parameters
    ----------
    kfac_optimizer : KFAC
        Set up with the model already, or to be set up afterwards.
    comm : communicator
        From :func:`chainerkfac.communicators.create_communicator` (a
        ChainerMN communicator with ``reduce_scatter_v`` / ``all_gather_v``;
        it also installs ChainerMN's global except hook, so an exception on
        one process ends the job).

    Returns
    -------
    KFAC
        The same optimizer object, its transport replaced by a
        :class:`MultiNodeTransport`.
    """
    if not isinstance(kfac_optimizer, KFAC):
        raise TypeError('create_multi_node_optimizer takes a '
                        'chainerkfac.optimizers.KFAC optimizer, got {}; for '
                        'first-order optimizers use chainermn.create_multi_'
                        'node_optimizer'.format(type(kfac_optimizer).__name__))
    if not hasattr(comm, 'reduce_scatter_v'):
        raise TypeError('the communicator has no reduce_scatter_v: create it '
                        'with chainerkfac.communicators.create_communicator')
    if kfac_optimizer._started:
        raise RuntimeError('create_multi_node_optimizer must be called '
                           'before the first optimizer.update')
    kfac_optimizer.transport = MultiNodeTransport(comm)
    return kfac_optimizer


class MultiNodeTransport:
    """ReduceScatterV / AllGatherV of K-FAC over a communicator.

    Same methods as :class:`chainerkfac.transport.LocalTransport`.

    Attributes
    ----------
    assignment : Assignment
        Block owners, built at :meth:`setup`.
    """

    def __init__(self, comm):
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self.assignment = None
        self._owners: Dict[object, tuple] = {}

    # -- set-up ---------------------------------------------------------------
    def setup(self, optimizer) -> None:
        """Check ranks agree, broadcast rank 0's parameters, assign blocks.

        Raises
        ------
        ValueError
            on every rank, if the model structure or the hyperparameters
            differ between ranks (the message names what differs).
        RuntimeError
            if a parameter is not initialised yet (lazily sized links): its
            value could not be broadcast before the first step.
        """
        target = optimizer.target
        missing = sorted(n for n, p in target.namedparams() if p.array is None)
        # Agree before raising, so no rank is left in a collective.
        if any(self.comm.mpi_comm.allgather(bool(missing))):
            raise RuntimeError(
                'K-FAC multi-node: parameters not initialised at the first '
                'update on some rank ({}{}): run one forward pass (or give '
                'the links their input sizes) before training, so that rank '
                "0's initial values can be broadcast before the first step"
                .format(', '.join(missing[:5]) or 'on another rank',
                        ', ...' if len(missing) > 5 else ''))
        self._check_same_everywhere(describe_setup(optimizer, self.comm))
        self.comm.bcast_data(target)
        blocks = optimizer.blocks
        self.assignment = Assignment.from_blocks(blocks, self.size)
        self._owners = {b: self.assignment.owners[i]
                        for i, b in enumerate(blocks)}
        self._refresh_if_shard_missing(optimizer)
        if optimizer.verbose and self.rank == 0:
            print(self.assignment.describe(), file=sys.stdout, flush=True)

    def _check_same_everywhere(self, items: Dict[str, str]) -> None:
        digest = hashlib.sha256(repr(sorted(items.items())).encode())
        digests = self.comm.mpi_comm.allgather(digest.hexdigest())
        if len(set(digests)) == 1:
            return
        # Every rank gets the same lists, so every rank raises the same.
        everyone = self.comm.mpi_comm.allgather(items)
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
            'K-FAC multi-node: the processes disagree on the model or the '
            'optimizer ({} differences):\n'.format(len(lines)) +
            '\n'.join(shown))

    def _refresh_if_shard_missing(self, optimizer) -> None:
        # A snapshot taken with another assignment lacks the factors of
        # the blocks this rank now owns: refresh everything once.
        lacking = [b.name for b in optimizer.blocks if self.owns(b) and any(
            n not in b.factors and optimizer.last_refresh[n] >= 0
            for n in b.factor_names)]
        if any(self.comm.mpi_comm.allgather(bool(lacking))):
            for kind in optimizer.last_refresh:
                optimizer.last_refresh[kind] = -1
            if self.rank == 0:
                print('K-FAC multi-node: the restored state lacks the factors '
                      'of blocks owned here (snapshot from another number of '
                      'processes?); all factors are refreshed at the next '
                      'step', file=sys.stderr, flush=True)

    # -- stages 3 and 6 -------------------------------------------------------
    def owns(self, block) -> bool:
        return self.rank in self._owners[block]

    def reduce_scatter(self, blocks: Sequence, grads: Dict[object, List],
                       factors: Dict[object, Dict]):
        """One ReduceScatterV of every gradient and every due factor.

        Returns, for the blocks this rank owns, the gradients and factors
        averaged over ranks (sum / size); factors travel packed when
        symmetric.
        """
        arrays, owners, symmetric, slots = [], [], [], []
        for block in blocks:
            owner = self._owners[block]
            for i, grad in enumerate(grads[block]):
                arrays.append(grad)
                owners.append(owner)
                symmetric.append(False)
                slots.append((block, i))
            due = factors.get(block, {})
            for name in block.factor_names:
                if name in due:
                    arrays.append(due[name])
                    owners.append(owner)
                    symmetric.append(block.symmetric(name))
                    slots.append((block, name))
        reduced = self.comm.reduce_scatter_v(arrays, owners, symmetric)
        mine = [b for b in blocks if self.owns(b)]
        out_grads = {b: [None] * len(grads[b]) for b in mine}
        out_factors = {b: {} for b in mine}
        for (block, key), value in zip(slots, reduced):
            if value is None:
                continue
            if self.size > 1:
                value /= self.size
            if isinstance(key, int):
                out_grads[block][key] = value
            else:
                out_factors[block][key] = value
        return out_grads, out_factors

    def all_gather(self, blocks: Sequence, directions: Dict[object, List]
                   ) -> Dict[object, List]:
        """One AllGatherV of the preconditioned gradients (first owners
        send)."""
        arrays, owners, slots = [], [], []
        for block in blocks:
            owner = self._owners[block]
            sends = owner[0] == self.rank
            for i, param in enumerate(block.params):
                # Non-senders pass the parameter: only shape and dtype are
                # read, and those must match on every rank.
                arrays.append(directions[block][i].astype(
                    param.dtype, copy=False) if sends else param.array)
                owners.append(owner)
                slots.append(block)
        gathered = self.comm.all_gather_v(arrays, owners)
        out = {b: [] for b in blocks}
        for block, value in zip(slots, gathered):
            out[block].append(value)
        return out

    def agree(self, flag: bool) -> bool:
        """Logical and of ``flag`` over all ranks."""
        return all(self.comm.mpi_comm.allgather(bool(flag)))


def describe_setup(optimizer: KFAC, comm) -> Dict[str, str]:
    """What must be equal on every rank: parameter names, shapes and dtypes,
    hyperparameters, step counters and the communicator's wire dtype.

    Returns
    -------
    dict
        ``{'param /conv/W': '(4, 2, 3, 3) float32', 'damping': '0.001',
        ...}`` — string values, comparable across processes.
    """
    items = {}
    for name, param in sorted(optimizer.target.namedparams()):
        items['param ' + name] = '{} {}'.format(tuple(param.shape),
                                                param.dtype)
    for name in ('lr', 'momentum'):
        items[name] = repr(getattr(optimizer.hyperparam, name))
    for name in ('damping', 'damping_target', 'damping_warmup_steps',
                 'rho_bn', 'bn_fisher', 'fisher', 'acc_iters',
                 'factor_dtype', 'factor_decay', 'weight_rescale',
                 'fisher_diff', 't', 'epoch'):
        items[name] = repr(getattr(optimizer, name))
    for kind, interval in sorted(optimizer.refresh_intervals.items()):
        items['refresh_interval_' + kind] = repr(
            [int(interval(optimizer.t, e)) for e in sorted(
                set(_SCHEDULE_PROBE_EPOCHS) | {optimizer.epoch})])
    for block in optimizer.blocks:
        items['block ' + block.name] = block.kind
    items['wire_dtype'] = str(numpy.dtype(comm.wire_dtype))
    return items


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

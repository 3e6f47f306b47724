"""Distributed K-FAC: the one-line swap for ChainerMN's multi-node optimizer.

::

    comm = chainermn.create_communicator('naive')   # 'pure_nccl' on GPUs
    # optimizer = chainermn.create_multi_node_optimizer(MomentumSGD(), comm)
    optimizer = chainerkfac.create_multi_node_optimizer(
        chainerkfac.optimizers.KFAC(), comm)
    optimizer.setup(model)        # before or after the line above
    optimizer.update(lossfun, x_local, t_local)

ChainerMN's own function works too: ``chainermn.create_multi_node_optimizer(
KFAC(...), comm)`` averages the gradients itself (an all-reduce) and calls
``KFAC.update()``, which finds the wrapper that holds it — by identity, a
subclass of ChainerMN's wrapper too (:mod:`chainerkfac.process_group`) —
and runs the same algorithm on the factors over its communicator (its
first update only broadcasts rank 0's parameters, as it does for any
optimizer). K-FAC without a communicator in a process group of several
processes is refused at the first update, unless built with
``process_local=True``.

Every process feeds its own part of the global mini-batch; the update equals
the one a single process takes with ``acc_iters = comm.size`` (times the
processes' own ``acc_iters``) fed the same parts in rank order. At the first
update the transport (:class:`chainerkfac.transport.MultiNodeTransport`)
checks that every process has the same model and optimizer configuration,
broadcasts rank 0's parameters (that update is *not* skipped, unlike
ChainerMN's multi-node optimizer) and assigns the blocks to processes
(:mod:`chainerkfac.assignment`). Lazily initialised links (``Linear(None,
n)``) are fine: the check and the broadcast then follow the first forward
pass, and a process whose values were replaced recomputes that micro-batch.

Snapshots are per process: each holds the factors of the blocks it owns
(and everything else, identical on all processes). Save every rank's
optimizer (for a Trainer, ``chainermn.extensions.multi_node_snapshot`` with
``replica_sets=[[r] for r in range(comm.size)]``, or one
``save_npz(f'optimizer_rank{comm.rank}.npz', optimizer)`` per rank). To
resume on another number of processes, load every old rank's file into each
process's optimizer (``load_npz(..., strict=False)`` merges their factors;
:func:`chainerkfac.serializers.load_npz` reads with pickle off); factors
of blocks a process does not own are dropped at the first update.

BatchNormalization's running statistics stay per process, as with
ChainerMN (``chainermn.extensions.AllreducePersistent`` averages them).
"""
from chainerkfac.optimizers.kfac import KFAC
from chainerkfac.process_group import distribute


def create_multi_node_optimizer(kfac_optimizer: KFAC, comm) -> KFAC:
    """Make a :class:`~chainerkfac.optimizers.KFAC` optimizer distributed.

    Parameters
    ----------
    kfac_optimizer : KFAC
        Set up with the model already, or to be set up afterwards.
    comm : ChainerMN communicator
        From ``chainermn.create_communicator`` (any kind) or
        :func:`chainerkfac.create_communicator`. ChainerMN's global except
        hook is installed, so an exception on one process ends the job
        instead of leaving the others waiting in a collective.

    Returns
    -------
    KFAC
        The same optimizer object, its transport replaced by a
        :class:`~chainerkfac.transport.MultiNodeTransport`.
    """
    if not isinstance(kfac_optimizer, KFAC):
        raise TypeError('create_multi_node_optimizer takes a '
                        'chainerkfac.optimizers.KFAC optimizer, got {}; for '
                        'first-order optimizers use chainermn.create_multi_'
                        'node_optimizer'.format(type(kfac_optimizer).__name__))
    if kfac_optimizer.started:
        raise RuntimeError('create_multi_node_optimizer must be called '
                           'before the first optimizer.update')
    distribute(kfac_optimizer, comm)
    return kfac_optimizer

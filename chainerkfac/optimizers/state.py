"""The optimizer's state: what a snapshot holds, and how a restored state
is made consistent with the processes that own the blocks now."""
import logging
import warnings

import numpy

import chainer

from chainerkfac.sharding import PER_PROCESS_HINT

logger = logging.getLogger(__name__)


def serialize(optimizer, serializer) -> None:
    """Save or load a :class:`~chainerkfac.optimizers.KFAC`'s own state
    (after Chainer's ``t``, ``epoch`` and the velocities): the damping, the
    MC label sampler, and per block its refresh bookkeeping and — for the
    blocks this process holds — its factors (inverses are recomputed from
    them on loading, bit for bit). The damping is state only where it
    follows its warm-up schedule (eq. 16, ``damping_target``); a constant
    damping is a hyperparameter, like ``lr``: the one the optimizer was
    made with stays (a warning says so where the snapshot's differs)."""
    damping = float(serializer('damping', optimizer.damping))
    if optimizer.damping_target is not None:
        optimizer.damping = damping         # the schedule goes on from it
    elif damping != optimizer.damping:
        logger.warning(
            'K-FAC: the snapshot was taken at damping %g; this optimizer '
            'keeps its own, %g (a constant damping is a hyperparameter: '
            'pass the snapshot\'s to go on with it, unless a schedule of '
            'yours, a trainer extension shifting it, sets it again)',
            damping, optimizer.damping)
    # Gradients and factors of an unfinished accumulation are not part of
    # the state: snapshot at step boundaries (train_imagenet.py does).
    saving = not isinstance(serializer, chainer.serializer.Deserializer)
    if saving and optimizer.pending_micro_batches:
        warnings.warn(
            'K-FAC state saved after {} of {} micro-batches of a step: '
            'their gradients and factors are not part of it, so a run '
            'resumed from it takes that step again from its first '
            'micro-batch (snapshot every acc_iters={} updates, at a step\'s '
            'end)'.format(optimizer.pending_micro_batches,
                          optimizer.acc_iters, optimizer.acc_iters))
    micro = int(serializer('micro_batch', optimizer.pending_micro_batches))
    if micro != optimizer.pending_micro_batches:
        warnings.warn(
            'K-FAC state saved after {} of {} accumulated micro-batches: '
            'they are dropped and the next update starts a new step'
            .format(micro, optimizer.acc_iters))
    optimizer.estimator.label_sampler.serialize(serializer)
    _serialize_frozen(optimizer, serializer)
    state = serializer['kfac']
    for block in optimizer.blocks:
        block.serialize(state[block.name.strip('/') or '_root'])


def restore_method(optimizer) -> str:
    """How a restored factor's inverse is recomputed: as the refresh would
    (a Cholesky factor with ``'cholesky_solve'``), else by Cholesky."""
    return ('cholesky_solve' if optimizer.inverse_method == 'cholesky_solve'
            else 'cholesky')


def _serialize_frozen(optimizer, serializer) -> None:
    """Which blocks were frozen when the coming step's factors were
    decided (:attr:`KFAC.frozen_when_decided`): loaded, the first decision
    after the load takes them (a snapshot without them, an earlier
    version's, leaves the live state to decide)."""
    if not isinstance(serializer, chainer.serializer.Deserializer):
        serializer('frozen_when_decided', numpy.array(
            [int(optimizer.frozen_when_decided.get(b.name, False))
             for b in optimizer.blocks], numpy.int8))
        return
    try:
        frozen = serializer('frozen_when_decided', None)
    except KeyError:
        frozen = None
    if frozen is not None and len(frozen) == len(optimizer.blocks):
        optimizer._frozen_restored = {
            b.name: bool(f) for b, f in zip(optimizer.blocks, frozen)}


def reconcile(optimizer) -> None:
    """After a restore, at the first update (the owners are known): keep
    the factors of the blocks this process owns and recompute their
    inverses, drop the others, and make due every factor that no owner
    holds (a snapshot of another number of processes whose files were not
    all loaded)."""
    transport = optimizer.transport
    flags = []
    for block in optimizer.blocks:
        owned = transport.owns(block)
        if owned:
            block.restore_inverses(restore_method(optimizer))
        else:
            block.drop_factors()
        flags += [int(owned and name not in block.factors and
                      block.last_refresh[name] >= 0)
                  for name in block.factor_names]
    totals = transport.all_sum(numpy.array(flags, numpy.int64))
    if not totals.any():
        return
    totals = iter(totals)
    stale = []
    for block in optimizer.blocks:
        for name in block.factor_names:
            if next(totals):
                block.forget_refresh(name)
                stale.append(block.name + ' ' + name)
    if transport.rank == 0:
        logger.warning(
            'K-FAC: the restored state lacks %d factors of blocks owned here '
            '%s; they are refreshed at the next step: %s', len(stale),
            PER_PROCESS_HINT, ', '.join(stale[:5]))

"""The optimizer's state: what a snapshot holds, and how a restored state
is made consistent with the processes that own the blocks now."""
import logging
import warnings

import numpy

import chainer

from chainerkfac.serializers import loaded
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
    saving = not isinstance(serializer, chainer.serializer.Deserializer)
    micro = int(serializer('micro_batch', optimizer.pending_micro_batches))
    optimizer.estimator.label_sampler.serialize(serializer)
    _serialize_frozen(optimizer, serializer)
    _serialize_rescale(optimizer, serializer, saving)
    state = serializer['kfac']
    for block in optimizer.blocks:
        block.serialize(state[block.name.strip('/') or '_root'])
    _serialize_accumulation(optimizer, serializer, micro, saving)


def _serialize_rescale(optimizer, serializer, saving: bool) -> None:
    """Eq. (20) 'auto''s decision, once taken: which candidates are
    rescaled (loaded, the decision stands; a snapshot without it, an
    earlier version's or one of another model, leaves it to the next
    step's graph). A flush right after a load has no graph to decide
    from: its step went without eq. (20)."""
    rescale = optimizer.rescale
    if rescale.mode != 'auto':
        return
    candidates = rescale.candidates()
    if saving:
        if rescale.decided:
            serializer('rescaled', numpy.array(
                [int(w.update_rule.rescale_norm is not None)
                 for w, _ in candidates], numpy.int8))
        return
    flags = loaded(serializer, 'rescaled')
    if flags is not None and len(flags) == len(candidates):
        rescale.apply([w for (w, _), flag in zip(candidates, flags)
                       if flag])


def _serialize_accumulation(optimizer, serializer, micro: int,
                            saving: bool) -> None:
    """A snapshot inside an accumulation (``micro`` of ``acc_iters``
    micro-batches done, a Trainer's snapshot at an iteration that ends no
    step) holds the step so far: the gradients' sums and which process
    saved them (:meth:`GradientAccumulator.save_step`), each block's
    capture, the samples seen. The Trainer's iterator has gone past those
    micro-batches, so a resume that dropped them (as before 2026-11-28)
    lost them, and every later step began one micro-batch off. Loaded,
    they wait in ``optimizer._restored_accumulation`` for
    :func:`resume_accumulation` (the optimizer starts the step again
    first); a file the accumulator does not take
    (:meth:`GradientAccumulator.load_step`) starts a new step, said."""
    optimizer._restored_accumulation = None
    if not micro:
        if not saving:
            optimizer.accumulator.forget_load()
        return
    group = serializer['accumulation']
    if saving:
        estimator = optimizer.estimator
        transport = optimizer.transport
        optimizer.accumulator.save_step(group, optimizer.target,
                                        (transport.rank, transport.size))
        group('samples', estimator.samples)
        group('empty_micro_batches', estimator.empty_micro_batches)
        for block in optimizer.blocks:
            block.serialize_capture(
                group['capture'][block.name.strip('/') or '_root'])
        return
    why = optimizer.accumulator.load_step(group, optimizer.target)
    if why is None:
        samples = int(loaded(group, 'samples'))
        empty = int(loaded(group, 'empty_micro_batches'))
        for block in optimizer.blocks:
            block.serialize_capture(
                group['capture'][block.name.strip('/') or '_root'])
        optimizer._restored_accumulation = (micro, samples, empty)
        return
    warnings.warn(
        'K-FAC state saved after {} of {} accumulated micro-batches {}: '
        'they are dropped and the next update starts a new step'.format(
            micro, optimizer.acc_iters, why))


def resume_accumulation(optimizer) -> None:
    """After a load, with the coming step started again: take the
    restored step so far (:func:`_serialize_accumulation`) as its own."""
    restored = optimizer._restored_accumulation
    optimizer._restored_accumulation = None
    if restored is None:
        optimizer.accumulator.reset()
        for block in optimizer.blocks:
            block._restored_capture = {}
        return
    micro, samples, empty = restored
    optimizer._micro = micro
    optimizer.estimator.samples = samples
    optimizer.estimator.empty_micro_batches = empty
    for block in optimizer.blocks:
        block.resume_capture()
    optimizer.timer.start()


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

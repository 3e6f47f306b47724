"""What the optimizer tells about its set-up: the registration table (which
link got which block, eq. 20, why plain) and the configuration fingerprint
that every process must share."""
from typing import Dict

from chainerkfac.optimizers import loss_scaling

#: Epochs at which refresh-interval callables are compared across ranks.
SCHEDULE_PROBE_EPOCHS = (0, 1, 2, 5, 10, 20, 30, 40, 50, 60, 80, 100)

#: Hyperparameters of :class:`~chainerkfac.optimizers.KFAC` in the
#: fingerprint (besides lr and momentum).
FINGERPRINTED = ('damping', 'damping_target', 'damping_warmup_steps',
                 'rho_bn', 'bn_fisher', 'fisher', 'mc_samples', 'acc_iters',
                 'factor_dtype', 'precondition_dtype', 'factor_decay',
                 'weight_rescale', 'loss_reduction', 'max_factor_dim',
                 'inverse_method', 'low_rank', 'kl_clip', 'fisher_diff',
                 'shard_update', 't', 'epoch')


def registration_table(blocks, rescale) -> str:
    """Layer → block → factor shapes → eq. (20) → note, one line per link
    with parameters, and a summary line.

    Parameters
    ----------
    blocks : list of FisherBlock
    rescale : chainerkfac.optimizers.rescale.WeightRescale
    """
    rows = [('layer', 'block', 'factors', 'rescale', 'note')]
    for block in blocks:
        rows.append((block.name, block.kind, block.describe(),
                     rescale.column(block), block.note))
    width = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ['  '.join('{:<{}}'.format(r[i], width[i]) for i in range(4))
             + ('  ' + r[4] if r[4] else '') for r in rows]
    lines = [line.rstrip() for line in lines]
    n_kfac = sum(1 for b in blocks if b.factor_names)
    lines.append('{} K-FAC layers, {} with the plain gradient; eq. (20) '
                 'rescales {} of {} Linear/Convolution2D weights '
                 '(weight_rescale={!r})'.format(
                     n_kfac, len(blocks) - n_kfac, len(rescale.rescaled()),
                     len(rescale.candidates()), rescale.mode))
    return '\n'.join(lines)


def parameter_fingerprint(link) -> Dict[str, str]:
    """``{'param /conv/W': '(4, 2, 3, 3) float32', ...}``: the name, shape
    and dtype of each parameter of ``link`` (``'uninitialised'`` for a
    lazy one), comparable across processes."""
    return {'param ' + name: (
        'uninitialised' if param.array is None else
        '{} {}'.format(tuple(param.shape), param.dtype))
        for name, param in sorted(link.namedparams())}


def config_fingerprint(optimizer) -> Dict[str, str]:
    """What must be equal on every process: parameter names, shapes and
    dtypes, hyperparameters, step counters, blocks.

    Returns
    -------
    dict
        ``{'param /conv/W': '(4, 2, 3, 3) float32', 'damping': '0.001',
        ...}`` — string values, comparable across processes.
    """
    items = parameter_fingerprint(optimizer.target)
    for name in ('lr', 'momentum'):
        items[name] = repr(getattr(optimizer.hyperparam, name))
    for name in FINGERPRINTED:
        items[name] = repr(getattr(optimizer, name))
    # a scale on one process only averaged scaled and unscaled gradients
    # under ChainerMN's wrapper (which reduces before K-FAC unscales)
    items['loss scaling'] = loss_scaling.loss_scaling_of(optimizer)
    for kind, interval in sorted(optimizer.refresh_intervals.items()):
        items['refresh_interval_' + kind] = repr(
            [int(interval(optimizer.t, e)) for e in sorted(
                set(SCHEDULE_PROBE_EPOCHS) | {optimizer.epoch})])
    for block in optimizer.blocks:
        items['block ' + block.name] = '{} {}'.format(block.kind, block.note)
    return items

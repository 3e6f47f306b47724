"""Chainer's loss scaling (``optimizer.loss_scaling()``) where the step is
not Chainer's ``GradientMethod.update``: K-FAC's, and a step
:class:`~chainerkfac.optimizers.GuardedOptimizer` skips before it."""


def loss_scaling_of(optimizer) -> str:
    """Chainer's loss scaling of ``optimizer`` in words: ``'none'``,
    ``'dynamic'`` or the static scale (what the processes must agree on)."""
    if getattr(optimizer, '_loss_scaling_is_dynamic', False):
        return 'dynamic'
    scale = getattr(optimizer, '_loss_scale', None)
    return 'none' if scale is None else repr(float(scale))


def follow_step(optimizer, skipped: bool) -> None:
    """A dynamic scale after a step: halved where the step was skipped
    (non-finite, agreed over processes), grown otherwise, as Chainer's own
    check of the gradients does in ``GradientMethod.update``."""
    if not getattr(optimizer, '_loss_scaling_is_dynamic', False):
        return
    optimizer._loss_scaling_isnan = bool(skipped)
    if skipped:
        optimizer._loss_scaling_isnan_ever = True
    optimizer.update_loss_scale()

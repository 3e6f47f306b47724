"""The bounded step: kfac-pytorch's ``kl_clip``, for K-FAC's own update.

K-FAC's step ``Δw = −η d`` with ``d = (F̂ + γI)⁻¹ ∇E`` has, in the metric
of the damped curvature that preconditioned it, the squared length

    ``m = η² Σ_l ⟨d_l, ∇E_l⟩ = η² Σ_l ∇E_lᵀ (F̂_l + γ_l I)⁻¹ ∇E_l``

(``dᵀ (F̂ + γI) d``, twice the quadratic model of the KL divergence
between the predictive distributions before and after the step). With
``kl_clip = c`` every preconditioned direction is multiplied by

    ``ν = min(1, √(c / m))``            (ν = 1 when m = 0)

so that the scaled step's squared length ``ν² m`` is at most ``c``. This is
kfac-pytorch's rule (``kfac/base_preconditioner.py``,
``BaseKFACPreconditioner._compute_grad_scale``: ``vg_sum = Σ_layers
Σ (precon_grad · grad · lr²)``, ``scale = min(1, sqrt(kl_clip /
|vg_sum|))``, 1 when ``vg_sum`` is 0).

Which gradient: ``∇E_l`` is the vector the block preconditioned, the
gradient ∇L of the loss (after Chainer's gradient hooks that add to it:
``WeightDecay``, ``Lasso``) **plus** the damping's term ``γ(w − μ)`` of
eq. (13). kfac-pytorch, which leaves weight decay to the wrapped SGD and
has no such term, uses the raw gradient: its sum is this one with the
``γ(w − μ)`` term zero. With ∇E the sum is exactly the metric length above
and never negative (each block's inverse is positive definite).

Which blocks: those with curvature that preconditioned this step
(Kronecker-factored Linear / Convolution2D, the BatchNormalization
Fisher, full or diagonal), as kfac-pytorch counts and scales only its
preconditioned layers. Parameters on the plain gradient (links without a
block, ``skip_layers``, a block without curvature yet) are neither
counted nor scaled: their step is SGD's, ``η ∇L``, with no metric to
measure it in.

A parameter whose update rule has an lr of its own
(``param.update_rule.hyperparam.lr = ...``, which its update uses) counts
with that lr: ``m = η² Σ_plain ⟨d_p, ∇E_p⟩ + Σ_own η_p² ⟨d_p, ∇E_p⟩``;
one held at lr 0 adds nothing.

Multi-process: each block's term is computed by its first owner from the
reduced gradient and its own direction, the partial sums are summed over
processes in rank order (the same total, bit for bit, on every process),
and the owners scale their directions before the all-gather: every
process applies the same ν, and it is known before any update.
"""
import math
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import numpy

from chainer.backend import get_array_module

from chainerkfac import linalg
from chainerkfac import multi_tensor


def metric_term(block, grads: Sequence, directions: Sequence,
                damping: float, own: Optional[List] = None) -> float:
    """``Σ_p ⟨d_p, ∇E_p⟩`` of one block, ``∇E = ∇L + γ(w − μ)`` (μ from
    :meth:`~chainerkfac.fisher_blocks.FisherBlock.regularization_means`),
    as ``⟨d, ∇L⟩ + γ⟨d, w⟩ − γμ Σd``: dot products of the arrays as they
    are, without forming ∇E again, summed on the device and read once.
    Parameters whose direction or gradient is None (no gradient anywhere)
    are left out; with a list ``own``, those with an lr of their own too
    (:func:`_device_term`)."""
    if isinstance(damping, float):
        # a float64 scalar, as a device γ is: the same arithmetic whichever
        # (NumPy 2 would otherwise round γ⟨d, w⟩ to the direction's dtype)
        damping = numpy.float64(damping)
    return float(_device_term(block, grads, directions, damping, own))


def own_lr(param) -> Optional[float]:
    """The lr of ``param``'s update rule where it has one of its own
    (set on the rule's hyperparameters, not inherited from the
    optimizer's: a number or a 0-d array), else None. The optimizer's lr
    in device memory, which a CUDA graph binds there
    (:func:`chainerkfac.graphs.hyper.bind_rule_hyperparameters`), is no
    value of the parameter's own."""
    rule = getattr(param, 'update_rule', None)
    if rule is None or 'lr' in getattr(rule, 'device_hyperparameters', ()):
        return None
    value = vars(rule.hyperparam).get('lr')
    if value is None or getattr(value, 'ndim', 0) != 0:
        return None
    return float(value)


def _device_term(block, grads, directions, damping, own=None):
    """:func:`metric_term` left on the device (a 0-d float64 array, or 0.0
    for a block with no gradient). With a list ``own``, the parameters with
    an lr of their own (:func:`own_lr`) are left out of the sum and their
    terms appended to ``own``, each times its lr²."""
    total = 0.0
    for param, grad, direction, mean in zip(
            block.params, grads, directions, block.regularization_means()):
        if direction is None or grad is None:
            continue
        term = _param_term(get_array_module(direction), param, grad,
                           direction, damping, mean)
        lr = None if own is None else own_lr(param)
        if lr is None:
            total = total + term
        else:
            own.append(lr * lr * term)
    return total


def _multi_tensor_partial(xp, terms, own):
    """:func:`_device_term`'s sum over ``terms`` on the GPU (``own`` as
    there): the parameters' terms in multi-tensor kernels
    (:func:`chainerkfac.multi_tensor.bound_terms`), one by one where the
    kernels do not take their arrays or the parameter has an lr of its
    own."""
    groups = {}          # dtype -> (directions, grads, weights, γ, μ)
    partial = 0.0
    for block, grads, directions, damping in terms:
        for param, grad, direction, mean in zip(
                block.params, grads, directions,
                block.regularization_means()):
            if direction is None or grad is None:
                continue
            lr = own_lr(param)
            if lr is not None:
                own.append(lr * lr * _param_term(
                    xp, param, grad, direction, damping, mean))
                continue
            if not _fits(direction, grad, param.array, damping):
                partial = partial + _param_term(
                    xp, param, grad, direction, damping, mean)
                continue
            group = groups.setdefault(numpy.dtype(direction.dtype),
                                      ([], [], [], [], []))
            for values, value in zip(group, (direction, grad, param.array,
                                             damping, mean)):
                values.append(value)
    for group in groups.values():
        partial = partial + multi_tensor.bound_terms(*group).sum()
    return partial


def _param_term(xp, param, grad, direction, damping, mean):
    """One parameter's term of :func:`_device_term`."""
    flat = direction.ravel()
    term = _inner(xp, flat, grad.ravel()) + damping * _inner(
        xp, flat, param.array.ravel())
    if mean:
        # float16 summed in float32 (linalg.compute_dtype): a sum over a
        # layer leaves its range (a ⟨d, ∇E⟩ of 70,238 was inf, the step
        # skipped)
        term = term - damping * mean * flat.sum(
            dtype=linalg.compute_dtype(flat.dtype))
    return term


def _fits(direction, grad, weight, damping) -> bool:
    """Whether :func:`chainerkfac.multi_tensor.bound_terms` takes the
    three arrays (float32 / float64, one dtype, C-contiguous) and γ (a 0-d
    float64 device array)."""
    return (getattr(damping, 'shape', None) == () and
            getattr(damping, 'dtype', None) == numpy.float64 and
            type(damping) is not numpy.ndarray and
            direction.dtype in multi_tensor.DTYPES and
            grad.dtype == direction.dtype == weight.dtype and
            direction.flags.c_contiguous and grad.flags.c_contiguous and
            weight.flags.c_contiguous)


def _inner(xp, a, b):
    """``⟨a, b⟩`` of two flat arrays: BLAS's dot on NumPy; on the device
    a product and a sum (CuPy kernels), not CuPy's ``dot``, whose cuBLAS
    refuses a capturing stream (a graphed bounded step fell back to eager
    on the H200, 2026-11-26)."""
    if a.dtype == numpy.float16 or b.dtype == numpy.float16:
        a, b = a.astype(numpy.float32), b.astype(numpy.float32)
    if xp is numpy:
        return numpy.dot(a, b)
    return (a * b).sum()


def scale_of(metric: float, kl_clip: float) -> float:
    """ν = ``min(1, √(kl_clip / |metric|))``, 1 for a metric of 0, NaN for
    a non-finite one (the step is then skipped by the step guard)."""
    if not math.isfinite(metric):
        return float('nan')
    if metric == 0.0:
        return 1.0
    return min(1.0, math.sqrt(kl_clip / abs(metric)))


class StepBound:
    """ν of one step, from the blocks' partial sums.

    Parameters
    ----------
    kl_clip : float
        The bound ``c`` on ``η² Σ_l ⟨d_l, ∇E_l⟩``.

    Attributes
    ----------
    metric : float
        ``η² Σ_l ⟨d_l, ∇E_l⟩`` of the last step, before scaling (NaN
        before the first).
    scale : float
        ν of the last step.
    """

    #: ν under which the bound holds a step back ...
    HELD_SCALE = 0.05
    #: ... over so many steps in a row before :meth:`held_back` says so
    HELD_STEPS = 50

    def __init__(self, kl_clip: float):
        self.kl_clip = float(kl_clip)
        self.metric = float('nan')
        self.scale = 1.0
        self._readings: List[float] = []
        self._told = False
        #: ``float -> float``, identical on every process: the sum over a
        #: second group of processes holding other blocks of the same
        #: model (layer-parallel training: the other layer groups), after
        #: the optimizer's own sum; None when the optimizer sees every
        #: block (:func:`chainerkfac.layer_parallel.setup_kfac` sets it).
        self.sum_across: Optional[Callable[[float], float]] = None

    def apply(self, terms: Iterable[Tuple[object, Sequence, Sequence]],
              scaled: Iterable[Sequence], lr: float, sum_over_processes
              ) -> float:
        """Compute ν and scale the directions in place.

        Parameters
        ----------
        terms : iterable of (block, gradient list, direction list,
                damping)
            The blocks whose term this process adds (each block counted on
            exactly one process), with their reduced gradients ∇L and
            damping γ.
        scaled : iterable of direction lists
            Every direction list this process holds for a block with
            curvature (redundant owners scale their copies too).
        lr : float
            η.
        sum_over_processes : callable
            ``numpy.ndarray (float64) -> numpy.ndarray``: the element-wise
            sum over processes, identical on every process.

        Returns
        -------
        float
            ν.
        """
        partial, own = 0.0, []
        for term in terms:
            # left to right, as apply_on_device adds (Python 3.12's sum()
            # of floats is compensated, and would differ in the last bits)
            partial += metric_term(*term, own=own)
        own_total = 0.0
        for term in own:
            own_total += float(term)
        total, own_total = (float(v) for v in sum_over_processes(
            numpy.array([partial, own_total], numpy.float64)))
        if self.sum_across is not None:
            total = float(self.sum_across(total))
            own_total = float(self.sum_across(own_total))
        self.metric = lr * lr * total + own_total
        self.scale = scale_of(self.metric, self.kl_clip)
        if self.scale != 1.0:
            for directions in scaled:
                for direction in directions:
                    if direction is not None:
                        direction *= direction.dtype.type(self.scale)
        return self.scale

    def apply_on_device(self, terms, scaled, lr) -> None:
        """:meth:`apply` with no host read, for one process whose step a
        CUDA graph replays (:mod:`chainerkfac.graphs.kfac_step`): ``lr``
        and the terms' damping are device scalars (float64), ν and the
        metric stay on the device (:attr:`scale`, :attr:`metric` are 0-d
        arrays, rewritten by each replay). On NumPy the arithmetic is
        :meth:`apply`'s operation for operation: the same ν to the bit.

        On the GPU the parameters' terms and the scaling run in
        multi-tensor kernels (:func:`chainerkfac.multi_tensor.bound_terms`
        and :func:`~chainerkfac.multi_tensor.scale`: about 12 launches for
        ResNet-50's 161 parameters where each took about 11), with float64
        sums from each element on, where :meth:`apply` sums in the arrays'
        dtype: ν then agrees with :meth:`apply`'s to the rounding of those
        sums (float32's for a float32 model), not to the bit."""
        xp = get_array_module(lr)
        own = []
        if xp is numpy:
            partial = 0.0
            for block, grads, directions, damping in terms:
                partial = partial + _device_term(block, grads, directions,
                                                 damping, own)
        else:
            partial = _multi_tensor_partial(xp, terms, own)
        metric = lr * lr * partial
        if own:
            # summed first, then added, as apply adds them: the same ν to
            # the bit
            own_total = 0.0
            for term in own:
                own_total = own_total + term
            metric = metric + own_total
        magnitude = xp.abs(metric)
        # ν = min(1, √(c / |m|)); 1 for m = 0 (c / tiny is huge, as c / 0
        # is infinite), NaN for a non-finite m (scale_of's rule)
        scale = xp.minimum(1.0, xp.sqrt(self.kl_clip / xp.maximum(
            magnitude, numpy.finfo(numpy.float64).tiny)))
        scale = xp.where(xp.isfinite(metric), scale, numpy.nan)
        fused = {}
        for directions in scaled:
            for direction in directions:
                if direction is None:
                    continue
                if xp is not numpy and \
                        direction.dtype in multi_tensor.DTYPES and \
                        direction.flags.c_contiguous:
                    fused.setdefault(direction.dtype, []).append(direction)
                else:
                    direction *= scale.astype(direction.dtype)
        for arrays in fused.values():
            multi_tensor.scale(arrays, scale)
        self.metric, self.scale = metric, scale

    def held_back(self, step: int) -> Optional[str]:
        """Once: a message when ν stayed under :attr:`HELD_SCALE` at
        every reading over the last :attr:`HELD_STEPS` steps (ν read every
        10th step, every 50th where it is on a device: a read is a
        synchronisation); None otherwise. While the bound holds every
        step so far back, ``lr`` changes nothing and training may crawl
        (a model with dropout before its layers, at the default
        ``kl_clip``)."""
        on_host = isinstance(self.scale, (float, numpy.floating,
                                          numpy.ndarray))
        every = 10 if on_host else 50
        if self._told or step % every:
            return None
        xp = get_array_module(self.scale)
        if not on_host and xp is not numpy and \
                xp.cuda.get_current_stream().is_capturing():
            return None     # inside a CUDA graph's capture: not read
        self._readings.append(float(self.scale))
        needed = self.HELD_STEPS // every + 1
        del self._readings[:-needed]
        if len(self._readings) < needed or not all(
                v < self.HELD_SCALE for v in self._readings):
            return None
        self._told = True
        return ('the bounded step held every step of the last {} to under '
                '{:.0%} of lr times the preconditioned gradient (ν = {:.3g} '
                'now; kl_clip={:g}): while it does, lr changes nothing and '
                'training may crawl. A larger kl_clip (1e-3, 1e-2) lets the '
                'steps grow; kl_clip=None takes the bound off'.format(
                    self.HELD_STEPS, self.HELD_SCALE, self._readings[-1],
                    self.kl_clip))

    def observation(self) -> dict:
        """The reporter's entries of the last step."""
        return {'kfac/step_scale': self.scale,
                'kfac/step_metric': self.metric}


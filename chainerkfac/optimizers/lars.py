"""LARS, the first-order large-batch baseline of the MLPerf-0.6 seed
(seed 002, Figures 5 and 6): layer-wise adaptive rate scaling with scaled
or unscaled momentum.

For each parameter array ``w`` with gradient ``g``, at learning rate ``η``
(``lr``), trust coefficient ``ε`` (``eta``), weight decay ``β`` and
momentum ``m``, the local learning rate is

    λ = η · ε · ‖w‖ / (‖g‖ + β · ‖w‖),   and λ = η where ‖w‖ = 0 or ‖g‖ = 0

(the MLPerf-0.6 reference, TensorFlow's ``LARSOptimizer``: a trust ratio
of 1 where either norm is zero, e.g. a zero-initialised weight). Then

* ``'scaled'`` (Figure 5, the MLPerf-0.6 reference):
  ``v ← m v + (g + β w)``, ``w ← w − λ v``;
* ``'unscaled'`` (Figure 6, You et al. 2017):
  ``v ← m v + λ (g + β w)``, ``w ← w − v``; Chainer's ``MomentumSGD``
  with learning rate ``η · ε`` and its ``GradientLARS`` hook takes these
  steps where no norm is zero and nothing is excluded.

The two differ when λ changes between steps (a learning-rate schedule,
the trust ratio itself): Figure 5's velocity holds raw gradients that the
current λ scales, Figure 6's holds steps already scaled.

Excluded parameters (the MLPerf reference's ``skip_list``: batch
normalisation and biases) are updated with ``λ = η`` and no weight decay,
in the same momentum form.

A parameter whose gradient is exactly zero at a step is left as it is at
that step, weights and velocity: TensorFlow's ``LARSOptimizer`` never touches a variable
without a gradient, and Chainer fills a missing gradient (a branch no loss
reached) with zeros before the update, which would give it the trust
ratio 1 and decay it at the full learning rate η (29 at Table 1's) with
momentum.
"""
from typing import Callable, List, Optional

import math

import numpy

import chainer
from chainer.backends import cuda
from chainer import optimizer

MOMENTUM_FORMS = ('scaled', 'unscaled')

_default_hyperparam = optimizer.Hyperparameter()
_default_hyperparam.lr = 0.1
_default_hyperparam.momentum = 0.9
_default_hyperparam.weight_decay = 1e-4
_default_hyperparam.eta = 1e-3
_default_hyperparam.momentum_form = 'scaled'


def bias_and_normalization(name: str, param) -> bool:
    """The default exclusion: every parameter of at most one dimension.

    That is the biases (``b`` of ``Linear``, ``Convolution2D``, ``Bias``,
    ...) and the scales and shifts of the normalisation links (``gamma``
    and ``beta`` of ``BatchNormalization``, ``LayerNormalization``,
    ``GroupNormalization``), as the MLPerf-0.6 reference leaves out
    ``batch_normalization`` and ``bias`` variables by name; on ResNet-50
    the two rules pick the same parameters. One-dimensional weights of
    other links (``PReLU``'s slopes, ``Scale``'s ``W``) are excluded too.
    Decided when the parameter has its array (lazily initialised links: at
    their first update).

    Parameters
    ----------
    name : str
        The parameter's path in the model (``'/res2/a/bn1/gamma'``).
    param : chainer.Parameter
    """
    return param.array.ndim <= 1


def trust_lambda(weight, grad, lr: float, eta: float, weight_decay: float):
    """λ of one parameter array (see the module docstring), as a 0-d array
    of the array module of ``weight`` (no host synchronisation on the GPU).

    The norms are taken in at least float32.
    """
    xp = chainer.backend.get_array_module(weight)
    dtype = numpy.promote_types(weight.dtype, numpy.float32)
    w_norm = xp.linalg.norm(weight.astype(dtype, copy=False).ravel())
    g_norm = xp.linalg.norm(grad.astype(dtype, copy=False).ravel())
    adapt = (w_norm > 0) & (g_norm > 0)
    # Where a norm is 0 the ratio is not used; divide by 1 there instead.
    denominator = xp.where(adapt, g_norm + weight_decay * w_norm, 1)
    ratio = xp.where(adapt, eta * w_norm / denominator, 1)
    return (lr * ratio).astype(weight.dtype)


class LARSRule(optimizer.UpdateRule):
    """Update rule of one parameter for :class:`LARS` (Figures 5 and 6).

    Parameters
    ----------
    parent_hyperparam : chainer.optimizer.Hyperparameter, optional
    lr, momentum, weight_decay, eta : float, optional
    momentum_form : {'scaled', 'unscaled'}, optional

    Attributes
    ----------
    excluded : bool or None
        Whether this parameter is left out of the trust ratio and the
        weight decay (``λ = η``, ``β = 0``); None until decided (at the
        first update, by :attr:`exclusion`).
    exclusion : callable or None
        ``exclusion(param) -> bool``, set by :meth:`LARS.setup`.
    """

    _kernels = {}

    def __init__(self, parent_hyperparam=None, lr=None, momentum=None,
                 weight_decay=None, eta=None, momentum_form=None):
        super().__init__(parent_hyperparam or _default_hyperparam)
        for name, value in (('lr', lr), ('momentum', momentum),
                            ('weight_decay', weight_decay), ('eta', eta),
                            ('momentum_form', momentum_form)):
            if value is not None:
                setattr(self.hyperparam, name, value)
        self.excluded: Optional[bool] = None
        self.exclusion: Optional[Callable] = None

    def init_state(self, param):
        with chainer.using_device(param.device):
            self.state['v'] = param.device.xp.zeros_like(param.array)

    def _lambda_and_decay(self, param):
        if self.excluded is None:
            self.excluded = bool(self.exclusion and self.exclusion(param))
        hp = self.hyperparam
        _check_form(hp.momentum_form)
        if self.excluded:
            return param.array.dtype.type(hp.lr), 0.0
        return (trust_lambda(param.array, param.grad, hp.lr, hp.eta,
                             hp.weight_decay), hp.weight_decay)

    def update_core_cpu(self, param):
        grad = param.grad
        if grad is None or not grad.any():
            return
        lam, decay = self._lambda_and_decay(param)
        w, v = param.array, self.state['v']
        step = grad + decay * w if decay else grad
        v *= self.hyperparam.momentum
        if self.hyperparam.momentum_form == 'scaled':
            v += step
            w -= lam * v
        else:
            v += lam * step
            w -= v

    def update_core_gpu(self, param):
        grad = param.grad
        if grad is None:
            return
        lam, decay = self._lambda_and_decay(param)
        form = self.hyperparam.momentum_form
        kernel = LARSRule._kernels.get(form)
        if kernel is None:
            kernel = LARSRule._kernels[form] = cuda.elementwise(
                'T grad, T lam, T decay, T momentum, bool active',
                'T param, T v',
                'if (active) {{ {} }}'.format(_KERNEL_BODIES[form]),
                'chainerkfac_lars_' + form)
        dtype = param.array.dtype
        # on the device, no host synchronisation (a CUDA graph replays it)
        active = grad.any()
        kernel(grad, cuda.cupy.asarray(lam, dtype), dtype.type(decay),
               dtype.type(self.hyperparam.momentum), active, param.array,
               self.state['v'])


#: The GPU kernels: the CPU path's expressions in the same order, run
#: where the gradient is not zero throughout (``active``).
_KERNEL_BODIES = {
    'scaled': 'v = momentum * v + (grad + decay * param); '
              'param -= lam * v;',
    'unscaled': 'v = momentum * v + lam * (grad + decay * param); '
                'param -= v;',
}


class LARS(optimizer.GradientMethod):
    """LARS with the MLPerf-0.6 seed's scaled or unscaled momentum: a
    sibling of :class:`chainer.optimizers.MomentumSGD`.

    ::

        optimizer = chainerkfac.optimizers.LARS(
            lr=29.0, momentum=0.929, weight_decay=1e-4, eta=1e-3,
            momentum_form='unscaled')
        optimizer.setup(model)

    Equations in :mod:`chainerkfac.optimizers.lars`. Multi-process and
    accumulation: wrap it in
    :class:`~chainerkfac.optimizers.GuardedOptimizer` (which can also shard
    the update over the processes).

    Parameters
    ----------
    lr : float, default 0.1
        η, the global learning rate; excluded parameters step with it
        alone. The MLPerf-0.6 ResNet-50 runs at a batch of 32K used 29 to
        31.2 (seed 002, Table 1): about 0.23 per 256 images, with 18-25
        epochs of warm-up (without it, or at a small batch, such values
        diverge: docs/mlperf.md).
    momentum : float, default 0.9
        m, in [0, 1).
    weight_decay : float, default 1e-4
        β, in the trust ratio and the update (not for excluded
        parameters).
    eta : float, default 1e-3
        ε, the trust coefficient (MLPerf: 1e-3).
    momentum_form : {'scaled', 'unscaled'}, default 'scaled'
        Figure 5 (the MLPerf reference) or Figure 6 (You et al.).
    exclude : callable or None
        ``exclude(name, param) -> bool``: the parameters left out of the
        trust ratio and the weight decay. Default
        :func:`bias_and_normalization` (every parameter with at most one
        dimension: biases, BN γ and β). ``None``: adapt every parameter.
    """

    lr = optimizer.HyperparameterProxy('lr')
    momentum = optimizer.HyperparameterProxy('momentum')
    weight_decay = optimizer.HyperparameterProxy('weight_decay')
    eta = optimizer.HyperparameterProxy('eta')
    momentum_form = optimizer.HyperparameterProxy('momentum_form')
    #: :meth:`update` is ``GradientMethod.update`` after a check of the
    #: hyperparameters: the sharded step may run the latter in its place
    #: (:class:`~chainerkfac.optimizers.GuardedOptimizer`).
    gradient_method_update = True

    def __init__(self, lr=_default_hyperparam.lr,
                 momentum=_default_hyperparam.momentum,
                 weight_decay=_default_hyperparam.weight_decay,
                 eta=_default_hyperparam.eta,
                 momentum_form=_default_hyperparam.momentum_form,
                 exclude=bias_and_normalization):
        super().__init__()
        _check_values({'lr': lr, 'momentum': momentum,
                       'weight_decay': weight_decay, 'eta': eta})
        _check_form(momentum_form)
        self.hyperparam.lr = lr
        self.hyperparam.momentum = momentum
        self.hyperparam.weight_decay = weight_decay
        self.hyperparam.eta = eta
        self.hyperparam.momentum_form = momentum_form
        self.exclude = exclude

    def create_update_rule(self):
        return LARSRule(self.hyperparam)

    def update(self, lossfun=None, *args, **kwds):
        """Chainer's update, after :meth:`check_update`: a refused update
        moves nothing, not even the step counters."""
        self.check_update()
        return super().update(lossfun, *args, **kwds)

    def check_update(self) -> None:
        """Refuse a hyperparameter set since the constructor (here, by a
        trainer extension, or a rule's own) that the constructor would
        refuse: an ``lr`` or ``eta`` of inf or NaN gave non-finite weights,
        then every step skipped; a momentum of 1.5 ran on. A wrapper that
        runs the update rules itself (the sharded
        :class:`~chainerkfac.optimizers.GuardedOptimizer`) calls it before
        anything moves."""
        # the optimizer's values, then each rule's own (a rule's others are
        # the optimizer's: checked once, not once a parameter)
        given = [self.hyperparam.get_dict()] + [
            {k: v for k, v in vars(param.update_rule.hyperparam).items()
             if k != '_parent'}
            for param in self.target.params()
            if isinstance(param.update_rule, LARSRule)]
        for values in given:
            if 'momentum_form' in values:
                _check_form(values['momentum_form'])
            checked = {}
            for name in _CHECKS:
                if name not in values:
                    continue
                value = values[name]
                if isinstance(value, numpy.ndarray) and value.ndim == 0:
                    value = value[()]           # a NumPy scalar
                elif getattr(value, 'ndim', None) == 0 and \
                        not isinstance(value, numpy.number):
                    continue    # a CUDA graph's device view of the
                    # optimizer's value, checked on the optimizer
                checked[name] = value
            _check_values(checked)

    @property
    def exclude(self) -> Optional[Callable]:
        """``exclude(name, param) -> bool`` (None: adapt every parameter);
        set after :meth:`setup`, every rule decides again at its next
        update."""
        return self.__dict__.get('_exclude')

    @exclude.setter
    def exclude(self, value) -> None:
        if value is not None and not callable(value):
            raise TypeError('LARS: exclude must be a callable (name, param) '
                            '-> bool or None, got {!r}'.format(value))
        self.__dict__['_exclude'] = value
        if getattr(self, 'target', None) is not None:
            self._bind_exclusions(self.target)

    def _bind_exclusions(self, link) -> None:
        for name, param in link.namedparams():
            rule = param.update_rule
            if isinstance(rule, LARSRule):
                rule.exclusion = (None if self.exclude is None else
                                  _Exclusion(self.exclude, name))
                rule.excluded = None

    def setup(self, link):
        super().setup(link)
        self._bind_exclusions(link)
        return self

    def excluded_params(self) -> List[str]:
        """Names of the parameters left out of the trust ratio and the
        weight decay (those with an array; lazily initialised ones are
        decided at their first update)."""
        out = []
        for name, param in self.target.namedparams():
            rule = param.update_rule
            excluded = rule.excluded
            if excluded is None and param.array is not None:
                excluded = bool(rule.exclusion and rule.exclusion(param))
            if excluded:
                out.append(name)
        return out


class _Exclusion:
    """``exclude(name, param)`` bound to one parameter's name."""

    def __init__(self, exclude, name):
        self.exclude = exclude
        self.name = name

    def __call__(self, param) -> bool:
        return bool(self.exclude(self.name, param))


def _check_form(form) -> None:
    if form not in MOMENTUM_FORMS:
        raise ValueError('LARS: momentum_form={!r} must be one of {}'.format(
            form, MOMENTUM_FORMS))


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:            # an int past float's range
        return False


#: The constructor's checks of the numeric hyperparameters: ``(ok,
#: why)``.
_CHECKS = {
    'lr': (lambda v: v >= 0, 'must be a finite number >= 0'),
    'momentum': (lambda v: 0 <= v < 1, 'must lie in [0, 1)'),
    'weight_decay': (lambda v: v >= 0, 'must be a finite number >= 0'),
    'eta': (lambda v: v > 0, 'must be a finite number > 0'),
}


def _check_values(values) -> None:
    for name, value in values.items():
        ok, why = _CHECKS[name]
        _check(name, value, ok, why)


def _check(name, value, ok, why):
    """Refuse a value that is no finite real number or fails ``ok`` (inf
    passed ``>= 0`` and gave non-finite weights at the first update)."""
    if not isinstance(value, (int, float, numpy.number)) or \
            isinstance(value, bool) or not _finite(value) or not ok(value):
        raise ValueError('LARS: {}={!r} {}'.format(name, value, why))

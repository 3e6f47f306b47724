"""Chainer's MomentumSGD with its update in multi-tensor kernels.

:class:`FusedMomentumSGD` is :class:`chainer.optimizers.MomentumSGD` — the
same hyperparameters, update rules (``MomentumSGDRule``, state ``v``),
hooks, serialization and arithmetic — whose ``update`` hands every plain
parameter to :func:`chainerkfac.multi_tensor.momentum_sgd`: on the GPU one
kernel per 32 parameters instead of one per parameter (ResNet-50: 6
launches for 161), as PyTorch's SGD does by default. On the CPU the
update is Chainer's own expression, so the weights are Chainer's bit for
bit.

A parameter goes Chainer's own way (``param.update()``) where the fused
kernel would not do exactly what its rule does: a rule other than
``MomentumSGDRule`` or disabled, hooks on the rule, no gradient, a float16
parameter (its kernel serves float32 and float64), fp32 updates of float16
parameters, loss scaling. Everything else of ``GradientMethod.update``
(the loss and backward pass when given a loss function, the optimizer's
hooks before and after, ``t``) is as Chainer does it, but for one thing:
where ``WeightDecay`` is the optimizer's only pre-update hook (the usual
SGD baseline), the kernel adds ``λ·w`` to each gradient on its pass, as
the hook's own kernel would have just before (161 more launches for
ResNet-50), and leaves the gradient so; the other parameters get the hook
by Chainer's call before their update.
"""
import numpy

import chainer
from chainer.optimizers import momentum_sgd as chainer_momentum_sgd

from chainerkfac import multi_tensor


class FusedMomentumSGD(chainer.optimizers.MomentumSGD):
    """:class:`chainer.optimizers.MomentumSGD`, its parameters updated by
    multi-tensor kernels (module docstring).

    Parameters
    ----------
    lr, momentum : float
        As Chainer's (0.01 and 0.9 by default).
    """

    #: Its update is ``chainer.GradientMethod.update``'s, fused: a caller
    #: that updates parameter by parameter (GuardedOptimizer's sharded
    #: step) gives the same steps.
    gradient_method_update = True

    def update(self, lossfun=None, *args, **kwds):
        """``chainer.GradientMethod.update``, the plain parameters' rules
        in multi-tensor kernels."""
        if self._loss_scale is not None or \
                getattr(self, '_loss_scaling_is_dynamic', False):
            return super().update(lossfun, *args, **kwds)
        if lossfun is not None:
            use_cleargrads = getattr(self, '_use_cleargrads', True)
            loss = lossfun(*args, **kwds)
            if use_cleargrads:
                self.target.cleargrads()
            else:
                self.target.zerograds()
            loss.backward(loss_scale=self._loss_scale)
            del loss
        self.reallocate_cleared_grads()
        self.check_nan_in_grads()
        decay = _lone_weight_decay(self)
        if decay is None:
            self.call_hooks('pre')
        self.t += 1
        if self.is_safe_to_update():
            groups = {}
            for param in self.target.params():
                key = _fused_key(param)
                if key is not None:
                    rule = param.update_rule
                    rule._init_states(param)   # v, as update() makes it
                    if not _takes(rule.state['v'], param.array):
                        key = None
                if key is None:
                    if decay is not None:     # the hook, as Chainer calls it
                        decay(param.update_rule, param)
                    param.update()
                    continue
                rule.t += 1
                groups.setdefault(key, []).append(param)
            for members in groups.values():
                hyperparam = members[0].update_rule.hyperparam
                with chainer.using_device(members[0].device):
                    multi_tensor.momentum_sgd(
                        [p.array for p in members],
                        [p.grad for p in members],
                        [p.update_rule.state['v'] for p in members],
                        hyperparam.lr, hyperparam.momentum,
                        None if decay is None else decay.rate)
        elif decay is not None:
            self.call_hooks('pre')     # as Chainer: the hooks, no update
        self.reallocate_cleared_grads()
        self.call_hooks('post')
        self.update_loss_scale()


def _lone_weight_decay(optimizer):
    """The optimizer's ``WeightDecay`` hook where it is its only
    pre-update hook (the fused kernel then applies it on its pass: ``g ←
    g + λ·w`` per parameter, as the hook does, before any update reads a
    gradient), else None: other hooks keep Chainer's order."""
    hooks = list(optimizer._hookable._pre_update_hooks.values())
    if len(hooks) == 1 and type(hooks[0]) is \
            chainer.optimizer_hooks.WeightDecay and \
            hooks[0].call_for_each_param:
        return hooks[0]
    return None


def _fused_key(param):
    """The group of a parameter whose rule the fused kernel takes (device,
    dtype, η and m: host values, or the device arrays themselves), or
    None."""
    rule = param.update_rule
    if rule is None or type(rule) is not \
            chainer_momentum_sgd.MomentumSGDRule or not rule.enabled:
        return None
    if param.array is None or param.grad is None or \
            param._loss_scale is not None or rule._use_fp32_update:
        return None
    hookable = rule._hookable
    if hookable._pre_update_hooks or hookable._post_update_hooks:
        return None
    array, grad = param.array, param.grad
    if isinstance(array, numpy.ndarray):
        if not isinstance(grad, numpy.ndarray):
            return None
    elif not (_is_cupy(array) and array.dtype in multi_tensor.DTYPES and
              _is_cupy(grad) and grad.dtype == array.dtype and
              array.flags.c_contiguous and grad.flags.c_contiguous):
        return None          # iDeep, ChainerX, float16: Chainer's own
    hyper = rule.hyperparam
    return (str(param.device), array.dtype.str, multi_tensor.group_key(hyper.lr),
            multi_tensor.group_key(hyper.momentum))


def _takes(velocity, array) -> bool:
    """Whether the kernel takes a state ``v`` (of the parameter's dtype
    and type, and C-contiguous on the GPU)."""
    if isinstance(array, numpy.ndarray):
        return isinstance(velocity, numpy.ndarray)
    return (_is_cupy(velocity) and velocity.dtype == array.dtype and
            velocity.flags.c_contiguous)


def _is_cupy(array) -> bool:
    cuda = chainer.backends.cuda
    return cuda.available and isinstance(array, cuda.ndarray)

"""Where Chainer's optimizer hooks act in a K-FAC step.

A first-order optimizer updates with the gradient its ``'pre'`` hooks
leave; K-FAC updates with a preconditioned direction, so each hook must
say which vector it changes. The choice keeps what a stock script's hook
meant for SGD:

* **penalties** — ``WeightDecay``, ``Lasso`` and every other ``'pre'``
  hook (``GradientNoise``, ``GradientLARS``, a user's) act on the
  gradient ∇L before the preconditioning, as for SGD: a penalty's gradient
  is part of the loss's, and K-FAC preconditions the gradient of the
  penalised loss (as it does eq. 13's own ``γ(w − μ)``).
* **clipping** — ``GradientClipping`` and ``GradientHardClipping`` (and
  their subclasses) bound the step: for SGD the update is ``η`` times the
  clipped gradient, so they bound the update. On K-FAC they act on the
  preconditioned direction ``d`` (after the bounded step's ν,
  :mod:`chainerkfac.step_bound`), so that the update ``η d`` obeys the same
  bound: ``‖η d‖ ≤ η · threshold`` for ``GradientClipping(threshold)``
  (the norm over every parameter's direction, curvature blocks and plain
  ones alike), each element of ``d`` within ``[lower, upper]`` for
  ``GradientHardClipping``. Clipping ∇L instead would bound nothing: the
  inverse of a damped Fisher multiplies a gradient by up to ``1/γ``.

``'post'`` hooks run after the update, as for any Chainer optimizer.
Hooks added to a parameter's own update rule (``param.update_rule.
add_hook``: weight decay on the weights but not the biases) act at the
same two places, on that parameter alone: a penalty on its ∇L before the
preconditioning, a clipping hook on its direction; the update itself then
runs the rule without them (they have acted).

In a multi-process run the hooks on ∇L that act on each parameter alone
(``call_for_each_param``: all of Chainer's) act on the averaged gradient,
on the process that owns the parameter's block, after the reduction: so
the step is the single process's with ``acc_iters`` = the processes'
count, also for the hooks that are not linear in ∇L (``GradientLARS``'s
rate ‖w‖/‖∇L‖, ``GradientNoise``, which on each process's gradient
before the reduction gave another step: 1.41 off in a reviewer's MLP
with LARS, and noise of 1/√P the asked scale). A hook of the whole
model on ∇L (a user's, ``call_for_each_param`` False) needs every
gradient, which no process holds averaged: it acts on each process's own
gradient before the reduction, as before, with a warning unless it is a
known linear penalty. The clipping hooks act on the gathered
directions, which every process holds identically. With weight-update sharding
(``KFAC(shard_update=True)``) no process holds every direction: a hook
that acts on each parameter alone (``call_for_each_param``:
``GradientHardClipping``) clips the directions of the blocks the process
updates, which gives the unsharded step; a hook of the whole model
(``GradientClipping``'s norm) is refused, as
``GuardedOptimizer(shard_update=True)`` refuses it.
"""
import contextlib
from typing import List

from chainer import backend
from chainer import optimizer_hooks

#: Hooks that act on the preconditioned direction (their subclasses too).
DIRECTION_HOOKS = (optimizer_hooks.GradientClipping,
                   optimizer_hooks.GradientHardClipping)


def acts_on_direction(hook) -> bool:
    """Whether a ``'pre'`` hook clips the step (else it acts on ∇L)."""
    return isinstance(hook, DIRECTION_HOOKS)


def _pre_hooks(owner) -> List:
    # Chainer 7 keeps an optimizer's hooks, and an update rule's, in its
    # private hookable, in registration order; Optimizer.call_hooks and
    # UpdateRule.update run them all at once.
    return list(owner._hookable._pre_update_hooks.values())


def updates(param) -> bool:
    """Whether ``param`` is updated: it has an update rule, not turned
    off (``link.disable_update()``)."""
    rule = param.update_rule
    return rule is not None and rule.enabled


#: Hooks on ∇L whose effect commutes with the processes' average (a
#: penalty's gradient added to ∇L): those of a whole model may act before
#: the reduction without a word.
LINEAR_HOOKS = (optimizer_hooks.WeightDecay, optimizer_hooks.Lasso)


def _per_param(hook) -> bool:
    return bool(getattr(hook, 'call_for_each_param', False))


def call_gradient_hooks(optimizer, whole_model_only: bool = False) -> None:
    """The ``'pre'`` hooks that act on ∇L, in registration order: the
    optimizer's, then each parameter's own rule's. ``whole_model_only``
    (several processes, before the reduction): only the optimizer's hooks
    of the whole model (``call_for_each_param`` False); the others act on
    the averaged gradients (:func:`call_reduced_gradient_hooks`)."""
    for hook in _pre_hooks(optimizer):
        if acts_on_direction(hook):
            continue
        if whole_model_only and _per_param(hook):
            continue
        optimizer.call_hook(hook)
    if whole_model_only:
        return
    for param in optimizer.target.params():
        if not updates(param) or param.grad is None:
            continue
        for hook in _pre_hooks(param.update_rule):
            if not acts_on_direction(hook):
                hook(param.update_rule, param)


def whole_model_gradient_hooks(optimizer) -> List[str]:
    """The names of the optimizer's hooks on ∇L of the whole model
    (``call_for_each_param`` False) that are not known linear penalties:
    on several processes they act on each process's own gradient."""
    return [getattr(h, 'name', type(h).__name__)
            for h in _pre_hooks(optimizer)
            if not acts_on_direction(h) and not _per_param(h) and
            not isinstance(h, LINEAR_HOOKS)]


def call_reduced_gradient_hooks(optimizer, grads) -> None:
    """The ``'pre'`` hooks on ∇L of each parameter (the optimizer's with
    ``call_for_each_param``, then the parameter's rule's), in registration
    order, on the averaged gradients ``grads`` (``{block: [array or None
    per parameter]}``: the blocks this process owns, after the reduction;
    changed in place)."""
    hooks = [h for h in _pre_hooks(optimizer)
             if not acts_on_direction(h) and _per_param(h)]
    for block, listed in grads.items():
        for param, grad in zip(block.params, listed):
            if grad is None or not updates(param):
                continue
            mine = [h for h in _pre_hooks(param.update_rule)
                    if not acts_on_direction(h)]
            if not hooks and not mine:
                continue
            saved = param.grad
            param.grad = grad
            try:
                for hook in hooks + mine:
                    hook(param.update_rule, param)
                if param.grad is not grad:      # a hook that reassigns
                    grad[...] = param.grad
            finally:
                param.grad = saved


@contextlib.contextmanager
def rule_hooks_done(rule):
    """The rule's ``'pre'`` hooks set aside while it updates: K-FAC ran
    them where they act (:func:`call_gradient_hooks`,
    :func:`call_direction_hooks`)."""
    hooks = rule._hookable._pre_update_hooks
    if not hooks:
        yield
        return
    saved = list(hooks.items())
    hooks.clear()
    try:
        yield
    finally:
        hooks.update(saved)


def _direction_hooks(optimizer) -> List:
    return [h for h in _pre_hooks(optimizer) if acts_on_direction(h)]


def check_sharded(optimizer) -> None:
    """Refuse, under weight-update sharding, a clipping hook that needs
    every parameter's direction (not ``call_for_each_param``).

    Raises
    ------
    ValueError
        Naming the hook(s).
    """
    whole = [getattr(h, 'name', type(h).__name__)
             for h in _direction_hooks(optimizer)
             if not getattr(h, 'call_for_each_param', False)]
    if whole:
        raise ValueError(
            'KFAC(shard_update=True): the optimizer hook(s) {} clip by the '
            'norm of the whole model\'s step, and with a sharded update a '
            'process holds the directions of the blocks it updates only; '
            'use GradientHardClipping, kl_clip (the bounded step) or '
            'shard_update=False'.format(', '.join(whole)))


def call_direction_hooks(optimizer, blocks, directions,
                         sharded: bool = False) -> None:
    """The clipping hooks on the directions, in registration order.

    Parameters
    ----------
    optimizer : chainer.Optimizer
        Its hooks read ``param.grad`` of its target's parameters.
    blocks : list of FisherBlock
    directions : dict
        ``{block: [direction or None per parameter]}``, changed in place
        (a direction that is the gradient array itself, a plain block's,
        is copied first: the gradients stay as the backward pass left
        them).
    sharded : bool
        Weight-update sharding: ``blocks`` are those this process updates,
        and the hooks (each of one parameter, :func:`check_sharded`) run
        on their parameters only.

    During the hooks each direction stands in for ``param.grad``, and the
    gradient of a parameter without one (frozen: ``disable_update()``, or
    its rule disabled) by zeros, which add nothing to a norm (its raw
    gradient, in other units, made ``GradientClipping`` clip the
    directions too hard: 0.036 where 0.05 was asked, in a reviewer's
    MLP); the gradients are restored afterwards.
    """
    hooks = _direction_hooks(optimizer)
    own = {}
    pairs = []
    for block in blocks:
        listed = directions.get(block)
        if listed is None:
            continue
        for i, (param, direction) in enumerate(zip(block.params, listed)):
            if direction is None:
                continue
            mine = [h for h in _pre_hooks(param.update_rule)
                    if acts_on_direction(h)] if updates(param) else []
            if not hooks and not mine:
                continue
            if direction is param.grad:
                direction = listed[i] = direction.copy()
            pairs.append((param, direction))
            if mine:
                own[id(param)] = mine
    if not pairs:
        return
    if hooks and not sharded:
        # the other parameters a whole-model hook reads: no direction
        mine_ids = {id(param) for param, _ in pairs}
        pairs += [(param, backend.get_array_module(param.grad).zeros_like(
            param.grad)) for param in optimizer.target.params()
            if id(param) not in mine_ids and param.grad is not None]
    saved = [param.grad for param, _ in pairs]
    try:
        for param, direction in pairs:
            param.grad = direction
        for hook in hooks:
            if sharded:
                for param, _ in pairs:
                    hook(param.update_rule, param)
            else:
                optimizer.call_hook(hook)
        for param, _ in pairs:
            for hook in own.get(id(param), ()):
                hook(param.update_rule, param)
        for param, direction in pairs:
            if param.grad is not direction:     # a hook that reassigns
                direction[...] = param.grad
    finally:
        for (param, _), grad in zip(pairs, saved):
            param.grad = grad

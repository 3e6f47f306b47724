"""Per-sample gradients by one backward pass per sample.

For a parameter whose calls have no adapter, or when the samples are
coupled (BatchNormalization in training mode), the per-sample gradient
``J_nᵀ v_n`` of a pass that starts from the logits with ``v`` is the
gradient of the logits with ``v`` kept in row ``n`` only: one backward pass
of Chainer's autodiff per sample, restricted to the paths to those
parameters. Exact for any graph, with the batch kept as it is (coupled
statistics included), at ``N`` backward passes per pass of the batch:
``N`` for the first-order quantities, ``N·C`` for ``diag_ggn``,
``N·mc_samples`` for ``diag_ggn_mc``.
"""
from typing import List

import chainer

from chainerkfac import capture as capture_module


def per_sample_gradients(logits, rows, params) -> List:
    """``[N, *param.shape]`` per parameter: row ``n`` is the gradient of
    ``Σ_c rows[n, c] · logits[n, c]``.

    Parameters
    ----------
    logits : chainer.Variable
        (N, C).
    rows : array
        (N, C), the pass's gradient w.r.t. the logits.
    params : list of chainer.Parameter
    """
    xp = chainer.backend.get_array_module(rows)
    out = [xp.zeros((len(rows),) + p.shape, dtype=p.dtype) for p in params]
    with capture_module.unobserved():
        for n in range(len(rows)):
            single = xp.zeros_like(rows)
            single[n] = rows[n]
            grads = chainer.grad([logits], params,
                                 grad_outputs=[chainer.Variable(single)])
            for array, grad in zip(out, grads):
                if grad is not None:
                    array[n] = grad.array
    return out

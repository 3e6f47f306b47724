"""Brute-force oracles in float64, by definition and independent of the
module's code paths: per-sample gradients by one backward pass per
sample's loss, the GGN from explicit Jacobians (one backward pass per
logit of each sample), the Hessian by double backprop per parameter
entry, unfolded convolution inputs by explicit loops."""
import numpy

import chainer
import chainer.functions as F


def params_of(model):
    """``[(path, param)]`` in ``namedparams()`` order."""
    return [(path, p) for path, p in model.namedparams()
            if p.array is not None]


def split(model, flat):
    """A flat vector over all parameters → ``{path: array}``."""
    out, start = {}, 0
    for path, p in params_of(model):
        out[path] = flat[start:start + p.size].reshape(p.shape)
        start += p.size
    return out


def flat_grads(model):
    return numpy.concatenate([
        (p.grad if p.grad is not None else numpy.zeros(p.shape)).ravel()
        for _, p in params_of(model)])


def per_sample_gradients(model, x, t, lossfun=F.softmax_cross_entropy):
    """``{path: [N, *shape]}``: ``∇ℓ_n / N``, one backward pass of the
    per-sample loss each, the batch forwarded whole (so that coupled
    samples keep their context)."""
    n = len(x)
    rows = []
    for i in range(n):
        model.cleargrads()
        losses = F.softmax_cross_entropy(model(x), t, reduce='no') \
            if lossfun is F.softmax_cross_entropy else lossfun(model(x), t)
        (losses[i] / n).backward()
        rows.append(flat_grads(model))
    rows = numpy.array(rows)
    out, start = {}, 0
    for path, p in params_of(model):
        out[path] = rows[:, start:start + p.size].reshape((n,) + p.shape)
        start += p.size
    return out


def jacobians(model, x, wrt=None):
    """``J[n, c, :]`` = ∂ logits[n, c] / ∂θ (flat over all parameters),
    one backward pass per logit, the batch forwarded whole. With ``wrt``
    (a callable returning an intermediate variable and the logits), the
    Jacobian w.r.t. that variable instead: ``[N, C, *z.shape]``."""
    logits = model(x) if wrt is None else wrt(x)[1]
    n, classes = logits.shape
    out = []
    for i in range(n):
        per_class = []
        for c in range(classes):
            model.cleargrads()
            if wrt is None:
                logits = model(x)
                unit = numpy.zeros(logits.shape)
                unit[i, c] = 1
                logits.grad = unit
                logits.backward()
                per_class.append(flat_grads(model))
            else:
                z, logits = wrt(x)
                unit = numpy.zeros(logits.shape)
                unit[i, c] = 1
                logits.grad = unit
                logits.backward(retain_grad=True)
                per_class.append(z.grad.copy())
        out.append(per_class)
    return numpy.array(out)


def softmax_hessians(logits):
    """``diag(p) − p pᵀ`` per sample, written out."""
    p = numpy.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    return numpy.array([numpy.diag(q) - numpy.outer(q, q) for q in p])


def symmetric_roots(hessians):
    values, vectors = numpy.linalg.eigh(hessians)
    return vectors * numpy.sqrt(numpy.maximum(values, 0))[:, None, :]


def ggn(model, x, hessians=None):
    """The dense GGN ``(1/N) Σ_n J_nᵀ H_n J_n`` (softmax cross-entropy
    Hessians unless ``hessians`` (N, C, C) is given)."""
    logits = model(x).array
    if hessians is None:
        hessians = softmax_hessians(logits)
    jac = jacobians(model, x)
    return numpy.einsum('ncd,nce,nef->df', jac, hessians, jac) / len(x)


def diagonal_blocks(model, matrix):
    """``{path: diagonal of its block}`` and ``{path: block}``."""
    diag = split(model, numpy.diag(matrix).copy())
    blocks, start = {}, 0
    for path, p in params_of(model):
        blocks[path] = matrix[start:start + p.size, start:start + p.size]
        start += p.size
    return diag, blocks


def hessian_diagonal(model, x, t):
    """The diagonal of the mean loss's Hessian, one double-backprop pass
    per parameter entry."""
    params = [p for _, p in params_of(model)]
    loss = F.softmax_cross_entropy(model(x), t, enable_double_backprop=True)
    grads = chainer.grad([loss], params, enable_double_backprop=True)
    flat = F.concat([F.reshape(g, (-1,)) for g in grads], axis=0)
    diagonal = []
    for i in range(flat.shape[0]):
        row = chainer.grad([flat[i]], params)
        row = numpy.concatenate([
            numpy.zeros(p.size) if r is None else r.array.ravel()
            for p, r in zip(params, row)])
        diagonal.append(row[i])
    return split(model, numpy.array(diagonal))


def patches(x, ksize, stride=1, pad=0, dilate=1):
    """Unfolded input by explicit loops: (N, positions, C·k·k), columns
    ordered (channel, kernel row, kernel column)."""
    n, c, h, w = x.shape
    padded = numpy.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    extent = dilate * (ksize - 1) + 1
    oh = (h + 2 * pad - extent) // stride + 1
    ow = (w + 2 * pad - extent) // stride + 1
    rows = numpy.zeros((n, oh * ow, c * ksize * ksize))
    for b in range(n):
        for i in range(oh):
            for j in range(ow):
                window = padded[b, :, i * stride:i * stride + extent:dilate,
                                j * stride:j * stride + extent:dilate]
                rows[b, i * ow + j] = window.reshape(-1)
    return rows

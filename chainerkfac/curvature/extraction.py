"""``extract``: the gradient and BackPACK's quantities of one batch.

The path of one extraction, top to bottom in :func:`extract`:

1. **gradient pass** — forward, the mean loss's backward (``param.grad``),
   the library's capture recording every call of a Linear, Convolution2D
   or fixed BatchNormalization (:mod:`~chainerkfac.curvature.recorder`);
2. **graph** — which parameters take their per-sample quantities from their
   calls and which from per-sample passes
   (:mod:`~chainerkfac.curvature.graph`);
3. **first order** — per-sample gradients, norms, squares from the
   gradient pass (:mod:`~chainerkfac.curvature.adapters`);
4. **extra passes** — one backward pass from the logits per column of the
   loss Hessian's root (:mod:`~chainerkfac.curvature.loss_hessian`): ``C``
   exact columns for ``diag_ggn`` / ``kflr`` / ``diag_hessian``,
   ``mc_samples`` sampled ones for ``diag_ggn_mc`` / ``kfac``; the columns
   travel stacked, a chunk of them as one batch through the recorded graph
   (:mod:`~chainerkfac.curvature.columns`), giving the gradients w.r.t. the
   recorded calls' outputs only (no weight gradient is computed), from
   which the adapters form squares and ``B`` vectors;
5. **residuals** (``diag_hessian``,
   :mod:`~chainerkfac.curvature.hessian_diagonal`) and **KFRA**
   (:mod:`~chainerkfac.curvature.kfra`);
6. **sums over processes** (:mod:`~chainerkfac.curvature.reduction`).
"""
import logging
from typing import Dict, Optional

import numpy

import chainer
import chainer.functions as F

from chainerkfac import capture as capture_module
from chainerkfac import estimator
from chainerkfac import linalg
from chainerkfac import step_guard
from chainerkfac.curvature import columns
from chainerkfac.curvature import hessian_diagonal
from chainerkfac.curvature import kfra as kfra_module
from chainerkfac.curvature import loss_hessian
from chainerkfac.curvature import quantities as q
from chainerkfac.curvature import reduction
from chainerkfac.curvature import sample_passes
from chainerkfac.curvature import slots
from chainerkfac.curvature.graph import ModelGraph
from chainerkfac.curvature.recorder import CallRecorder

logger = logging.getLogger(__name__)


def extract(predictor, x, t, quantities=q.FIRST_ORDER,
            lossfun=F.softmax_cross_entropy, mc_samples: int = 1,
            seed: Optional[int] = None, comm=None,
            conv_factors: str = 'backpack',
            column_chunk: Optional[int] = None
            ) -> Dict[str, Dict[str, object]]:
    """The gradient of the mean loss and BackPACK's quantities, per
    parameter.

    Parameters
    ----------
    predictor : chainer.Link
        ``predictor(x)`` returns the logits (N, C). Any graph whose
        per-sample losses are independent: residual connections, shared
        weights, reshapes, any activation and pooling.
    x, t : arrays
        Inputs and targets of the (local) batch.
    quantities : iterable of str
        Names from :data:`chainerkfac.curvature.QUANTITIES` (the table in
        :mod:`chainerkfac.curvature.quantities` gives their definitions).
    lossfun : callable
        ``lossfun(logits, t)``: the mean over the batch of independent
        per-sample losses (softmax cross-entropy by default; its Hessian is
        in closed form, any other loss's is taken by double backprop).
    mc_samples : int
        Sampled columns per sample for ``diag_ggn_mc`` and ``kfac``.
    seed : int, optional
        Of the Monte-Carlo draws (labels from the model's softmax).
    comm : chainermn communicator, optional
        The batch is the union of all processes' local batches (in rank
        order): the gradient and every sum over samples are summed over
        processes, per-sample quantities stay local (the rows of this
        process's samples), all scaled to the global batch size.
    conv_factors : {'backpack', 'kfc'}
        A convolution weight's ``B`` factor. ``'backpack'`` (BackPACK's):
        ``Σ_n Σ_c g gᵀ`` with ``g`` the root's pull-back to the output
        summed over the output positions, the exact (``kflr``) or sampled
        (``kfac``) GGN of the bias; it differs from Grosse & Martens' KFC
        (the optimizer's ``G``) by the number of output positions ``T``.
        ``'kfc'``: KFC's ``Γ = (1/T) Σ_n Σ_c Σ_positions g gᵀ`` (averaged
        over the calls of a shared weight, as the optimizer does), equal to
        BackPACK's factor over ``T`` when derivatives at different
        positions are uncorrelated (KFC's assumption). ``A`` is the same in
        both (summed over positions), and biases keep BackPACK's ``B``.
    column_chunk : int, optional
        The extra backward passes (root columns, the Hessian's residual
        features, KFRA's columns) travel stacked, as one batch of ``K·N``
        rows through the recorded graph (:mod:`chainerkfac.curvature.
        columns`), at most ``column_chunk`` of them at a time; by default
        as many as keep a stacked array below
        :func:`chainerkfac.curvature.columns.element_limit` elements
        (2**26 on a GPU, 2**22 on the CPU). ``1``:
        one backward pass of Chainer's autodiff per column (the least
        memory; the reference the stacked passes are tested against).

    Returns
    -------
    dict
        ``{path: {name: array}}`` for every parameter of ``predictor``
        (``namedparams()`` paths) that the loss reaches. Names are the
        quantities asked for, the Kronecker ones as ``<name>_A`` (weights
        of Linear and ungrouped Convolution2D calls only, no bias column)
        and ``<name>_B``; ``B ⊗ A`` is ordered like
        ``W.reshape(d_out, -1)``. ``param.grad`` holds the gradient of the
        mean loss (over the global batch with ``comm``); the predictor's
        gradients are cleared first.

    Raises
    ------
    chainerkfac.curvature.UnsupportedGraph
        for a quantity that is not defined on the graph (see the README:
        Kronecker factors, KFRA and the Hessian diagonal with samples
        coupled by BatchNormalization in training mode; KFRA off a chain of
        functions; the Hessian diagonal through functions whose second
        derivative is not elementwise).

    Notes
    -----
    Cost: the gradient pass, plus ``C`` extra backward passes (classes) for
    the exact quantities and ``mc_samples`` for the sampled ones, stacked
    into a few propagations; KFRA ``rank`` passes through each function of
    the chain; the Hessian diagonal one pass per feature entering each
    curved activation.
    Parameters without an adapter, and all parameters when the samples are
    coupled, take one backward pass per sample in place of each of those.
    """
    request = q.Request(quantities)
    if isinstance(predictor, chainer.links.Classifier):
        raise TypeError(
            'extract takes the network that returns the logits, not a '
            'Classifier around it (which returns the loss): pass '
            'model.predictor, and its loss as lossfun')
    if conv_factors not in q.CONV_FACTORS:
        raise ValueError('conv_factors must be one of {}, got {!r}'.format(
            q.CONV_FACTORS, conv_factors))
    if isinstance(mc_samples, bool) or \
            not isinstance(mc_samples, (int, numpy.integer)) or \
            mc_samples < 1:
        raise ValueError('mc_samples must be an integer >= 1, got {!r}'
                         .format(mc_samples))
    if column_chunk is not None and (
            isinstance(column_chunk, bool) or
            not isinstance(column_chunk, (int, numpy.integer)) or
            column_chunk < 1):
        raise ValueError('column_chunk must be an integer >= 1 (or None), '
                         'got {!r}'.format(column_chunk))
    batch = reduction.Batch.of(len(x), comm)
    run = _Extraction(predictor, request, batch, conv_factors, column_chunk)
    # A refused graph (samples coupled by BatchNormalization in training
    # mode, ...) is found only once its forward and backward ran: then the
    # running statistics and gradients are given back.
    statistics = step_guard.StepGuard()
    statistics.checkpoint(predictor)
    # (a lazily sized layer not run yet, L.Linear(None, n), has no
    # gradient to give back: Chainer refuses to read one)
    grads = [(p, None if p.grad is None else p.grad.copy())
             for p in predictor.params(include_uninit=False)]
    try:
        run.gradient_pass(x, t, lossfun)
    except BaseException:
        statistics.restore()
        for param, grad in grads:
            param.grad = grad
        raise
    run.first_order()
    if request.needs_root:
        hessian = run.loss_hessian()
        if request.exact_passes:
            run.ggn_passes('exact', hessian.exact_root().transpose(2, 0, 1))
        if request.sampled_passes:
            rng = numpy.random.RandomState(
                reduction.shared_seed(batch, seed))
            run.ggn_passes('mc', hessian.sampled_roots(int(mc_samples), rng))
        if 'diag_hessian' in request:
            run.hessian_residuals()
        if 'kfra' in request:
            run.kfra(hessian.exact_root())
    if request.input_factors:
        run.input_factors()
    run.sum_over_processes()
    return run.results()


class _Extraction:
    """The state of one :func:`extract` call, stage by stage."""

    def __init__(self, predictor, request, batch, conv_factors,
                 column_chunk):
        self.predictor = predictor
        self.request = request
        self.batch = batch
        self.conv_factors = conv_factors
        self.column_chunk = column_chunk
        #: ``{(path, name): array}`` summed over samples (and processes).
        self.sums: Dict[tuple, object] = {}
        #: ``{(path, name): array}`` one row per local sample.
        self.rows: Dict[tuple, object] = {}

    # -- 1-2: gradient pass and graph ------------------------------------
    def gradient_pass(self, x, t, lossfun) -> None:
        if not chainer.config.enable_backprop:
            raise RuntimeError(
                'extract: backpropagation is off (chainer.no_backprop_mode() '
                "or using_config('enable_backprop', False) around the "
                'call): the quantities need the graph of the forward pass')
        self.logits = logits = self.predictor(x)
        if not isinstance(logits, chainer.Variable):
            raise TypeError('predictor(x) must return the logits (N, C) as '
                            'one Variable, got a {} (wrap a network with '
                            'several outputs to return the one the loss '
                            'takes)'.format(type(logits).__name__))
        if logits.ndim != 2:
            raise ValueError('predictor(x) must return logits (N, C), got '
                             'shape {}'.format(logits.shape))
        params = {path: p for path, p in self.predictor.namedparams()
                  if p.array is not None}
        self.params = params
        self.predictor.cleargrads()
        loss = lossfun(logits, t)
        if not isinstance(loss, chainer.Variable) or loss.size != 1:
            raise ValueError(
                'extract: lossfun must return the scalar mean loss of the '
                'batch, got {}'.format(
                    'shape {}'.format(loss.shape)
                    if isinstance(loss, chainer.Variable) else
                    'a {}'.format(type(loss).__name__)))
        labels = getattr(t, 'array', t)
        if estimator.sums_over_batch(loss, len(logits)) and getattr(
                labels, 'dtype', None) is not None and \
                labels.dtype.kind in 'iu' and (labels == -1).any():
            # a mean over the labels kept, written as a sum (softmax
            # cross-entropy with enable_double_backprop=True)
            raise ValueError(
                'extract: the labels contain -1 (Chainer\'s ignore_label): '
                'the loss is then a mean over fewer than the N samples '
                'that the conventions assume')
        if estimator.sums_over_batch(loss, len(logits)):
            raise ValueError(
                'extract: the loss sums over the batch (its last operation '
                'is F.sum of {} values, one a sample, or a mean times their '
                'number), but the quantities '
                "are those of the batch's mean loss (as BackPACK's): use a "
                "mean (F.mean, or reduce='mean' in the loss "
                'function)'.format(len(logits)))
        # (also where no Hessian is asked for: ignored labels make the loss
        # a mean over fewer than N samples, for the first-order quantities
        # too, whose rows are ∇ℓₙ / N)
        self.softmax = loss_hessian.is_softmax_cross_entropy(loss, t) and \
            self.request.needs_root
        # Per-sample gradients carry 1/N of the global batch.
        self.loss = loss if self.batch.local == self.batch.total else \
            loss * (self.batch.local / self.batch.total)
        recorder = CallRecorder(params)
        with recorder.recording():
            self.loss.backward()
        self.out_grads = recorder.out_grads
        self.graph = graph = ModelGraph(logits, self.loss, params,
                                        recorder.calls, self.batch.local)
        for name in ('kfac', 'kflr', 'kfra', 'diag_hessian'):
            if name in self.request:
                graph.check_independent(name)
        # what KFRA and the Hessian diagonal refuse in a graph (a residual
        # join, a shared weight, a function without its second derivative),
        # now rather than after the exact passes
        if 'kfra' in self.request:
            kfra_module._chain(graph)
        if 'diag_hessian' in self.request:
            hessian_diagonal._curved_functions(graph)
        # Coupled samples: the slots are empty, per-sample passes do all.
        self.passes = columns.Passes(graph, self.column_chunk)
        for path, reason in graph.sampled.items():
            logger.info('curvature: %s by per-sample passes (%s): %d '
                        'backward passes per pass of the batch', path,
                        reason, self.batch.local)

    @property
    def sampled_params(self):
        return [self.params[p] for p in self.graph.sampled]

    def _add(self, path: str, name: str, value) -> None:
        if value is None:
            return
        key = (path, name)
        self.sums[key] = value if key not in self.sums else \
            self.sums[key] + value

    # -- 3: first order ------------------------------------------------
    def first_order(self) -> None:
        wanted = self.request.first_order
        if not wanted:
            return
        squares = bool(wanted & {'sum_grad_squared', 'variance'})
        grads = self.out_grads
        for slot in self.graph.slots:
            per_sample = slot.per_sample(grads) if 'batch_grad' in wanted \
                else None
            self._store_first_order(
                slot.path, per_sample,
                slot.sample_norms(grads, per_sample)
                if 'batch_l2' in wanted else None,
                slot.square_sum(grads, per_sample=per_sample)
                if squares else None)
        if self.graph.sampled:
            with capture_module.unobserved():
                rows, = chainer.grad([self.loss], [self.logits])
            for path, per_sample in zip(
                    self.graph.sampled, sample_passes.per_sample_gradients(
                        self.logits, rows.array, self.sampled_params)):
                self._store_first_order(path, per_sample,
                                        slots.sample_norms(per_sample),
                                        (per_sample * per_sample).sum(0))

    def _store_first_order(self, path, per_sample, norms, squares) -> None:
        wanted = self.request.first_order
        if 'batch_grad' in wanted:
            self.rows[(path, 'batch_grad')] = per_sample
        if 'batch_l2' in wanted:
            self.rows[(path, 'batch_l2')] = norms
        if wanted & {'sum_grad_squared', 'variance'}:
            self._add(path, 'sum_grad_squared', squares)

    # -- 4: extra passes from the logits ---------------------------------
    def loss_hessian(self) -> loss_hessian.LossHessian:
        return loss_hessian.LossHessian(self.loss, self.logits, self.softmax,
                                        self.batch)

    def ggn_passes(self, kind: str, roots) -> None:
        """One backward pass per root column, ``roots`` (K, n, C), stacked
        (:mod:`~chainerkfac.curvature.columns`): ``kind`` 'exact'
        (``diag_ggn``, ``kflr_B``) or 'mc' (``diag_ggn_mc``, ``kfac_B``)."""
        if kind == 'exact':
            diag = self.request.any('diag_ggn', 'diag_hessian')
            factor = 'kflr' in self.request
            diag_name, factor_name = 'diag_ggn', 'kflr_B'
        else:
            diag = 'diag_ggn_mc' in self.request
            factor = 'kfac' in self.request
            diag_name, factor_name = 'diag_ggn_mc', 'kfac_B'
        passes = self.passes.run(self.logits, len(roots),
                                 lambda part: (roots[part], None))
        for slot, grads, _ in passes:
            if diag:
                self._add(slot.path, diag_name, slot.square_sum(grads))
            if factor and slot.kronecker:
                if self.conv_factors == 'kfc' and slot.role == 'weight':
                    value = slot.position_gram(grads)
                else:
                    vectors = slot.output_vectors(grads)
                    value = linalg.gram(vectors, 1.0)
                self._add(slot.path, factor_name, value)
        if diag and self.graph.sampled:
            for root in roots:
                per_sample = sample_passes.per_sample_gradients(
                    self.logits, root, self.sampled_params)
                for path, grads_n in zip(self.graph.sampled, per_sample):
                    self._add(path, diag_name, (grads_n * grads_n).sum(0))

    # -- 5: Hessian residuals, KFRA, input factors --------------------------
    def hessian_residuals(self) -> None:
        for path, value in hessian_diagonal.residual_diagonals(
                self.graph, self.loss, self.passes).items():
            self._add(path, 'diag_hessian', value)

    def kfra(self, root) -> None:
        self.kfra_factors = kfra_module.output_factors(
            self.graph, root, self.batch, self.column_chunk)

    def input_factors(self) -> None:
        scale = 1.0 / self.batch.total
        for slot in self.graph.slots:
            if slot.kronecker and slot.role == 'weight':
                self._add(slot.path, 'A', slot.input_factor(scale))

    # -- 6: sums over processes, results -----------------------------------
    def sum_over_processes(self) -> None:
        keys = list(self.sums)
        grads = [p for p in self.params.values() if p.grad is not None]
        summed = reduction.sum_over_processes(
            self.batch, [self.sums[k] for k in keys] + [p.grad for p in grads])
        self.sums = dict(zip(keys, summed[:len(keys)]))
        for param, grad in zip(grads, summed[len(keys):]):
            param.grad[...] = grad

    def results(self) -> Dict[str, Dict[str, object]]:
        request = self.request
        total = self.batch.total
        out = {}
        for path in self.graph.reached:
            values = {}
            sums = {name: v for (p, name), v in self.sums.items()
                    if p == path}
            for name in q.QUANTITIES:
                if name not in request:
                    continue
                if name in q.PER_SAMPLE:
                    values[name] = self.rows[(path, name)]
                elif name == 'variance':
                    mean = self.params[path].grad / total
                    values[name] = sums['sum_grad_squared'] / total - \
                        mean * mean
                elif name == 'diag_hessian':
                    values[name] = sums['diag_ggn'] + sums.get(
                        'diag_hessian', 0)
                elif name == 'kfra':
                    factors = self.kfra_factors.get(path)
                    if factors is not None:
                        values.update(_kronecker(name, sums.get('A'),
                                                 factors))
                elif name in q.KRONECKER:
                    factor = sums.get(name + '_B')
                    if factor is not None:
                        values.update(_kronecker(name, sums.get('A'), factor))
                elif name in sums:
                    values[name] = sums[name]
            out[path] = values
        return out


def _kronecker(name, a, b) -> Dict[str, object]:
    values = {}
    if a is not None:
        values[name + '_A'] = a
    values[name + '_B'] = b
    return values

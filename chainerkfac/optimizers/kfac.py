"""K-FAC for Chainer (Osawa et al., CVPR 2019), single- or multi-process.

One training step, top to bottom (:meth:`KFAC.update`):

1-2. forward and backward of the user's loss with the capture hook on
     (:mod:`chainerkfac.capture`) — only the factors due this step;
3.   the transport sums gradients and due factors over processes and leaves
     each block's on its owner (:mod:`chainerkfac.transport`);
4.   owners refresh their blocks' damped inverses
     (:mod:`chainerkfac.fisher_blocks`, :mod:`chainerkfac.linalg`);
5.   owners precondition their blocks' gradients, ``(F + γI)⁻¹ ∇E``;
6.   the transport gives every process all preconditioned gradients;
     then every process applies eqs. (19)-(20) (:class:`KFACRule`).
"""
import logging
import math
import time
import warnings
from typing import Dict, List, Optional

import numpy

import chainer
import chainer.functions as F
import chainer.links as L
from chainer import optimizer
from chainer.backend import get_array_module
from chainer.functions.math import sum as sum_module

from chainerkfac import _logging
from chainerkfac import capture
from chainerkfac import equations
from chainerkfac import fisher_blocks
from chainerkfac import fused
from chainerkfac import linalg
from chainerkfac import scale_invariance
from chainerkfac.optimizers import options
from chainerkfac.fisher_blocks import FactorKind
from chainerkfac.transport import LocalTransport

logger = logging.getLogger(__name__)

#: ε of eq. (20).
RESCALE_EPS = fused.RESCALE_EPS
#: Links whose weight eq. (20) concerns (the paper's Conv and FC layers).
RESCALED_LINKS = (L.Linear, L.Convolution2D)
#: Which refresh interval schedules each kind of factor.
_INTERVAL_OF = {FactorKind.INPUTS: 'A', FactorKind.OUTPUT_GRADS: 'G',
                FactorKind.PARAM_GRADS: 'F'}

_default_hyperparam = optimizer.Hyperparameter()
_default_hyperparam.lr = 0.01
_default_hyperparam.momentum = 0.9


class KFACRule(optimizer.UpdateRule):
    """Update rule of one parameter: eqs. (19) and (20).

    ``w ← w − η G + m (w − w_prev)``, then, where eq. (20) applies,
    ``w ← √(2·d_out) · w / (‖w‖ + ε)``. The state ``v`` holds the last
    displacement ``w(t) − w(t−1)`` of the (rescaled) weights. The direction
    ``G`` is handed over by the optimizer for each step in
    :attr:`direction`.
    """

    def __init__(self, parent_hyperparam=None, lr=None, momentum=None):
        super().__init__(parent_hyperparam or _default_hyperparam)
        if lr is not None:
            self.hyperparam.lr = lr
        if momentum is not None:
            self.hyperparam.momentum = momentum
        #: Target norm of eq. (20), or None for no rescaling.
        self.rescale_norm: Optional[float] = None
        #: Preconditioned gradient for the coming update (consumed by it).
        self.direction = None

    def init_state(self, param):
        with chainer.using_device(param.device):
            self.state['v'] = param.device.xp.zeros_like(param.array)

    def update_core_cpu(self, param):
        direction, self.direction = self.direction, None
        if direction is None:
            return
        fused.momentum_step(param.array, self.state['v'], direction,
                            self.hyperparam.lr, self.hyperparam.momentum,
                            self.rescale_norm)

    # One fused kernel per parameter (three with eq. 20) on the GPU.
    update_core_gpu = update_core_cpu


class KFAC(optimizer.GradientMethod):
    """Kronecker-factored natural gradient with the paper's schemes.

    Set up and driven exactly like :class:`chainer.optimizers.MomentumSGD`::

        optimizer = chainerkfac.optimizers.KFAC(lr=..., momentum=...)
        optimizer.setup(model)
        optimizer.update(model, x, t)   # or through a StandardUpdater

    ``update`` must be given the loss function (K-FAC captures layer inputs
    and output gradients while it runs).

    Which link gets which Fisher block is decided by the block registry
    (:func:`chainerkfac.register_block`): Linear and Convolution2D get
    Kronecker-factored blocks, BatchNormalization a full or diagonal Fisher
    of (γ, β); every other parameter (unknown link types, grouped
    convolutions, BatchRenormalization, BN without γ or β, ``skip_layers``)
    gets the plain gradient with the same update rule (eq. 19). The
    registration table (logged at the first update) says what each link
    got and why.

    A link not called in a step contributes nothing to that step: a factor
    due then keeps its previous value and inverse and stays due (its
    staleness does not advance); parameters without a gradient on any
    process are not updated that step.

    Parameters
    ----------
    lr, momentum : float
        η and m of eq. (19); set them per step from a Chainer extension
        (see :mod:`chainerkfac.training` for eqs. 17-18).
    damping : float
        γ(0); the damping of eqs. (13)-(14).
    damping_target, damping_warmup_steps : float, int, optional
        γ_target and t_warmup of eqs. (15)-(16); without them γ stays fixed.
    rho_bn : float
        BatchNormalization layers use ``ρ_BN · γ`` (section 4.3).
    bn_fisher : {'full', 'diag'}
        Full 2C×2C Fisher of (γ, β) ("no approx") or its diagonal (5.4).
    fisher : {'emp', 'mc'}
        Empirical Fisher with the true labels (the paper), or one label per
        sample drawn from the model's softmax (Monte-Carlo "true" Fisher).
    acc_iters : int
        Micro-batches accumulated (gradients and factors) per K-FAC step:
        one step every ``acc_iters`` calls of :meth:`update`.
    refresh_interval_a, refresh_interval_g, refresh_interval_f : int, str or callable
        Stale Fisher (eqs. 22-23): refresh the factors estimated from layer
        inputs (A), from output gradients (G) and from parameter gradients
        (the BN Fisher F) every so many K-FAC steps; a callable of
        ``(iteration, epoch)`` or a preset name (``'eq22'``, ``'eq23'``).
    factor_dtype : {'float32', 'float16'}
        fp16 builds the factors from half-precision GEMMs with fp32
        accumulation; inverses are always fp32 (fp64 for fp64 models).
    factor_decay : float
        Exponential average of refreshed factors (0: the current estimate,
        as in the paper).
    weight_rescale : {'auto', True, False}
        Eq. (20), rescaling a Linear or Convolution2D weight to the norm
        ``√(2·d_out)`` after every step. ``'auto'`` (default): only weights
        whose layer is scale invariant — its output feeds a
        BatchNormalization (:mod:`chainerkfac.scale_invariance`), found from
        the graph of the first update — where rescaling leaves the network's
        function unchanged. On ResNet-50 that is every convolution but not
        the final FC. ``True``: every Linear and Convolution2D weight, as
        the paper does (its FC included; the ImageNet configs use this).
        ``False``: none.
    skip_layers : str, re.Pattern, type or a sequence of them
        Links to leave unpreconditioned (plain gradient, same eq. 19 rule):
        link names (``'/predictor/fc'``, the leading ``/`` optional),
        regular expressions matched against the whole name, or link
        classes.
    loss_reduction : {'mean', 'sum'}
        How the loss reduces over the mini-batch. K-FAC's per-sample scale
        of the factors assumes a mean (as ``F.softmax_cross_entropy``);
        with ``'mean'`` a loss whose last operation is ``F.sum`` is refused
        with an error. With ``'sum'`` the factors are rescaled and the
        gradient divided by the number of samples, so the step equals that
        of the mean loss.
    fisher_diff : bool
        Compute Diff(t) of eq. (21) for every refreshed factor
        (:attr:`fisher_diffs`, and reported as ``kfac/diff/...``).
    verbose : bool
        Log the registration table (layer → block → factor shapes, eq. 20)
        at the first update (on stdout unless logging is configured).
    seed : int, optional
        Seed of the label sampler of the MC Fisher.
    """

    lr = optimizer.HyperparameterProxy('lr')
    momentum = optimizer.HyperparameterProxy('momentum')

    def __init__(self, lr=_default_hyperparam.lr,
                 momentum=_default_hyperparam.momentum,
                 damping: float = 1e-3,
                 damping_target: Optional[float] = None,
                 damping_warmup_steps: Optional[int] = None,
                 rho_bn: float = 1.0, bn_fisher: str = 'full',
                 fisher: str = 'emp', acc_iters: int = 1,
                 refresh_interval_a=1, refresh_interval_g=1,
                 refresh_interval_f=1, factor_dtype: str = 'float32',
                 factor_decay: float = 0.0, weight_rescale='auto',
                 skip_layers=(), loss_reduction: str = 'mean',
                 fisher_diff: bool = False, verbose: bool = True,
                 seed: Optional[int] = None):
        super().__init__()
        self.hyperparam.lr = lr
        self.hyperparam.momentum = momentum
        options.check_options(
            lr=lr, momentum=momentum, damping=damping,
            damping_target=damping_target,
            damping_warmup_steps=damping_warmup_steps, rho_bn=rho_bn,
            bn_fisher=bn_fisher, fisher=fisher, acc_iters=acc_iters,
            refresh_interval_a=refresh_interval_a,
            refresh_interval_g=refresh_interval_g,
            refresh_interval_f=refresh_interval_f, factor_dtype=factor_dtype,
            factor_decay=factor_decay, weight_rescale=weight_rescale,
            loss_reduction=loss_reduction)
        self.damping = float(damping)
        self.damping_target = damping_target
        self.damping_warmup_steps = damping_warmup_steps
        self._damping_rate = (
            None if damping_target is None else
            equations.damping_warmup_rate(damping, damping_target,
                                          damping_warmup_steps))
        self.rho_bn = float(rho_bn)
        self.bn_fisher = bn_fisher
        self.fisher = fisher
        self.acc_iters = acc_iters
        self.refresh_intervals = {
            'A': equations.resolve_interval(refresh_interval_a),
            'G': equations.resolve_interval(refresh_interval_g),
            'F': equations.resolve_interval(refresh_interval_f)}
        self.factor_dtype = numpy.dtype(factor_dtype)
        self.factor_decay = float(factor_decay)
        self.weight_rescale = weight_rescale
        self.skip_layers = skip_layers
        fisher_blocks.registry.skip_matchers(skip_layers)  # check the types
        self.loss_reduction = loss_reduction
        self.fisher_diff = fisher_diff
        self.verbose = verbose
        self._rng = numpy.random.RandomState(seed)
        self.blocks: List = []
        #: Stages 3 and 6 (see :mod:`chainerkfac.transport`).
        self.transport = LocalTransport()
        #: Diff(t) of eq. (21) from the last refresh: {(layer, factor): x}.
        self.fisher_diffs: Dict = {}
        #: Wall time of each stage in the last step (seconds).
        self.stage_times: Dict[str, float] = {}
        #: Synchronise the device before reading stage timers (benchmarks).
        self.synchronize_stage_timers = False
        self._micro = 0
        self._samples = 0
        self._due: Dict = {}
        self._started = False
        self._rescale_decided = False
        self._persistent_backup = None

    # -- set-up ----------------------------------------------------------------
    def create_update_rule(self):
        return KFACRule(self.hyperparam)

    def setup(self, link):
        super().setup(link)
        self.blocks = fisher_blocks.build_blocks(
            link, fisher_blocks.BlockOptions(self.factor_dtype,
                                             self.bn_fisher),
            self.skip_layers)
        for text, match in fisher_blocks.registry.skip_matchers(
                self.skip_layers):
            if not any(match(n, l) for n, l in link.namedlinks()):
                warnings.warn('KFAC: skip_layers entry {!r} matches no link '
                              'of the model'.format(text))
        if self.weight_rescale is True:
            self._set_rescaled({id(p) for p, _ in self._rescale_candidates()})
        return self

    @property
    def started(self) -> bool:
        """Whether the first update has begun (the transport is set up)."""
        return self._started

    def _rescale_candidates(self):
        """``[(W, d_out)]`` of the weights eq. (20) may concern."""
        out = []
        for _, link in self.target.namedlinks():
            if isinstance(link, RESCALED_LINKS):
                weight = getattr(link, 'W', None)
                if weight is not None:
                    d_out = getattr(link, 'out_size', None) or \
                        link.out_channels
                    out.append((weight, int(d_out)))
        return out

    def _set_rescaled(self, ids):
        for weight, d_out in self._rescale_candidates():
            weight.update_rule.rescale_norm = (
                math.sqrt(2.0 * d_out) if id(weight) in ids else None)
        self._rescale_decided = True

    def rescaled_params(self) -> List[str]:
        """Names of the parameters eq. (20) rescales (decided at the first
        update for ``weight_rescale='auto'``)."""
        return [name for name, param in self.target.namedparams()
                if param.update_rule is not None and
                param.update_rule.rescale_norm is not None]

    def registration_table(self) -> str:
        """Layer → block → factor shapes → eq. (20) → note, one line per
        link with parameters."""
        rescaled = {id(p) for p, _ in self._rescale_candidates()
                    if p.update_rule.rescale_norm is not None}
        candidates = {id(p) for p, _ in self._rescale_candidates()}
        rows = [('layer', 'block', 'factors', 'rescale', 'note')]
        for block in self.blocks:
            weights = [p for p in block.params if id(p) in candidates]
            if not weights:
                rescale = '-'
            elif not self._rescale_decided:
                rescale = 'auto'
            else:
                rescale = 'yes' if id(weights[0]) in rescaled else 'no'
            rows.append((block.name, block.kind, block.describe(), rescale,
                         block.note))
        width = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ['  '.join('{:<{}}'.format(r[i], width[i]) for i in range(4))
                 + ('  ' + r[4] if r[4] else '') for r in rows]
        lines = [line.rstrip() for line in lines]
        n_kfac = sum(1 for b in self.blocks if b.factor_names)
        lines.append('{} K-FAC layers, {} with the plain gradient; eq. (20) '
                     'rescales {} of {} Linear/Convolution2D weights '
                     '(weight_rescale={!r})'.format(
                         n_kfac, len(self.blocks) - n_kfac, len(rescaled),
                         len(candidates), self.weight_rescale))
        return '\n'.join(lines)

    def config_fingerprint(self) -> Dict[str, str]:
        """What must be equal on every process: parameter names, shapes and
        dtypes, hyperparameters, step counters, blocks.

        Returns
        -------
        dict
            ``{'param /conv/W': '(4, 2, 3, 3) float32', 'damping': '0.001',
            ...}`` — string values, comparable across processes.
        """
        items = {}
        for name, param in sorted(self.target.namedparams()):
            items['param ' + name] = (
                'uninitialised' if param.array is None else
                '{} {}'.format(tuple(param.shape), param.dtype))
        for name in ('lr', 'momentum'):
            items[name] = repr(getattr(self.hyperparam, name))
        for name in ('damping', 'damping_target', 'damping_warmup_steps',
                     'rho_bn', 'bn_fisher', 'fisher', 'acc_iters',
                     'factor_dtype', 'factor_decay', 'weight_rescale',
                     'loss_reduction', 'fisher_diff', 't', 'epoch'):
            items[name] = repr(getattr(self, name))
        for kind, interval in sorted(self.refresh_intervals.items()):
            items['refresh_interval_' + kind] = repr(
                [int(interval(self.t, e)) for e in sorted(
                    set(_SCHEDULE_PROBE_EPOCHS) | {self.epoch})])
        for block in self.blocks:
            items['block ' + block.name] = '{} {}'.format(block.kind,
                                                          block.note)
        return items

    def _start(self) -> bool:
        """Set up the transport and the blocks' ownership (first update).
        Returns whether the transport replaced this process's parameters."""
        changed = self.transport.setup(self)
        self._started = True
        # A restored state may hold factors of blocks owned elsewhere now
        # (another number of processes): keep only our own, recompute their
        # inverses, and refresh every factor no process holds.
        flags = []
        for block in self.blocks:
            owned = self.transport.owns(block)
            if owned:
                block.restore_inverses()
            else:
                block.drop_factors()
            flags += [int(owned and name not in block.factors and
                          block.last_refresh[name] >= 0)
                      for name in block.factor_names]
        totals = self.transport.all_sum(numpy.array(flags, numpy.int64))
        if totals.any():
            totals = iter(totals)
            stale = []
            for block in self.blocks:
                for name in block.factor_names:
                    if next(totals):
                        block.last_refresh[name] = -1
                        stale.append(block.name + ' ' + name)
            if self.transport.rank == 0:
                logger.warning(
                    'K-FAC: the restored state lacks %d factors of blocks '
                    'owned here (a snapshot from another number of processes '
                    'whose files were not all loaded?); they are refreshed at '
                    'the next step: %s', len(stale), ', '.join(stale[:5]))
        return changed

    # -- one call of update = one micro-batch ----------------------------------
    def update(self, lossfun=None, *args, **kwds):
        """Forward/backward one micro-batch; every ``acc_iters`` calls, take
        one K-FAC step."""
        if lossfun is None:
            raise TypeError(
                'KFAC.update needs the loss function, e.g. '
                'optimizer.update(model, x, t): K-FAC captures the layer '
                'inputs and output gradients while it runs.')
        first = not self._started
        lazy = first and bool(self.transport.all_sum(numpy.array(
            [any(p.array is None for p in self.target.params())],
            numpy.int64))[0])
        if first and not lazy:
            self._start()
        if self._micro == 0:
            self.target.cleargrads()
            self._due = self._factors_due()
            self._backup_persistents()
            self._mark('start')
        self._forward_backward(lossfun, args, kwds, inspect=first)
        if lazy and self._start():
            # The first forward ran on this process's own initial values of
            # lazily initialised links: redo it with rank 0's.
            logger.warning(
                'K-FAC multi-node: lazily initialised parameters differed '
                "from rank 0's; the first micro-batch was recomputed with "
                "rank 0's values")
            self._restore_persistents()
            self.target.cleargrads()
            for block in self.blocks:
                block.reset_capture()
            self._samples = 0
            self._forward_backward(lossfun, args, kwds, inspect=False)
        self._micro += 1
        if self._micro < self.acc_iters:
            return
        self._mark('forward_backward')
        self._step()

    def flush_accumulation(self) -> int:
        """Take the K-FAC step now with the micro-batches accumulated since
        the last step (fewer than ``acc_iters``), averaged over them.

        For the end of a run whose length is not a multiple of
        ``acc_iters``. In a multi-process run every process calls it.

        Returns
        -------
        int
            The number of micro-batches the step used (0: none was pending,
            no step taken).
        """
        pending = self._micro
        if pending:
            self._mark('forward_backward')
            self._step()
        return pending

    def _factors_due(self):
        due = {}
        for block in self.blocks:
            names = frozenset(
                name for name, kind in block.factor_kinds.items()
                if self._is_due(block.last_refresh[name], kind))
            if names:
                due[block] = names
        return due

    def _is_due(self, last: int, kind: FactorKind) -> bool:
        interval = self.refresh_intervals[_INTERVAL_OF[kind]]
        return last < 0 or self.t - last >= interval(self.t, self.epoch)

    def _forward_backward(self, lossfun, args, kwds, inspect=False):
        due = self._due
        if self._micro == 0:
            for block, names in due.items():
                block.start_capture(names)
        forward_due = _of_pass(due, forward=True)
        backward_due = _of_pass(due, forward=False)
        # The MC Fisher takes the backward factors from a second backward
        # pass with sampled labels; the true labels' pass captures only A.
        monte_carlo = self.fisher == 'mc' and bool(backward_due)
        if due or self.loss_reduction == 'sum' or inspect:
            hook = capture.FactorCapture(
                self.blocks, forward_due if monte_carlo else due,
                record_logits=monte_carlo)
        else:
            # A stale step captures nothing: no hook on every function.
            hook = _NO_HOOK
        with hook:
            loss = lossfun(*args, **kwds)
            # Backward of some functions calls forward of others: capture
            # A only from the loss's own forward pass.
            hook.forward = False
            self._check_reduction(loss)
            batch = hook.batch_size
            if self.loss_reduction == 'sum':
                if not batch:
                    raise RuntimeError(
                        "KFAC(loss_reduction='sum') takes the batch size "
                        'from the first modelled layer (Linear, '
                        'Convolution2D, BatchNormalization); the loss '
                        'called none')
                if not monte_carlo:
                    self._scale_backward_capture(backward_due, batch)
            if not monte_carlo:
                loss.backward()
        if monte_carlo:
            self._sampled_backward(hook.logits, backward_due)
            loss.backward()
        self._samples += batch or 0
        for block in due:
            block.end_micro_batch()
        if inspect:
            self._inspect_first_graph(loss)
        del loss

    def _check_reduction(self, loss) -> None:
        if self.loss_reduction == 'mean' and isinstance(
                loss.creator, sum_module.Sum):
            raise ValueError(
                'K-FAC: the loss is a sum over the mini-batch (its last '
                'operation is F.sum), but K-FAC scales the factors for a '
                "batch-mean loss. Use a mean (F.mean, or reduce='mean' in "
                "the loss function), or KFAC(loss_reduction='sum').")

    def _scale_backward_capture(self, backward_due, batch):
        # A summed loss delivers per-sample output gradients N times larger
        # than a mean's: backward factors are quadratic in them.
        scale = 1.0 / float(batch) ** 2
        for block, names in backward_due.items():
            block.scale_capture({n: scale for n in names})

    def _inspect_first_graph(self, loss) -> None:
        """Eq. (20) 'auto' from the first graph; then the table."""
        if self.weight_rescale == 'auto' and not self._rescale_decided:
            invariant = scale_invariance.scale_invariant_weights(loss)
            names = [n for n, p in sorted(self.target.namedparams())]
            flags = numpy.array(
                [int(id(p) in invariant)
                 for _, p in sorted(self.target.namedparams())],
                dtype=numpy.int64)
            # Rescale only where every process found invariance.
            agreed = self.transport.all_sum(flags) == self.transport.size
            params = dict(self.target.namedparams())
            self._set_rescaled({id(params[n]) for n, ok in zip(names, agreed)
                                if ok})
        if self.verbose and self.transport.rank == 0:
            _logging.ensure_visible()
            logger.info('K-FAC registration\n%s', self.registration_table())

    def _sampled_backward(self, logits, backward_due):
        """G/F from labels drawn from the model's softmax (MC Fisher)."""
        if logits is None:
            raise RuntimeError(
                "fisher='mc' needs the logits: the loss must apply "
                'F.softmax_cross_entropy, F.log_softmax or F.softmax to the '
                "model's output")
        labels = self.sample_labels(logits.array)
        stashed = [(p, p.grad_var) for p in self.target.params()]
        for param, _ in stashed:
            param.grad_var = None
        sampled_hook = capture.FactorCapture(self.blocks, backward_due)
        sampled_hook.forward = False
        with sampled_hook:
            F.softmax_cross_entropy(logits, labels).backward()
        for param, grad_var in stashed:
            param.grad_var = grad_var

    def sample_labels(self, logits):
        """One label per row drawn from ``softmax(logits)`` (MC Fisher)."""
        probs = chainer.backend.CpuDevice().send(
            F.softmax(logits.astype(numpy.float64)).array)
        cumulative = probs.cumsum(axis=1)
        draws = self._rng.random_sample((probs.shape[0], 1))
        labels = (cumulative < draws * cumulative[:, -1:]).sum(axis=1)
        labels = numpy.minimum(labels, probs.shape[1] - 1).astype(numpy.int32)
        return chainer.backend.get_device_from_array(logits).send(labels)

    # -- stages 3-6 and the update -----------------------------------------------
    def _step(self):
        blocks, transport = self.blocks, self.transport
        n_micro, self._micro = self._micro, 0
        samples, self._samples = self._samples, 0
        captured = {b: b.captured() for b in blocks}
        # Every process learns which factors were captured anywhere (and by
        # how many micro-batches) and which parameters have a gradient
        # anywhere, so all send the same arrays.
        local = []
        for block in blocks:
            local += [captured[block].get(n, (None, 0))[1]
                      for n in block.factor_names]
            local += [int(p.grad is not None) for p in block.params]
        totals = iter(transport.all_sum(numpy.array(local, numpy.int64)))
        counts, present = {}, {}
        for block in blocks:
            counts[block] = {n: c for n, c in zip(
                block.factor_names, totals) if c}
            present[block] = [bool(next(totals)) for _ in block.params]
        self.reallocate_cleared_grads()
        scale = 1.0 / (samples if self.loss_reduction == 'sum' else n_micro)
        for block in blocks:
            for param, has in zip(block.params, present[block]):
                if has and scale != 1.0:
                    param.grad *= param.grad.dtype.type(scale)
        self.call_hooks('pre')
        grads = {b: [p.grad if has else None
                     for p, has in zip(b.params, present[b])]
                 for b in blocks}
        factors = {b: {n: self._local_factor(b, n, captured[b])
                       for n in counts[b]} for b in blocks}
        self._mark('factors')
        grads, factors = transport.reduce_scatter(blocks, grads, factors)
        if transport.size > 1:
            for reduced in grads.values():
                for grad in reduced:
                    if grad is not None:
                        grad /= transport.size
        self._mark('reduce_scatter')

        retries = self._refresh(factors, counts)
        self._mark('inverse')

        directions = {}
        for block in blocks:
            if transport.owns(block) and any(present[block]):
                directions[block] = self._precondition(block, grads[block])
        self._mark('precondition')
        directions = transport.all_gather(blocks, directions, present)
        self._mark('all_gather')

        finite = transport.agree(fused.all_finite(
            [d for ds in directions.values() for d in ds]))
        step = self.t
        self.t += 1
        if finite:
            for block in blocks:
                for param, direction in zip(block.params,
                                            directions.get(block, ())):
                    if direction is not None:
                        param.update_rule.direction = direction
                        param.update()
        else:
            self._restore_persistents()
        refreshed = set()
        for block in blocks:
            for name in counts[block]:
                block.last_refresh[name] = step
                refreshed.add(_INTERVAL_OF[block.factor_kinds[name]])
        self._report(refreshed, retries, skipped=not finite)
        if self._damping_rate is not None:
            rate = self._damping_rate
            self.damping = (1 - rate) * self.damping + \
                rate * self.damping_target
        self._mark('update')
        self.call_hooks('post')

    def _local_factor(self, block, name, captured):
        """This process's factor sum, or zeros if it captured none (others
        did)."""
        if name in captured:
            return captured[name][0]
        like = block.params[0]
        with chainer.using_device(like.device):
            return like.device.xp.zeros(block.factor_shapes()[name],
                                        linalg.factor_dtype_for(like.dtype))

    def _refresh(self, factors, counts) -> int:
        """Stage 4: average the reduced factor sums, invert, store."""
        self.fisher_diffs = {}
        requests = []
        for block, sums in factors.items():
            if not sums:
                continue
            damping = self.damping * block.damping_scale(self.rho_bn)
            candidates = {}
            for name, total in sums.items():
                total /= counts[block][name]
                candidates[name] = block.candidate(name, total,
                                                   self.factor_decay)
            wanted = block.inverse_requests(candidates, damping)
            for name, (matrix, used) in wanted.items():
                requests.append((block, name, matrix, used))
            for name in candidates:
                if name not in wanted:
                    # Cannot be inverted yet (its partner is missing): keep
                    # it for when it can.
                    block.factors[name] = candidates[name]
                    block.refresh_count[name] += 1
        results = linalg.damped_inverses([r[2] for r in requests],
                                         [r[3] for r in requests])
        retries = 0
        for (block, name, matrix, _), result in zip(requests, results):
            retries += result.retries
            if not block.commit(name, matrix, result, self.fisher_diff):
                logger.warning(
                    'K-FAC step %d: factor %s of %s could not be inverted '
                    '(non-finite, or not positive definite at damping %.3g); '
                    'the previous factor and inverse are kept', self.t, name,
                    block.name, result.damping)
            elif name in block.diff and self.fisher_diff:
                self.fisher_diffs[(block.name, name)] = block.diff[name]
        return retries

    def _precondition(self, block, grads):
        damping = self.damping * block.damping_scale(self.rho_bn)
        filled = [g if g is not None else p.array * 0
                  for g, p in zip(grads, block.params)]
        out = block.precondition(filled, damping)
        return [d if g is not None else None for d, g in zip(out, grads)]

    def _backup_persistents(self) -> None:
        """Keep the running statistics (BN's mean and variance, ...) of the
        coming step, to restore them if the step is skipped: one copy of
        all persistent arrays (one kernel on the GPU)."""
        arrays, scalars = [], []
        for _, link in self.target.namedlinks():
            for name in link._persistent:
                value = getattr(link, name)
                if isinstance(value, chainer.get_array_types()):
                    arrays.append((link, name, value))
                elif isinstance(value, (int, float, numpy.generic)):
                    scalars.append((link, name, value))
        groups = {}
        for link, name, value in arrays:
            key = (type(value), numpy.dtype(value.dtype))
            groups.setdefault(key, []).append((link, name, value))
        copies = []
        for members in groups.values():
            xp = get_array_module(members[0][2])
            flat = xp.concatenate([v.ravel() for _, _, v in members])
            copies.append(([(l, n, v.shape) for l, n, v in members], flat))
        self._persistent_backup = (copies, scalars)

    def _restore_persistents(self) -> None:
        copies, scalars = self._persistent_backup or ((), ())
        for members, flat in copies:
            start = 0
            for link, name, shape in members:
                size = int(numpy.prod(shape))
                getattr(link, name)[...] = flat[start:start + size].reshape(
                    shape)
                start += size
        for link, name, value in scalars:
            setattr(link, name, value)

    def _report(self, refreshed, retries, skipped):
        observation = {
            'kfac/damping': self.damping,
            'kfac/refresh_A': float('A' in refreshed),
            'kfac/refresh_G': float('G' in refreshed),
            'kfac/refresh_F': float('F' in refreshed),
            'kfac/inverse_retries': float(retries),
            'kfac/skipped_step': float(skipped),
        }
        for (layer, factor), value in self.fisher_diffs.items():
            observation['kfac/diff/{}{}'.format(factor, layer)] = value
        chainer.reporter.report(observation)
        if skipped:
            logger.warning('K-FAC step %d: non-finite preconditioned '
                           'gradient, update skipped (weights and running '
                           'statistics unchanged)', self.t)

    @property
    def last_refresh(self) -> Dict[str, int]:
        """``{'A': step, 'G': step, 'F': step}``: the last step that
        refreshed any factor scheduled by each interval (-1: none)."""
        out = {'A': -1, 'G': -1, 'F': -1}
        for block in self.blocks:
            for name, kind in block.factor_kinds.items():
                key = _INTERVAL_OF[kind]
                out[key] = max(out[key], block.last_refresh[name])
        return out

    def _mark(self, stage):
        if self.synchronize_stage_timers:
            _synchronize(self.target)
        now = time.perf_counter()
        if stage != 'start':
            self.stage_times[stage] = self.stage_times.get(stage, 0.0) + \
                now - self._last_mark
        else:
            self.stage_times = {}
        self._last_mark = now

    # -- state --------------------------------------------------------------------
    def serialize(self, serializer):
        """Optimizer state: t, epoch, velocities (Chainer's), the damping,
        the label sampler of the MC Fisher, and per block its refresh
        bookkeeping and — for the blocks this process holds — its factors
        (inverses are recomputed from them on loading, bit for bit)."""
        super().serialize(serializer)
        self.damping = float(serializer('damping', self.damping))
        # Gradients and factors of an unfinished accumulation are not part
        # of the state: snapshot at step boundaries (train_imagenet.py does).
        micro = int(serializer('micro_batch', self._micro))
        if micro != self._micro:
            warnings.warn(
                'K-FAC state saved after {} of {} accumulated micro-batches: '
                'they are dropped and the next update starts a new step'
                .format(micro, self.acc_iters))
        # The MC Fisher's label sampler continues where it stopped.
        name, keys, position, has_gauss, gauss = self._rng.get_state()
        keys = serializer('mc_rng_keys', keys)
        position = int(serializer('mc_rng_position', position))
        self._rng.set_state((name, numpy.asarray(keys, numpy.uint32),
                             position, has_gauss, gauss))
        state = serializer['kfac']
        for block in self.blocks:
            block.serialize(state[block.name.strip('/') or '_root'])
        if self._started:
            for block in self.blocks:
                if self.transport.owns(block):
                    block.restore_inverses()


#: Epochs at which refresh-interval callables are compared across ranks.
_SCHEDULE_PROBE_EPOCHS = (0, 1, 2, 5, 10, 20, 30, 40, 50, 60, 80, 100)


class _NoHook:
    """Stands in for the capture hook in steps that capture nothing."""

    forward = False
    batch_size = None
    logits = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_HOOK = _NoHook()


def _of_pass(due, forward: bool):
    """The part of ``{block: due names}`` captured in one pass."""
    out = {}
    for block, names in due.items():
        mine = frozenset(n for n in names
                         if block.factor_kinds[n].forward == forward)
        if mine:
            out[block] = mine
    return out


def _synchronize(target):
    for param in target.params():
        if param.array is not None:
            xp = get_array_module(param.array)
            if xp is not numpy:
                xp.cuda.Device().synchronize()
            return

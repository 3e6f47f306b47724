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
import math
import sys
import time
import warnings
from typing import Dict, Optional

import numpy

import chainer
import chainer.functions as F
from chainer import optimizer
from chainer.backend import get_array_module

from chainerkfac import capture
from chainerkfac import fisher_blocks
from chainerkfac import schedules
from chainerkfac.transport import LocalTransport

FISHER_TYPES = ('emp', 'mc')
FACTOR_DTYPES = ('float32', 'float16')
#: ε of eq. (20).
RESCALE_EPS = 1e-9

_default_hyperparam = optimizer.Hyperparameter()
_default_hyperparam.lr = 0.01
_default_hyperparam.momentum = 0.9


class KFACRule(optimizer.UpdateRule):
    """Update rule of one parameter: eqs. (19) and (20).

    ``w ← w − η G + m (w − w_prev)``, then, for Linear/Convolution2D weights,
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

    def update_core(self, param):
        direction, self.direction = self.direction, None
        if direction is None:
            return
        weight = param.array
        velocity = self.state['v']
        hp = self.hyperparam
        new = weight + (hp.momentum * velocity - hp.lr * direction)
        if self.rescale_norm is not None:
            xp = get_array_module(new)
            new *= self.rescale_norm / (xp.linalg.norm(new) + RESCALE_EPS)
        velocity[...] = new - weight
        weight[...] = new


class KFAC(optimizer.GradientMethod):
    """Kronecker-factored natural gradient with the paper's schemes.

    Set up and driven exactly like :class:`chainer.optimizers.MomentumSGD`::

        optimizer = chainerkfac.optimizers.KFAC(lr=..., momentum=...)
        optimizer.setup(model)
        optimizer.update(model, x, t)   # or through a StandardUpdater

    ``update`` must be given the loss function (K-FAC captures layer inputs
    and output gradients while it runs); the loss must be a mean over the
    mini-batch (as ``F.softmax_cross_entropy``), which fixes the per-sample
    scale of the factors.

    Parameters
    ----------
    lr, momentum : float
        η and m of eq. (19); set them per step from a Chainer extension
        (see :mod:`chainerkfac.extensions` for eqs. 17-18).
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
        Stale Fisher (eqs. 22-23): refresh A (inputs), G (output gradients)
        and the BN Fisher every so many K-FAC steps; a callable of
        ``(iteration, epoch)`` or a preset name (``'eq22'``, ``'eq23'``).
    factor_dtype : {'float32', 'float16'}
        fp16 builds the factors from half-precision GEMMs with fp32
        accumulation; inverses are always fp32 (fp64 for fp64 models).
    factor_decay : float
        Exponential average of refreshed factors (0: the current estimate,
        as in the paper).
    weight_rescale : bool
        Eq. (20) for Linear and Convolution2D weights.
    fisher_diff : bool
        Compute Diff(t) of eq. (21) for every refreshed factor
        (:attr:`fisher_diffs`, and reported as ``kfac/diff/...``).
    verbose : bool
        Print the registration table (layer → block → factor shapes).
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
                 factor_decay: float = 0.0, weight_rescale: bool = True,
                 fisher_diff: bool = False, verbose: bool = True,
                 seed: Optional[int] = None):
        super().__init__()
        self.hyperparam.lr = lr
        self.hyperparam.momentum = momentum
        _check(damping > 0, 'damping', damping, 'must be positive')
        _check(rho_bn > 0, 'rho_bn', rho_bn, 'must be positive')
        _check(bn_fisher in fisher_blocks.BN_FISHER_MODES, 'bn_fisher',
               bn_fisher, 'must be one of {}'.format(
                   fisher_blocks.BN_FISHER_MODES))
        _check(fisher in FISHER_TYPES, 'fisher', fisher,
               'must be one of {}'.format(FISHER_TYPES))
        _check(isinstance(acc_iters, int) and acc_iters >= 1, 'acc_iters',
               acc_iters, 'must be an int >= 1')
        _check(str(numpy.dtype(factor_dtype)) in FACTOR_DTYPES,
               'factor_dtype', factor_dtype,
               'must be one of {}'.format(FACTOR_DTYPES))
        _check(0 <= factor_decay < 1, 'factor_decay', factor_decay,
               'must be in [0, 1)')
        if (damping_target is None) != (damping_warmup_steps is None):
            raise ValueError('damping_target and damping_warmup_steps go '
                             'together (eqs. 15-16): give both or neither')
        self.damping = float(damping)
        self.damping_target = damping_target
        self.damping_warmup_steps = damping_warmup_steps
        self._damping_rate = (
            None if damping_target is None else
            schedules.damping_warmup_rate(damping, damping_target,
                                          damping_warmup_steps))
        self.rho_bn = float(rho_bn)
        self.bn_fisher = bn_fisher
        self.fisher = fisher
        self.acc_iters = acc_iters
        self.refresh_intervals = {
            'A': schedules.resolve_interval(refresh_interval_a),
            'G': schedules.resolve_interval(refresh_interval_g),
            'F': schedules.resolve_interval(refresh_interval_f)}
        self.factor_dtype = numpy.dtype(factor_dtype)
        self.factor_decay = float(factor_decay)
        self.weight_rescale = weight_rescale
        self.fisher_diff = fisher_diff
        self.verbose = verbose
        self._rng = numpy.random.RandomState(seed)
        self.blocks = []
        self.transport = LocalTransport()
        #: K-FAC step at which each factor kind was last refreshed.
        self.last_refresh: Dict[str, int] = {'A': -1, 'G': -1, 'F': -1}
        #: Diff(t) of eq. (21) from the last refresh: {(layer, factor): x}.
        self.fisher_diffs: Dict = {}
        #: Wall time of each stage in the last step (seconds).
        self.stage_times: Dict[str, float] = {}
        #: Synchronise the device before reading stage timers (benchmarks).
        self.synchronize_stage_timers = False
        self._micro = 0
        self._due = frozenset()
        self._started = False
        self._table_printed = False

    # -- set-up ----------------------------------------------------------------
    def create_update_rule(self):
        return KFACRule(self.hyperparam)

    def setup(self, link):
        super().setup(link)
        self.blocks = fisher_blocks.build_blocks(
            link, self.factor_dtype, self.bn_fisher)
        for block in self.blocks:
            if self.weight_rescale and isinstance(
                    block, fisher_blocks.kronecker.KroneckerBlock):
                block.link.W.update_rule.rescale_norm = math.sqrt(
                    2.0 * block.out_size)
        if all(p.array is not None for p in link.params()):
            self._print_table()
        return self

    def registration_table(self) -> str:
        """Layer → block type → factor shapes, one line per layer."""
        rows = [('layer', 'block', 'factors')]
        for block in self.blocks:
            rows.append((block.name, block.kind, block.describe()))
        width = [max(len(r[i]) for r in rows) for i in range(2)]
        lines = ['{:<{}}  {:<{}}  {}'.format(r[0], width[0], r[1], width[1],
                                             r[2]) for r in rows]
        n_kfac = sum(1 for b in self.blocks if b.factor_names)
        lines.append('{} K-FAC layers, {} unpreconditioned'.format(
            n_kfac, len(self.blocks) - n_kfac))
        return '\n'.join(lines)

    def _print_table(self):
        if self.verbose and not self._table_printed and \
                self.transport.rank == 0:
            print('K-FAC registration\n' + self.registration_table(),
                  file=sys.stdout, flush=True)
        self._table_printed = True

    # -- one call of update = one micro-batch ----------------------------------
    def update(self, lossfun=None, *args, **kwds):
        """Forward/backward one micro-batch; every ``acc_iters`` calls, take
        one K-FAC step."""
        if lossfun is None:
            raise TypeError(
                'KFAC.update needs the loss function, e.g. '
                'optimizer.update(model, x, t): K-FAC captures the layer '
                'inputs and output gradients while it runs.')
        if not self._started:
            self.transport.setup(self)
            self._started = True
        if self._micro == 0:
            self.target.cleargrads()
            self._due = self._factors_due()
            self._mark('start')
        self._forward_backward(lossfun, args, kwds)
        self._micro += 1
        if self._micro < self.acc_iters:
            return
        self._micro = 0
        if self.acc_iters > 1:
            for param in self.target.params():
                if param.grad is not None:
                    param.grad /= self.acc_iters
        self._mark('forward_backward')
        self._step()

    def _factors_due(self):
        due = set()
        for kind, interval in self.refresh_intervals.items():
            last = self.last_refresh[kind]
            if last < 0 or self.t - last >= interval(self.t, self.epoch):
                due.add(kind)
        return frozenset(due)

    def _forward_backward(self, lossfun, args, kwds):
        backward_due = self._due & {'G', 'F'}
        monte_carlo = self.fisher == 'mc' and bool(backward_due)
        hook = capture.FactorCapture(
            self.blocks, forward='A' in self._due,
            backward=() if monte_carlo else backward_due,
            record_logits=monte_carlo)
        with hook:
            loss = lossfun(*args, **kwds)
            # Backward of some functions calls forward of others: capture A
            # only from the loss's own forward pass.
            hook.forward = False
            if not monte_carlo:
                loss.backward()
        if monte_carlo:
            self._sampled_backward(hook.logits, backward_due)
            loss.backward()
        del loss
        if not self._table_printed:
            self._print_table()

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
        sampled_hook = capture.FactorCapture(self.blocks, forward=False,
                                             backward=backward_due)
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
        self.reallocate_cleared_grads()
        self.call_hooks('pre')
        blocks, transport, due = self.blocks, self.transport, self._due
        grads = {b: [p.grad for p in b.params] for b in blocks}
        local = {b: b.local_factors([n for n in b.factor_names if n in due],
                                    self.acc_iters) for b in blocks}
        self._mark('factors')
        grads, factors = transport.reduce_scatter(blocks, grads, local)
        self._mark('reduce_scatter')

        retries = 0
        self.fisher_diffs = {}
        for block in blocks:
            if not transport.owns(block) or not factors.get(block):
                continue
            damping = self.damping * block.damping_scale(self.rho_bn)
            block.set_factors(factors[block], self.factor_decay,
                              self.fisher_diff)
            retries += sum(block.update_inverses(list(factors[block]),
                                                 damping).values())
            for name in factors[block]:
                if name in block.diff:
                    self.fisher_diffs[(block.name, name)] = block.diff[name]
        self._mark('inverse')

        directions = {}
        for block in blocks:
            if transport.owns(block):
                damping = self.damping * block.damping_scale(self.rho_bn)
                directions[block] = block.precondition(grads[block], damping)
        self._mark('precondition')
        directions = transport.all_gather(blocks, directions)
        self._mark('all_gather')

        finite = transport.agree(_all_finite(
            [d for ds in directions.values() for d in ds]))
        self.t += 1
        if finite:
            for block in blocks:
                for param, direction in zip(block.params, directions[block]):
                    param.update_rule.direction = direction
                    param.update()
        for kind in due:
            self.last_refresh[kind] = self.t - 1
        self._report(due, retries, skipped=not finite)
        if self._damping_rate is not None:
            rate = self._damping_rate
            self.damping = (1 - rate) * self.damping + \
                rate * self.damping_target
        self._mark('update')
        self.call_hooks('post')

    def _report(self, due, retries, skipped):
        observation = {
            'kfac/damping': self.damping,
            'kfac/refresh_A': float('A' in due),
            'kfac/refresh_G': float('G' in due),
            'kfac/refresh_F': float('F' in due),
            'kfac/inverse_retries': float(retries),
            'kfac/skipped_step': float(skipped),
        }
        for (layer, factor), value in self.fisher_diffs.items():
            observation['kfac/diff/{}{}'.format(factor, layer)] = value
        chainer.reporter.report(observation)
        if skipped:
            print('K-FAC step {}: non-finite preconditioned gradient, update '
                  'skipped (weights unchanged)'.format(self.t),
                  file=sys.stderr, flush=True)

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
        the refresh bookkeeping, and every block's factors and inverses (on
        a process of a multi-process run, the blocks it owns)."""
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
        for kind in self.last_refresh:
            self.last_refresh[kind] = int(serializer(
                'last_refresh_' + kind, self.last_refresh[kind]))
        # The MC Fisher's label sampler continues where it stopped.
        name, keys, position, has_gauss, gauss = self._rng.get_state()
        keys = serializer('mc_rng_keys', keys)
        position = int(serializer('mc_rng_position', position))
        self._rng.set_state((name, numpy.asarray(keys, numpy.uint32),
                             position, has_gauss, gauss))
        state = serializer['kfac']
        for block in self.blocks:
            block.serialize(state[block.name.strip('/') or '_root'])


def _check(ok, name, value, why):
    if not ok:
        raise ValueError('KFAC: {}={!r} {}'.format(name, value, why))


def _all_finite(arrays):
    if not arrays:
        return True
    xp = get_array_module(arrays[0])
    flags = [xp.isfinite(a).all() for a in arrays]
    return bool(xp.stack(flags).all()) if xp is not numpy else all(flags)


def _synchronize(target):
    for param in target.params():
        if param.array is not None:
            xp = get_array_module(param.array)
            if xp is not numpy:
                xp.cuda.Device().synchronize()
            return

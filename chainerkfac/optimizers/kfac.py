"""K-FAC for Chainer (Osawa et al., CVPR 2019), single- or multi-process.

One K-FAC step, top to bottom (:meth:`KFAC._step`, Algorithm 1):

1-2. the forward and backward passes of the loss — run by the user's loop
     or by ``update(lossfun, ...)`` — while the capture estimates the
     factors due this step (:mod:`chainerkfac.estimator`);
3.   the transport sums gradients and due factors over processes and leaves
     each block's on its owner (:mod:`chainerkfac.transport`);
4.   owners refresh their blocks' damped inverses
     (:mod:`chainerkfac.fisher_blocks`, :mod:`chainerkfac.linalg`);
5.   owners precondition their blocks' gradients, ``(F + γI)⁻¹ ∇E``,
     and scale them so that the step's length in the curvature's metric
     stays within ``kl_clip`` (:mod:`chainerkfac.step_bound`);
6.   the transport gives every process all preconditioned gradients;
     then, unless a direction is not finite (:mod:`chainerkfac.step_guard`),
     every process applies eqs. (19)-(20)
     (:mod:`chainerkfac.optimizers.update_rule`,
     :mod:`chainerkfac.optimizers.rescale`) — or, with ``shard_update``,
     each owner applies them to its blocks and the transport gives every
     process the new weights (:mod:`chainerkfac.sharding`).
"""
import logging
import warnings
from typing import Dict, List, Optional, Tuple

import numpy

import chainer
from chainer import optimizer

from chainerkfac import _logging
from chainerkfac.accumulation import GradientAccumulator
from chainerkfac import dtypes
from chainerkfac import equations
from chainerkfac import fisher_blocks
from chainerkfac import linalg
from chainerkfac import low_rank
from chainerkfac import process_group
from chainerkfac import sharding
from chainerkfac.estimator import CurvatureEstimator
from chainerkfac.low_rank import Exchange
from chainerkfac.fisher_blocks import batch_norm
from chainerkfac.fisher_blocks import kronecker
from chainerkfac.optimizers import hooks
from chainerkfac.optimizers import options
from chainerkfac.optimizers import loss_scaling
from chainerkfac.optimizers import registration
from chainerkfac.optimizers import state
from chainerkfac.optimizers.rescale import WeightRescale
from chainerkfac.optimizers.update_rule import RESCALE_EPS  # NOQA
from chainerkfac.optimizers import update_rule
from chainerkfac.optimizers.update_rule import KFACRule
from chainerkfac.stage_timer import StageTimer
from chainerkfac.step_bound import StepBound
from chainerkfac.step_guard import StepGuard
from chainerkfac.transport import LocalTransport

logger = logging.getLogger(__name__)

_default_lr = 0.01
_default_momentum = 0.9
#: The defaults' stale Fisher: every factor refreshed (and inverted) every
#: so many K-FAC steps, with the step bounded by ``kl_clip``
#: (``benchmarks/stock_models.py``, docs/kfac.md).
DEFAULT_REFRESH_INTERVAL = 20
DEFAULT_KL_CLIP = 1e-4


class KFAC(optimizer.GradientMethod):
    """Kronecker-factored natural gradient with the paper's schemes.

    Set up and driven like :class:`chainer.optimizers.MomentumSGD`, in any
    training loop::

        optimizer = chainerkfac.optimizers.KFAC(lr=..., momentum=...)
        optimizer.setup(model)
        optimizer.update(lossfun, x, t)     # a StandardUpdater does this
        # or
        model.cleargrads(); loss.backward(); optimizer.update()

    From ``setup`` on, K-FAC sees every backward pass through the model's
    links (:mod:`chainerkfac.capture`): a step's factors are estimated from
    exactly the backward passes that make its gradient — those since the
    links' gradients were last cleared — whoever runs them. A link called
    several times contributes every call (A summed over calls, G averaged:
    :mod:`chainerkfac.fisher_blocks.base`).

    Which link gets which Fisher block is decided by the block registry
    (:func:`chainerkfac.register_block`): Linear and Convolution2D get
    Kronecker-factored blocks, BatchNormalization a full or diagonal Fisher
    of (γ, β); every other parameter (unknown link types, grouped
    convolutions, BatchRenormalization, BN without γ or β, ``skip_layers``)
    gets the plain gradient with the same update rule (eq. 19). The
    registration table (logged at the first update) says what each link
    got and why.

    A link not reached by a backward pass in a step contributes nothing to
    that step: a factor due then keeps its previous value and inverse and
    stays due (its staleness does not advance; a warning names the link);
    parameters without a gradient on any process are not updated that step.
    The reporter counts, every step, the blocks preconditioned
    (``kfac/preconditioned_blocks``) and those without curvature
    (``kfac/plain_blocks``: on the plain gradient where they have one,
    blocks of links no backward pass reached included), and the factors
    held low rank (``kfac/low_rank_factors``).

    The defaults are chosen for the one-line swap in a stock script: the
    factors and their inverses are refreshed every
    :data:`DEFAULT_REFRESH_INTERVAL` steps (stale in between, eqs. 22-23's
    scheme at a fixed interval), the step is bounded in the curvature's
    metric (``kl_clip``, which a stale Fisher needs: without it a stale
    factor at the default damping lets the step grow by orders of
    magnitude), and factors of few per-sample vectors go low rank. The
    ImageNet configs set the paper's update instead (intervals 1 or the
    eq. 22 / eq. 23 presets, no bound). ``benchmarks/stock_models.py``
    measures the defaults' cost and accuracy (docs/kfac.md).

    Chainer's optimizer hooks keep what they bound for SGD
    (:mod:`chainerkfac.optimizers.hooks`): ``WeightDecay``, ``Lasso`` and
    other ``'pre'`` hooks act on the gradient before the preconditioning;
    ``GradientClipping`` and ``GradientHardClipping`` on the
    preconditioned direction (after the bounded step), so that the update
    is ``lr`` times a clipped vector, as SGD's is.

    Parameters
    ----------
    lr, momentum : float, default 0.01 and 0.9
        η (a finite number >= 0) and m (in [0, 1)) of eq. (19); set them
        per step from a Chainer extension (:mod:`chainerkfac.training`:
        ``PolynomialLRDecay`` for eqs. 17-18).
    damping : float
        γ(0); the damping of eqs. (13)-(14). The default 1e-2, with the
        stale intervals and the bounded step of the defaults, is within
        seed noise of MomentumSGD on the digits nets
        (``benchmarks/stock_models.py``); without the bound, stale factors
        at 1e-2 make small nets diverge (a stale Fisher does not hold the
        new gradient). The ImageNet configs set the paper's schedule.
    damping_target, damping_warmup_steps : float, int, optional
        γ_target and t_warmup of eqs. (15)-(16); without them γ stays fixed.
    rho_bn : float
        BatchNormalization layers use ``ρ_BN · γ`` (section 4.3).
    bn_fisher : {'full', 'diag'}
        Full 2C×2C Fisher of (γ, β) ("no approx") or its diagonal (5.4).
    fisher : {'emp', 'mc', 'exact'}
        The output-gradient factors from the empirical Fisher with the true
        labels (the paper); from ``mc_samples`` labels per sample drawn from
        the model's softmax (Monte-Carlo "true" Fisher); or from the loss
        Hessian's exact root, one extra backward pass per class (KFLR's G,
        Botev et al. 2017). ``'mc'`` and ``'exact'`` need the loss function
        (``update(lossfun, ...)``) and softmax-type losses on the model's
        outputs (several, as heads or time steps, each row weighted by its
        weight in the loss: the loss's generalised Gauss-Newton matrix;
        docs/kfac.md).
    mc_samples : int
        Label draws per micro-batch for ``fisher='mc'``.
    acc_iters : int
        Micro-batches accumulated (gradients and factors) per K-FAC step:
        one step every ``acc_iters`` calls of :meth:`update`.
    refresh_interval_a, refresh_interval_g, refresh_interval_f : int, str or callable
        Stale Fisher (eqs. 22-23): refresh the factors estimated from layer
        inputs (A), from output gradients (G) and from parameter gradients
        (the BN Fisher F) every so many K-FAC steps; a callable of
        ``(iteration, epoch)`` or a preset name (``'eq22'``, ``'eq23'``).
        Default :data:`DEFAULT_REFRESH_INTERVAL` (20) for all three: the
        paper's presets refresh every step for the first 5 (eq. 22) or 13
        (eq. 23) epochs, which saves nothing in the runs of a few epochs
        that stock scripts make. 1: every step (the paper's configs
        before their stale epochs).
    factor_dtype : {'float32', 'float16', 'tf32'}
        fp16 builds the factors from half-precision GEMMs with fp32
        accumulation; ``'tf32'`` keeps float32 factors whose products run
        on TF32 Tensor Cores on the GPU (operands rounded to a 10-bit
        mantissa, fp32 sums; the CPU rounds the same operands, exactly
        multiplied); inverses are always fp32 (fp64 for fp64 models, whose
        products stay fp64).
    precondition_dtype : {'float32', 'tf32'}
        ``'tf32'``: stage 5's dense products ``G⁻¹ ∇W A⁻¹`` of float32
        Kronecker blocks on TF32 Tensor Cores on the GPU (operands rounded
        to a 10-bit mantissa, fp32 sums; the CPU rounds the same operands,
        exactly multiplied), 1.6e11 flops per ResNet-50 step in fp32 on
        CUDA cores otherwise. The result is the exact product of operands
        each within 2⁻¹¹ (relative, per element) of the exact ones; on
        ResNet-50's real factors the preconditioned gradient moves by a
        median 6.3e-4 (the final FC layer, κ_Aκ_G ≈ 3e5: 0.22), where the
        exact factors of another mini-batch move it by 0.63 (FC: 970)
        (docs/gpu.md, "Lower precision in stage 5"). float64 models,
        low-rank and BatchNormalization blocks, and blocks with a factor
        kept diagonal (``max_factor_dim``), are unchanged.
    factor_decay : float
        Exponential average of refreshed factors (0: the current estimate,
        as in the paper).
    weight_rescale : {'auto', True, False}
        Eq. (20), rescaling a Linear or Convolution2D weight to the norm
        ``√(2·d_out)`` after every step. ``'auto'`` (default): only weights
        whose layer is scale invariant — its output feeds a
        BatchNormalization (:mod:`chainerkfac.scale_invariance`), found from
        the graph of the first step — where rescaling leaves the network's
        function unchanged. On ResNet-50 that is every convolution but not
        the final FC. ``True``: every Linear and Convolution2D weight, as
        the paper does (its FC included; the ImageNet configs use this).
        ``False``: none.
    skip_layers : str, re.Pattern, type, a sequence of them, or None
        Links to leave unpreconditioned (plain gradient, same eq. 19 rule):
        link names (``'/predictor/fc'``, the leading ``/`` optional),
        regular expressions matched against the whole name, or link
        classes. Default ``()``; None: none either.
    loss_reduction : {'mean', 'sum'}
        How the loss reduces over the mini-batch. K-FAC's per-sample scale
        of the factors assumes a mean (as ``F.softmax_cross_entropy``);
        with ``'mean'`` a loss whose last operation is ``F.sum`` is refused
        with an error. With ``'sum'`` the factors are rescaled and the
        gradient divided by the number of samples, so the step equals that
        of the mean loss.
    max_factor_dim : int or None
        The cost guard: a factor of dimension n > ``max_factor_dim``
        (inverting it costs n³, storing it n²) is kept as its diagonal —
        VGG16's fc6 input factor (n = 25089), a wide BatchNormalization's
        full Fisher (2C) — and the registration table says so. The default
        1024 keeps Chainer's MNIST MLP full (785 and 1001 inputs) and turns
        the 10 factors of a CIFAR VGG above it (3×3 convolutions' A up to
        4608) diagonal: on a 2-core CPU its step costs 1.03× MomentumSGD's
        at the defaults (2026-11-26; 1.23× with every step refreshed and
        dense factors, 5.49× so and without a limit, 2026-11-23:
        ``benchmarks/stock_models.py``, docs/kfac.md). ``None``:
        no limit (the ImageNet configs, as the paper: ResNet-50's largest
        factor is 4608²).
    inverse_method : {'cholesky', 'newton_schulz', 'cholesky_solve'}
        How stage 4 inverts the damped factors: Cholesky (LAPACK on the
        CPU, cuSOLVER on CUDA streams on the GPU); ``'cholesky_solve'``
        (the CPU only): the Cholesky factor alone, stage 5 solving with it
        (two triangular solves per side) instead of multiplying by a
        formed inverse — a refresh costs n³/3 flops instead of n³, stage 5
        the same flops; or the Newton–Schulz
        iteration, GEMMs batched over the factors of equal size up to
        n = 1024, with Cholesky for the larger factors and for any the
        iteration does not settle (:mod:`chainerkfac.newton_schulz`). The
        iteration costs ≈ 4n³ flops per step against Cholesky's ≈ n³ in
        all: an option for GPUs, where many small factors leave cuSOLVER
        bound by launches; slower on a CPU.
    low_rank : bool
        Exact low-rank factors (:mod:`chainerkfac.low_rank`): a Kronecker
        factor (or a full BatchNormalization Fisher) estimated in a step
        from k per-sample vectors (batch × locations × calls ×
        micro-batches × processes) with k well below
        its dimension d is kept as those vectors, inverted by Woodbury
        (O(d k²) instead of O(d³)) and applied in O(d k) per gradient row
        instead of O(d²), wherever a cost model (compute and, across
        processes, the bytes sent) says that is cheaper; else the dense
        factor. The steps equal the dense ones up to rounding. Not with
        fp16 factors or ``fisher_diff`` (dense there).
    kl_clip : float or None
        The bounded step (kfac-pytorch's ``kl_clip``): every preconditioned
        direction is multiplied by ``ν = min(1, √(kl_clip / m))``,
        ``m = lr² Σ_l ⟨d_l, ∇E_l⟩`` the squared length of the step in the
        metric of the damped curvature that preconditioned it, summed over
        the blocks with curvature (∇E: the gradient the block
        preconditioned, eq. 13's γ(w − μ) included; parameters on the plain
        gradient are neither counted nor scaled). ν and m are reported as
        ``kfac/step_scale`` and ``kfac/step_metric``
        (:mod:`chainerkfac.step_bound`). Default :data:`DEFAULT_KL_CLIP`
        (1e-4; on the digits MLP at lr 0.01 it acts at every step of the
        first epoch, fresh or stale, ν between 0.16 and 0.25: the step is
        then the one of squared metric length 1e-4, and lr matters only
        where the step is shorter; a model with dropout before its layers
        may be held to ν near 0.01, and K-FAC warns once where ν stays
        under 5 % for 50 steps: raise ``kl_clip`` there); ``None``: no
        bound (the paper).
    conv_a_strategy : {'unfolded', 'shifted'}, optional
        Force how convolutions form A where it applies (benchmarks); by
        default the cheaper one by a cost model on the CPU, and on the GPU
        the unfolded one, or the faster by timing under
        ``chainer.config.autotune`` (:func:`chainerkfac.fisher_blocks.
        patches.patch_gram`).
    fisher_diff : bool
        Compute Diff(t) of eq. (21) for every refreshed factor
        (:attr:`fisher_diffs`, and reported as ``kfac/diff/...``).
    verbose : bool
        Log the registration table (layer → block → factor shapes, eq. 20)
        at the first step (on stdout unless logging is configured).
    process_local : bool
        Keep process-local factors in a process group of several processes
        (mpi4py's world) on purpose; without it, K-FAC there without a
        communicator is refused at the first update
        (:mod:`chainerkfac.process_group`).
    seed : int, optional
        Seed of the label sampler of the MC Fisher
        (:attr:`label_sampler`).
    shard_update : bool
        Weight-update sharding (:mod:`chainerkfac.sharding`): in a
        multi-process run, each block's owner applies eqs. (19)-(20) to its
        parameters and keeps their velocities, and the new weights travel
        in the all-gather instead of the preconditioned gradients (same
        bytes for a float32 model on the default wire: weights travel at
        the parameters' dtype). The steps equal those without it; each
        process's snapshot holds the velocities it owns. One process: the
        same steps, and the same refusals (a gradient hook that needs the
        whole gradient, such as ``GradientClipping``, is refused at the
        first update as it would be on many processes).
    """

    lr = optimizer.HyperparameterProxy('lr')
    momentum = optimizer.HyperparameterProxy('momentum')

    def __init__(self, lr=_default_lr, momentum=_default_momentum,
                 damping: float = 1e-2,
                 damping_target: Optional[float] = None,
                 damping_warmup_steps: Optional[int] = None,
                 rho_bn: float = 1.0, bn_fisher: str = 'full',
                 fisher: str = 'emp', mc_samples: int = 1,
                 acc_iters: int = 1,
                 refresh_interval_a=DEFAULT_REFRESH_INTERVAL,
                 refresh_interval_g=DEFAULT_REFRESH_INTERVAL,
                 refresh_interval_f=DEFAULT_REFRESH_INTERVAL,
                 factor_dtype: str = 'float32',
                 precondition_dtype: str = 'float32',
                 factor_decay: float = 0.0,
                 weight_rescale='auto', skip_layers=(),
                 loss_reduction: str = 'mean',
                 max_factor_dim: Optional[int] = 1024,
                 inverse_method: str = 'cholesky',
                 low_rank: bool = True,
                 kl_clip: Optional[float] = DEFAULT_KL_CLIP,
                 conv_a_strategy: Optional[str] = None,
                 fisher_diff: bool = False, verbose: bool = True,
                 seed: Optional[int] = None, process_local: bool = False,
                 shard_update: bool = False):
        super().__init__()
        options.check_options(
            lr=lr, momentum=momentum, damping=damping,
            damping_target=damping_target,
            damping_warmup_steps=damping_warmup_steps, rho_bn=rho_bn,
            bn_fisher=bn_fisher, fisher=fisher, mc_samples=mc_samples,
            acc_iters=acc_iters, refresh_interval_a=refresh_interval_a,
            refresh_interval_g=refresh_interval_g,
            refresh_interval_f=refresh_interval_f, factor_dtype=factor_dtype,
            precondition_dtype=precondition_dtype,
            factor_decay=factor_decay, weight_rescale=weight_rescale,
            loss_reduction=loss_reduction, max_factor_dim=max_factor_dim,
            inverse_method=inverse_method, low_rank=low_rank,
            kl_clip=kl_clip, conv_a_strategy=conv_a_strategy,
            shard_update=shard_update, process_local=process_local,
            verbose=verbose, fisher_diff=fisher_diff, seed=seed)
        self.hyperparam.lr = lr
        self.hyperparam.momentum = momentum
        self.damping = float(damping)
        self.damping_target = damping_target
        self.damping_warmup_steps = damping_warmup_steps
        self._damping_rate = (
            None if damping_target is None else
            equations.damping_warmup_rate(damping, damping_target,
                                          damping_warmup_steps))
        self.rho_bn = float(rho_bn)
        self.bn_fisher = bn_fisher
        self.acc_iters = acc_iters
        self.refresh_intervals = {
            'A': equations.resolve_interval(refresh_interval_a,
                                            'refresh_interval_a'),
            'G': equations.resolve_interval(refresh_interval_g,
                                            'refresh_interval_g'),
            'F': equations.resolve_interval(refresh_interval_f,
                                            'refresh_interval_f')}
        self.factor_dtype = (dtypes.TF32 if dtypes.is_tf32(factor_dtype)
                             else numpy.dtype(factor_dtype))
        # a name (numpy.float32 taken as factor_dtype takes it)
        self.precondition_dtype = (dtypes.TF32 if dtypes.is_tf32(
            precondition_dtype) else str(numpy.dtype(precondition_dtype)))
        self.factor_decay = float(factor_decay)
        if isinstance(weight_rescale, numpy.bool_):
            weight_rescale = bool(weight_rescale)
        self.weight_rescale = weight_rescale
        # None: skip nothing (it raised "'NoneType' object is not iterable")
        self.skip_layers = () if skip_layers is None else skip_layers
        fisher_blocks.registry.skip_matchers(self.skip_layers)  # the types
        self.max_factor_dim = max_factor_dim
        self.inverse_method = inverse_method
        self.low_rank = bool(low_rank)
        #: ν of the bounded step (None without ``kl_clip``).
        self.step_bound = None if kl_clip is None else StepBound(kl_clip)
        #: The sum of ν's terms over a second group of processes holding
        #: other blocks of the model (layer-parallel training:
        #: :func:`chainerkfac.layer_parallel.setup_kfac` sets it), given
        #: to every bound (:attr:`StepBound.sum_across`); None: none.
        self.bound_sum_across = None
        #: ``(fisher, message)``: the only ``fisher`` a later assignment
        #: may set, and the refusal's message (formatted with the value)
        #: — layer-parallel training sets it; None: any.
        self.fisher_only = None
        self.conv_a_strategy = conv_a_strategy
        self.fisher_diff = bool(fisher_diff)
        self.verbose = bool(verbose)
        self.process_local = bool(process_local)
        self.shard_update = bool(shard_update)
        self.blocks: List = []
        #: Stages 1-2: capture and factor estimation.
        self.estimator = CurvatureEstimator(fisher, mc_samples,
                                            loss_reduction, seed)
        #: Eq. (20): which weights are rescaled.
        self.rescale = WeightRescale(self.weight_rescale)
        #: The skipped-step guard (:attr:`StepGuard.skipped` after a step).
        self.guard = StepGuard()
        #: γ as a device scalar for stage 5, or None (the host float):
        #: set by a CUDA-graph replay (:mod:`chainerkfac.graphs.kfac_step`)
        #: so that the damping schedule needs no new capture.
        self.device_damping = None
        #: η as a device scalar for the bounded step, or None (likewise).
        self.device_lr = None
        #: A refreshed inverse goes into its predecessor's arrays where it
        #: fits them (and the stacked batches' slots likewise), so that a
        #: replayed stale step reads it: set by the same CUDA-graph replay,
        #: which then keeps its graph through a refresh step.
        self.refill_inverses = False
        #: Stages 3 and 6 (see :mod:`chainerkfac.transport`).
        self.transport = LocalTransport()
        #: The gradients arrive averaged over processes already
        #: (ChainerMN's own multi-node optimizer wraps this one; set by
        #: :func:`chainerkfac.process_group.join`).
        self.gradients_reduced = False
        #: Diff(t) of eq. (21) from the last refresh: {(layer, factor): x}.
        self.fisher_diffs: Dict = {}
        #: What the last step took: its damping (eq. 16 moves
        #: :attr:`damping` on at the step's end) and refresh intervals
        #: (``'A'``, ``'G'``, ``'F'``; eqs. 22-23 are read at the step's
        #: start). Empty before the first step.
        self.last_step: Dict[str, float] = {}
        self._step_intervals: Dict[str, float] = {}
        self.timer = StageTimer()
        self._micro = 0
        #: The gradients of a step's micro-batches, held between them.
        self.accumulator = GradientAccumulator()
        self._started = False
        self._checkpoint_due = False
        #: A step loaded from inside an accumulation, from the load to
        #: :func:`chainerkfac.optimizers.state.resume_accumulation`.
        self._restored_accumulation = None
        self._table_shown = False
        #: Per block: frozen when the coming step's factors were decided
        #: (:meth:`_factors_due`); a snapshot keeps it, so that a resumed
        #: run decides its first step as the uninterrupted one did (a link
        #: unfrozen between the snapshot and the next step stays not due
        #: for that step in both).
        self.frozen_when_decided: Dict[str, bool] = {}
        self._frozen_restored: Optional[Dict[str, bool]] = None
        self._warned_uncaptured: set = set()
        self._warned_unfrozen: set = set()
        self._warned_hooks: set = set()    # _warn_whole_model_hooks
        self._unreached: frozenset = frozenset()    # refresh_due()
        #: The coming step's micro-batches over all processes, where they
        #: differ between processes (:meth:`flush_accumulation`); None:
        #: each process's own, the same everywhere. Taken by the step.
        self.global_micro_batches: Optional[int] = None
        self._inverse_stacks: Dict = {}
        self._step_dampings: Dict = {}
        #: Stage 3's agreement on the form of low-rank factors.
        self._exchange = Exchange()

    # -- set-up ---------------------------------------------------------------
    def create_update_rule(self):
        return KFACRule(self.hyperparam)

    def setup(self, link):
        super().setup(link)
        self.blocks = fisher_blocks.build_blocks(
            link, fisher_blocks.BlockOptions(
                self.factor_dtype, self.bn_fisher, self.max_factor_dim,
                self.conv_a_strategy,
                low_rank=self.low_rank and not self.fisher_diff,
                precondition_tf32=self.precondition_dtype == 'tf32'),
            self.skip_layers)
        for text, match in fisher_blocks.registry.skip_matchers(
                self.skip_layers):
            if not any(match(n, l) for n, l in link.namedlinks()):
                warnings.warn('KFAC: skip_layers entry {!r} matches no link '
                              'of the model'.format(text))
        self.rescale.setup(self.blocks)
        self.estimator.setup(self.blocks)
        self.guard.checkpoint(link)
        self._begin_step()
        if process_group.world_size() > 1 and not self.process_local:
            # one failing process ends the job from the first step on
            # (ChainerMN's wrapper joins K-FAC only at its second update,
            # its first broadcasts: a bad first batch on one rank hung)
            from chainerkfac.communicators import install_except_hook
            install_except_hook()
        return self

    @property
    def started(self) -> bool:
        """Whether the first step has begun (the transport is set up)."""
        return self._started

    @property
    def label_sampler(self):
        """The MC Fisher's label sampler
        (:class:`chainerkfac.estimator.LabelSampler`)."""
        return self.estimator.label_sampler

    @property
    def pending_micro_batches(self) -> int:
        """Micro-batches accumulated towards the coming step."""
        return self._micro

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last step was skipped (a non-finite direction):
        weights and running statistics stayed as they were."""
        return self.guard.skipped

    @property
    def stage_times(self) -> Dict[str, float]:
        """Wall time of each stage in the last step (seconds)."""
        return self.timer.times

    @property
    def synchronize_stage_timers(self) -> bool:
        """Synchronise the device before reading stage timers
        (benchmarks)."""
        return self.timer.synchronize

    @synchronize_stage_timers.setter
    def synchronize_stage_timers(self, value: bool) -> None:
        self.timer.synchronize = bool(value)

    def rescaled_params(self) -> List[str]:
        """Names of the parameters eq. (20) rescales (decided at the first
        step for ``weight_rescale='auto'``)."""
        return [name for name, param in self.target.namedparams()
                if param.update_rule is not None and
                getattr(param.update_rule, 'rescale_norm', None) is not None]

    def registration_table(self) -> str:
        """Layer → block → factor shapes → eq. (20) → note, one line per
        link with parameters."""
        return registration.registration_table(self.blocks, self.rescale)

    def config_fingerprint(self) -> Dict[str, str]:
        """What must be equal on every process (see
        :func:`chainerkfac.optimizers.registration.config_fingerprint`)."""
        return registration.config_fingerprint(self)

    def _start(self) -> bool:
        """Set up the transport and the blocks' ownership (first step).
        Returns whether the transport replaced this process's parameters."""
        if self.inverse_method == 'cholesky_solve' and not isinstance(
                self._like(), (numpy.ndarray, type(None))):
            raise ValueError(
                "KFAC(inverse_method='cholesky_solve') runs on the CPU only "
                "(the model's parameters are on {}); on a GPU use "
                "'cholesky' or 'newton_schulz'".format(
                    chainer.backend.get_device_from_array(self._like())))
        changed = self.transport.setup(self)
        self._started = True
        for block in self.blocks:
            block.processes = self.transport.size
        state.reconcile(self)
        if self.shard_update:
            self._drop_unowned_state()
        if not self.estimator.capturing:
            # Factors no owner holds became due: capture them this step.
            self._begin_step()
        return changed

    def new_epoch(self, auto=False):
        super().new_epoch(auto)
        # The refresh intervals are functions of the epoch: decide again
        # what is due, unless this step's capture has begun.
        if self._micro == 0 and not self.estimator.capturing:
            self._begin_step()

    # -- options held by the parts that act on them ---------------------------
    # One value each: set on the optimizer (a trainer extension shifting
    # it, a user's assignment) it acts from the next step, where a copy
    # taken at construction went on acting unchanged (kl_clip), or two
    # copies disagreed (loss_reduction: the gradients' scale and the
    # factors').
    @property
    def kl_clip(self) -> Optional[float]:
        """The bounded step's ``kl_clip`` (None: no bound), held by
        :attr:`step_bound`; settable between steps."""
        return None if self.step_bound is None else self.step_bound.kl_clip

    @kl_clip.setter
    def kl_clip(self, value) -> None:
        options.check_option('kl_clip', value)
        if value is None:
            self.step_bound = None
        elif self.step_bound is not None:
            self.step_bound.kl_clip = float(value)
        else:
            self.step_bound = StepBound(value)
            self.step_bound.sum_across = self.bound_sum_across

    @property
    def damping(self) -> float:
        """γ (eqs. 13-16); settable between steps (a trainer extension
        shifting it), checked as the constructor checks it (a NaN made
        every later step skip)."""
        return self._damping

    @damping.setter
    def damping(self, value) -> None:
        options.check_option('damping', value)
        self._damping = float(value)

    @property
    def acc_iters(self) -> int:
        """Micro-batches a step; settable (a batch-size schedule, also by
        Chainer's shift extensions, whose floats of integer value are
        taken), from the coming step on; checked (0 was taken)."""
        return self._acc_iters

    @acc_iters.setter
    def acc_iters(self, value) -> None:
        value = options.integral(value)     # a shift extension's 2.0
        options.check_option('acc_iters', value)
        self._acc_iters = value

    @property
    def fisher(self) -> str:
        """Which Fisher the factors estimate (held by :attr:`estimator`)."""
        return self.estimator.fisher

    @fisher.setter
    def fisher(self, value) -> None:
        options.check_option('fisher', value)
        only = self.fisher_only
        if only is not None and value != only[0]:
            raise ValueError(only[1].format(value))
        self.estimator.fisher = value

    @property
    def mc_samples(self) -> int:
        """Label draws per micro-batch for ``fisher='mc'`` (held by
        :attr:`estimator`)."""
        return self.estimator.mc_samples

    @mc_samples.setter
    def mc_samples(self, value) -> None:
        options.check_option('mc_samples', value)
        self.estimator.mc_samples = value

    @property
    def loss_reduction(self) -> str:
        """``'mean'`` or ``'sum'``: how the loss reduces over samples (held
        by :attr:`estimator`, which scales the factors by it, as the
        optimizer scales the gradients)."""
        return self.estimator.loss_reduction

    @loss_reduction.setter
    def loss_reduction(self, value) -> None:
        options.check_option('loss_reduction', value)
        self.estimator.loss_reduction = value

    # -- one call of update = one micro-batch ---------------------------------
    def update(self, lossfun=None, *args, **kwds):
        """Close one micro-batch; every ``acc_iters`` calls, take one K-FAC
        step.

        With ``lossfun``, run it on ``args`` / ``kwds`` and backpropagate
        (the gradients are cleared first, as Chainer's optimizers do);
        without, use the gradients and the backward passes since the last
        call (``loss.backward(); optimizer.update()``).
        """
        if lossfun is None:
            self._check_manual_update()
        self.accumulator.forget_load()
        first = not self._started
        if first:
            process_group.join(self, gradients_reduced=lossfun is None)
        lazy = first and lossfun is not None and bool(
            self.transport.all_sum(numpy.array(
                [any(p.array is None for p in self.target.params())],
                numpy.int64))[0])
        changed = self._start() if first and not lazy else False
        if self._started:
            self._decide_again_if_unfrozen(lossfun is not None and
                                           self._micro == 0)
        if self._micro == 0:
            self.timer.start()
        if lossfun is not None and (self._micro == 0 or
                                    self._checkpoint_due):
            # the running statistics as the step's forward finds them
            # (not as the last step left them: the model may have been
            # loaded or copied into since; loaded inside a step, as the
            # resumed micro-batch finds them)
            self.guard.checkpoint(self.target)
            self._checkpoint_due = False
        if lossfun is not None:
            self.target.cleargrads()
            self._run_loss(lossfun, args, kwds)
            if lazy and self._start():
                # The first forward ran on the processes' own initial
                # values of lazily initialised links: redo it with rank 0's.
                logger.warning(
                    'K-FAC multi-node: lazily initialised parameters '
                    "differed between processes; the first micro-batch was "
                    "recomputed with rank 0's values")
                self._redo(lossfun, args, kwds)
        elif changed:
            # Computed with the processes' own initial values: dropped on
            # every process (``changed`` is agreed), as ChainerMN's
            # multi-node optimizer drops its first update.
            logger.warning(
                'K-FAC multi-node: parameters differed between processes; '
                "rank 0's were broadcast, and the first micro-batch, "
                "computed before, is dropped on every process")
            self.guard.restore()
            self.target.cleargrads()
            self.estimator.discard_micro_batch()
            return
        self.estimator.end_micro_batch()
        self._micro += 1
        if self._micro < self.acc_iters:
            self.accumulator.hold(self.target)
            return
        self.finish_step()

    def run_passes(self, lossfun, *args) -> None:
        """The forward and backward passes of ``update(lossfun, *args)``
        (with the capture of the factors due), for a started optimizer at a
        step of one micro-batch whose guard needs no checkpoint: what
        :meth:`update` runs before :meth:`finish_step`, with the timer
        started by the caller. A CUDA graph replays it for the refresh
        steps (:mod:`chainerkfac.graphs.kfac_step`)."""
        if not self._started or self._micro or self.acc_iters != 1 or \
                self._checkpoint_due:
            raise RuntimeError(
                'run_passes: for a started K-FAC at a step of one '
                'micro-batch (started {}, micro-batch {}, acc_iters {}, '
                'checkpoint due {}); call update()'.format(
                    self._started, self._micro, self.acc_iters,
                    self._checkpoint_due))
        # the running statistics as the step's forward finds them, as
        # update() takes them
        self.guard.checkpoint(self.target)
        self.target.cleargrads()
        self._run_loss(lossfun, args, {})
        self.estimator.end_micro_batch()
        self._micro += 1

    def finish_step(self, update=None) -> None:
        """Take the K-FAC step of the micro-batches closed so far (the end
        of :meth:`update` at its ``acc_iters``-th call). ``update(grads,
        present)``, where given, takes stage 5 and the update in place of
        :meth:`update_step` (a CUDA graph's replay of it:
        :mod:`chainerkfac.graphs.kfac_step`)."""
        self.accumulator.collect(self.target)
        self.timer.mark('forward_backward', self._like())
        self._step(update)

    def flush_accumulation(self, global_micro_batches: Optional[int] = None
                           ) -> int:
        """Take the K-FAC step now with the micro-batches accumulated since
        the last step (fewer than ``acc_iters``), averaged over them.

        For the end of a run whose length is not a multiple of
        ``acc_iters``. In a multi-process run every process calls it.

        Parameters
        ----------
        global_micro_batches : int, optional
            The step's micro-batches over all processes, where processes
            hold different numbers of them (a run's end on ``P`` processes
            that falls inside a micro-iteration: some have one more). Every
            process then takes the step, one with none of its own too (it
            contributes nothing), and the gradients are averaged over these
            micro-batches, as one process accumulating them all would
            (:attr:`global_micro_batches`). Passed the same on every
            process; 0: no step anywhere.

        Returns
        -------
        int
            The number of micro-batches the step used (0: none was pending,
            no step taken).
        """
        pending = self._micro
        if self.accumulator.resumed_from is not None:
            # loaded inside a step, no micro-batch since: param.grad holds
            # nothing of the step (Chainer's NaN of a new parameter), and
            # the restored factors have no inverses until the start
            self.target.cleargrads()
            if not self._started:
                process_group.join(self, gradients_reduced=False)
                self._start()
        if global_micro_batches is not None:
            self.global_micro_batches = global_micro_batches
            if global_micro_batches > 0:
                if not pending:         # nothing of its own: no gradient
                    self.target.cleargrads()
                self.finish_step()
            return pending
        if pending:
            self.finish_step()
        return pending

    def _run_loss(self, lossfun, args, kwds) -> None:
        self.estimator.run_loss(lossfun, args, kwds,
                                list(self.target.params()),
                                loss_scale=self._loss_scale)

    def _redo(self, lossfun, args, kwds) -> None:
        self.guard.restore()
        self.target.cleargrads()
        self.estimator.discard_micro_batch()
        self._run_loss(lossfun, args, kwds)

    def _check_manual_update(self) -> None:
        """``update()`` without a loss function: the Fisher passes of 'mc'
        and 'exact' cannot run."""
        if self.estimator.needs_loss_function:
            raise TypeError(
                "KFAC(fisher={!r}) takes the output-gradient factors from "
                "extra backward passes from the model's logits, which need "
                'the loss function: call optimizer.update(lossfun, *args). '
                "In a loop that calls loss.backward() itself use "
                "fisher='emp'.".format(self.fisher))

    def _check_frozen_alike(self, updated_on) -> None:
        """Raise, on every process alike, where a parameter is updated on
        some processes and frozen on others (``updated_on``: for each
        parameter of each block, on how many it is updated)."""
        size = self.transport.size
        names = ['{}/{}'.format(b.name.rstrip('/'), p.name)
                 for b in self.blocks for p in b.params]
        mixed = [(name, count) for name, count in zip(names, updated_on)
                 if 0 < count < size]
        if mixed:
            raise RuntimeError(
                'K-FAC: {} updated on {} of {} processes and frozen on the '
                'others (disable_update() or update_rule.enabled = False '
                'on some processes only): the replicas would part. Freeze '
                'alike on every process{}'.format(
                    mixed[0][0], mixed[0][1], size,
                    '' if len(mixed) == 1 else
                    ' ({} parameters differ)'.format(len(mixed))))

    def _like(self):
        for param in self.target.params():
            if param.array is not None:
                return param.array
        return None

    # -- stages 3-6 and the update --------------------------------------------
    def _step(self, update=None):
        if self.shard_update:
            hooks.check_sharded(self)
        blocks, transport = self.blocks, self.transport
        n_micro, self._micro = self._micro, 0
        samples = self.estimator.samples
        captured = {b: b.captured() for b in blocks}
        due = self.estimator.due
        # Every process learns which factors were captured anywhere (and by
        # how many micro-batches) and which parameters have a gradient
        # anywhere, so all send the same arrays.
        local, updates = [], []
        for block in blocks:
            local += [captured[block].get(n, (None, 0))[1]
                      for n in block.factor_names]
            updated = [int(hooks.updates(p)) for p in block.params]
            updates += updated
            # a frozen parameter's gradient (Chainer computes it) neither
            # moves it nor counts in the bounded step
            local += [int(p.grad is not None) * u
                      for p, u in zip(block.params, updated)]
        # the micro-batches with samples (an empty one adds no gradient)
        local.append(n_micro - self.estimator.empty_micro_batches)
        # which parameters each process updates (frozen on some only: the
        # replicas would part silently)
        if transport.size == 1:
            updates = []
        local += updates
        totals = iter(transport.all_sum(numpy.array(local, numpy.int64)))
        counts, present = {}, {}
        for block in blocks:
            counts[block] = {n: c for n, c in zip(
                block.factor_names, totals) if c}
            present[block] = [bool(next(totals)) for _ in block.params]
        with_samples = int(next(totals))
        if updates:
            self._check_frozen_alike([int(next(totals)) for _ in updates])
        if not self._table_shown or not self.rescale.decided:
            self._decide_rescale()
        self._warn_uncaptured(due, counts, present)
        self.reallocate_cleared_grads()
        total, self.global_micro_batches = self.global_micro_batches, None
        if self.loss_reduction == 'sum':
            if total is None:
                scale = 1.0 / samples if samples else 1.0
            else:
                total = int(transport.all_sum(numpy.array([samples],
                                                          numpy.int64))[0])
                scale = transport.size / float(total) if total else 1.0
        elif total is None and with_samples == transport.size * n_micro:
            scale = 1.0 / n_micro
        else:
            # the processes' micro-batches differ (a flush), or some were
            # empty: each one's gradient weighs by its share of those with
            # samples (the reduction below averages over the processes)
            scale = (transport.size / float(with_samples) if with_samples
                     else 1.0)
        for block in blocks:
            for param, has in zip(block.params, present[block]):
                # Chainer's loss scaling: the gradient of a backward pass
                # from loss_scale S is S times the loss's (undone here, as
                # Chainer's update rules undo it; the gradient factors
                # were undone when captured)
                loss_scale = param._loss_scale
                param._loss_scale = None
                if has and loss_scale is not None:
                    param.grad *= param.grad.dtype.type(scale / loss_scale)
                elif has and scale != 1.0:
                    param.grad *= param.grad.dtype.type(scale)
        # several processes: a hook on one parameter's ∇L acts on the
        # average, after the reduction (a hook need not be linear)
        after = transport.size > 1 and not self.gradients_reduced
        if after:
            self._warn_whole_model_hooks()
        hooks.call_gradient_hooks(self, whole_model_only=after)
        grads = {b: [p.grad if has else None
                     for p, has in zip(b.params, present[b])]
                 for b in blocks}
        factors = self._exchange.prepare(blocks, {
            b: {n: captured[b][n][0] if n in captured[b] else None
                for n in counts[b]} for b in blocks}, transport)
        factors = {b: {n: v if v is not None else self._local_factor(b, n)
                       for n, v in f.items()} for b, f in factors.items()}
        self.timer.mark('factors', self._like())
        grads, factors = self._reduce_scatter(grads, factors)
        if after:
            hooks.call_reduced_gradient_hooks(self, grads)
        factors = self._exchange.receive(factors)
        self.timer.mark('reduce_scatter', self._like())

        retries, failed = self._refresh(factors, counts)
        self.timer.mark('inverse', self._like())

        step = self.t
        (update or self.update_step)(grads, present)
        # Chainer's dynamic loss scaling, from the step's own verdict (read
        # on the host only then: a CUDA graph's capture reads nothing; the
        # graphs refuse loss scaling)
        if self._loss_scaling_is_dynamic:
            loss_scaling.follow_step(self, self.guard.skipped)
        refreshed = set()
        for block in blocks:
            for name in counts[block]:
                if (block, name) in failed:
                    continue        # not refreshed: due again next step
                block.mark_refreshed(name, step)
                refreshed.add(block.factor_kinds[name].interval)
        # blocks whose factors were due and that no backward pass reached
        # (a head the loss does not use): they stay due, refreshing nothing
        self._unreached = frozenset(
            b for b in due if not counts[b] and not any(present[b]))
        self._close_step(refreshed, retries, step)
        self.timer.mark('update', self._like())
        self.call_hooks('post')
        self.guard.checkpoint(self.target)
        self._begin_step()

    def update_step(self, grads, present) -> None:
        """Stage 5 (the owned blocks' preconditioning, the bounded step),
        stage 6 and the update of eqs. (19)-(20), from the reduced
        gradients ``grads`` (``{block: [array or None]}``; ``present``:
        which parameters have one anywhere): the end of a step, after its
        inverses. Advances ``t``."""
        # this step's device γ per scale, made anew (the device damping is
        # rewritten in place before each step; and a capture that failed
        # or was retried only recorded the kernels of its own)
        self._step_dampings = {}
        directions = self._precondition_owned(grads, present)
        if self.step_bound is not None:
            self._bound_step(grads, directions)
        self.timer.mark('precondition', self._like())
        if self.shard_update:
            self._update_sharded(directions, present)
        else:
            self._update_everywhere(directions, present)

    def _update_everywhere(self, directions, present) -> None:
        """Stage 6, then the update: every process gathers every
        preconditioned gradient and applies eqs. (19)-(20) to every
        parameter, unless a direction is not finite. The clipping hooks
        run before ``t`` advances, as Chainer's ``'pre'`` hooks do."""
        directions = self.transport.all_gather(self.blocks, directions,
                                               present)
        self.timer.mark('all_gather', self._like())
        hooks.call_direction_hooks(self, self.blocks, directions)
        self.t += 1
        if self.guard.check([d for ds in directions.values() for d in ds],
                            self._agree(),
                            self.updated_params(self.blocks, present)):
            self._apply([(b, directions.get(b, ())) for b in self.blocks])
        else:
            self.guard.restore()

    def _update_sharded(self, directions, present) -> None:
        """Weight-update sharding (:mod:`chainerkfac.sharding`): the
        process that sends a block (its first owner) applies eqs. (19)-(20)
        to the block's parameters and keeps their velocities; then the new
        weights travel in one AllGatherV in place of the directions (stage
        6). What must be agreed over processes before any update — the
        bounded step's ν (:meth:`_bound_step`, before this) and the finite
        check — is reduced from the owners' directions first. The clipping
        hooks act element by element on the updated blocks' directions
        (:func:`chainerkfac.optimizers.hooks.call_direction_hooks`); a
        clipping hook of the whole model's norm is refused
        (:func:`~chainerkfac.optimizers.hooks.check_sharded`)."""
        transport = self.transport
        mine = [b for b in self.blocks
                if b in directions and transport.updates(b)]
        hooks.call_direction_hooks(self, mine, directions, sharded=True)
        self.t += 1
        if self.guard.check([d for b in mine for d in directions[b]],
                            self._agree(),
                            self.updated_params(mine, present)):
            self._apply([(b, directions[b]) for b in mine])
            self.timer.mark('update', self._like())
            transport.gather_weights(self.blocks, present)
            self.timer.mark('all_gather', self._like())
        else:
            self.guard.restore()

    @staticmethod
    def updated_params(blocks, present) -> List:
        """The parameters of ``blocks`` that an update writes: those with
        a gradient on some process (``present``); K-FAC leaves the others
        alone (a head no loss reached: no step, no state)."""
        return [p for b in blocks
                for p, has in zip(b.params, present.get(b, ())) if has]

    def _agree(self):
        """The finite check's agreement over processes (None: one)."""
        transport = self.transport
        return transport.agree if transport.size > 1 else None

    @staticmethod
    def _apply(pairs) -> None:
        """Eqs. (19)-(20) for each ``(block, directions)``: on the GPU the
        parameters of plain rules (no hooks) in multi-tensor kernels, with
        and without eq. (20) (:func:`update_rule.apply_all`), the others
        rule by rule."""
        update_rule.apply_all(
            [(param, direction) for block, directions in pairs
             for param, direction in zip(block.params, directions)
             if direction is not None])

    def _init_never_updated_states(self) -> None:
        """Give a velocity (zero) to each parameter this process updates
        whose rule never ran: one that no step had a gradient for (a head
        the loss never used). Chainer's optimizers run every rule at every
        update, and Chainer's loader requires the state of every enabled
        rule: without it a snapshot saved here would not load."""
        for block in self.blocks:
            if self.shard_update and not self.transport.updates(block):
                continue
            for param in block.params:
                rule = param.update_rule
                if (not hooks.updates(param) or rule.state is not None or
                        param.array is None):
                    continue
                # As Chainer's UpdateRule.update makes it: on the float32
                # master of a float16 parameter under use_fp32_update.
                if (rule._use_fp32_update and
                        param.array.dtype == numpy.float16):
                    if rule._fp32_param is None:
                        rule._fp32_param = chainer.Parameter(
                            param.array.astype(numpy.float32),
                            name=param.name)
                    param = rule._fp32_param
                rule._init_states(param)

    def _drop_unowned_state(self) -> None:
        """Weight-update sharding: keep the velocities of the parameters
        this process updates only (after a restore that merged every
        process's file)."""
        names = {id(p): n for n, p in self.target.namedparams()}
        pairs = [(p, self.transport.updates(b)) for b in self.blocks
                 for p in b.params]
        sharding.drop_unowned_state([p for p, _ in pairs],
                                    [mine for _, mine in pairs],
                                    [names[id(p)] for p, _ in pairs])

    def _reduce_scatter(self, grads, factors):
        """Stage 3: gradients and due factors summed over processes, each
        block's on its owner (gradients averaged)."""
        transport = self.transport
        if self.gradients_reduced:
            # Averaged already (ChainerMN's multi-node optimizer): only the
            # factors travel; owners precondition their local copy.
            _, factors = transport.reduce_scatter(
                self.blocks, {b: [None] * len(g) for b, g in grads.items()},
                factors)
            return ({b: g for b, g in grads.items() if transport.owns(b)},
                    factors)
        grads, factors = transport.reduce_scatter(self.blocks, grads,
                                                  factors)
        if transport.size > 1:
            for reduced in grads.values():
                for grad in reduced:
                    if grad is not None:
                        grad /= transport.size
        return grads, factors

    def _local_factor(self, block, name):
        """Zeros for a factor this process captured none of (others
        did)."""
        like = block.params[0]
        with chainer.using_device(like.device):
            return like.device.xp.zeros(block.factor_shapes()[name],
                                        linalg.factor_dtype_for(like.dtype))

    def _refresh(self, factors, counts) -> Tuple[int, set]:
        """Stage 4: average the reduced factor sums, invert, store.
        Returns the retries and the ``(block, name)`` of each factor that
        could not be inverted (kept due: tried again at the next step)."""
        self.fisher_diffs = {}
        requests = []
        refreshed = []
        for block, sums in factors.items():
            if not sums:
                continue
            candidates = {}
            for name, total in sums.items():
                total = low_rank.scaled(total, 1.0 / counts[block][name])
                candidates[name] = block.candidate(name, total,
                                                   self.factor_decay)
            refreshed.append((block, candidates))
        # the damping's split reads factors' traces: all in one host read
        traced = [f for block, candidates in refreshed
                  for f in block.traced_factors(candidates)]
        with low_rank.traces_read_once(traced):
            for block, candidates in refreshed:
                damping = self.damping * block.damping_scale(self.rho_bn)
                wanted = block.inverse_requests(candidates, damping)
                for name, (matrix, used) in wanted.items():
                    requests.append((block, name, matrix, used))
                for name in candidates:
                    if name not in wanted:
                        # Cannot be inverted yet (its partner is missing):
                        # keep it for when it can.
                        block.keep_candidate(name, candidates[name])
        results = linalg.damped_inverses(
            [low_rank.inversion_matrix(r[2]) for r in requests],
            [r[3] for r in requests], method=self.inverse_method)
        retries, failed = 0, set()
        for (block, name, matrix, _), result in zip(requests, results):
            retries += result.retries
            had = name in block.inverses
            if not block.commit(name, matrix, result, self.fisher_diff,
                                refill=self.refill_inverses):
                failed.add((block, name))
                logger.warning(
                    'K-FAC step %d: factor %s of %s could not be inverted '
                    '(non-finite, or not positive definite at damping %.3g, '
                    'its share of the damping after %d retries); %s; it is '
                    'due again at the next step', self.t, name, block.name,
                    result.damping, result.retries,
                    'the previous factor and inverse are kept' if had else
                    'the block has no inverse yet and gets the plain '
                    'gradient')
            elif name in block.diff and self.fisher_diff:
                self.fisher_diffs[(block.name, name)] = block.diff[name]
        return retries, failed

    def refresh_due(self) -> bool:
        """Whether the coming step refreshes curvature: a factor is due
        in a block that the last step reached. (A block no backward pass
        reached, a head the loss does not use, keeps its factors due until
        one does: while it is not reached, a step refreshes nothing there,
        and a CUDA graph of a stale step may replay it.)"""
        return any(b not in self._unreached for b in self.estimator.due)

    def _precondition_owned(self, grads, present):
        """Stage 5 for every owned block with a gradient. On the GPU the
        Kronecker blocks of equal shapes go as one batch each, and so do
        the full BN Fishers of equal sizes (a Python loop over shape
        groups, a few kernels per group); on the CPU, where batching saves
        nothing, block by block."""
        owned, batches = self._batches(grads, present)
        directions = {}
        batched = set()
        for members, stack in batches:
            damping = self._block_damping(members[0])
            member_grads = [grads[b] for b in members]
            if isinstance(members[0], batch_norm.BatchNormalizationBlock):
                out = batch_norm.precondition_batch(members, member_grads,
                                                    damping, stack)
            else:
                out = kronecker.precondition_batch(
                    members, member_grads, damping, stack,
                    tf32=members[0].precondition_tf32)
            directions.update(zip(members, out))
            batched.update(members)
        for block in owned:
            if block not in batched:
                directions[block] = self._precondition(block, grads[block])
        return directions

    def _batches(self, grads, present):
        """``(owned, batches)``: the owned blocks with a gradient, and
        stage 5's batches of them, ``(members, stack)`` for each shape
        group of two or more blocks with every gradient (on the GPU only:
        :meth:`batches_stage_5`)."""
        owned = [b for b in self.blocks
                 if self.transport.owns(b) and any(present[b])]
        groups = {}
        if self.batches_stage_5():
            for block in owned:
                if all(g is not None for g in grads[block]):
                    key = (kronecker.batch_key(block) or
                           batch_norm.batch_key(block))
                    if key is not None:
                        groups.setdefault(key, []).append(block)
        batches = []
        for key, members in groups.items():
            if len(members) < 2:
                continue
            names = ('F',) if isinstance(
                members[0], batch_norm.BatchNormalizationBlock) else ('A', 'G')
            batches.append((members, self._inverse_stacks.setdefault(
                key, kronecker.InverseStack(names))))
        return owned, batches

    def batches_stage_5(self) -> bool:
        """Whether stage 5 goes in batches of equal blocks: on the GPU
        (the CPU gains nothing by it)."""
        like = self._like()
        return like is not None and not isinstance(like, numpy.ndarray)

    def prepare_inverse_stacks(self, grads, present) -> None:
        """Stack, or bring up to date, every batch of inverses that stage 5
        reads for these gradients, now: a CUDA graph's capture of stage 5
        then stacks and copies nothing (what a capture allocates is the
        graph's, and its copies are only recorded: run again, or retried
        after a failed capture, the bookkeeping would say done)."""
        for members, stack in self._batches(grads, present)[1]:
            stack.get(members)

    def refresh_inverse_stacks(self) -> None:
        """Bring every stacked batch of inverses up to date with inverses
        refreshed in place (:attr:`refill_inverses`), including a batch the
        refresh step did not precondition (no gradient there then)."""
        for stack in self._inverse_stacks.values():
            stack.refresh()

    def inverse_buffers(self) -> List:
        """Every array stage 5 reads its inverses from: each block's
        inverses (a Woodbury inverse's arrays) and the stacked batches.
        A captured stale step reads these addresses."""
        arrays = []
        for block in self.blocks:
            for name in sorted(block.inverses):
                arrays += low_rank.inverse_arrays(block.inverses[name])
        for key in sorted(self._inverse_stacks, key=repr):
            arrays += self._inverse_stacks[key].arrays()
        return arrays

    def _bound_step(self, grads, directions) -> None:
        """Stage 5, end: ν of :mod:`chainerkfac.step_bound` from the owned
        blocks' terms (one scalar summed over processes), applied to the
        owned directions of the blocks with curvature before they travel:
        every process scales alike, before any update."""
        curved = [b for b in directions
                  if b.factor_names and b.has_inverses()]
        terms = [(b, grads[b], directions[b], self._block_damping(b))
                 for b in curved if self.transport.sends(b)]
        scaled = [directions[b] for b in curved]
        if (self.device_lr is not None and self.device_damping is not None
                and self.transport.size == 1
                and self.step_bound.sum_across is None):
            # one process's step that a CUDA graph may capture: ν stays on
            # the device (η and γ are device scalars there)
            self.step_bound.apply_on_device(terms, scaled, self.device_lr)
        else:
            self.step_bound.apply(terms, scaled, self.lr,
                                  self.transport.all_sum_float)

    def _precondition(self, block, grads):
        """Stage 5: ``(F + γI)⁻¹ ∇E`` of one owned block."""
        damping = self._block_damping(block)
        # a parameter without a gradient (frozen, or not reached) is a zero
        # in ∇E, its γ(w − μ) too: else a frozen W moved its own bias
        out = block.precondition(list(grads), damping)
        return [d if g is not None else None for d, g in zip(out, grads)]

    def _block_damping(self, block):
        """γ of a block in stage 5: a float, or a device scalar
        (:attr:`device_damping`), made once per step for each scale (ρ_BN
        or 1: two kernels a step where each block took one)."""
        scale = block.damping_scale(self.rho_bn)
        if self.device_damping is None:
            return self.damping * scale
        cached = self._step_dampings.get(scale)
        if cached is None:
            cached = self._step_dampings[scale] = self.device_damping * scale
        return cached

    # -- between steps --------------------------------------------------------
    def _close_step(self, refreshed, retries: int, step: int) -> None:
        """The step's report and the damping schedule (eqs. 15-16)."""
        self._frozen_restored = None
        self._report(refreshed, retries, step)
        if self._damping_rate is not None:
            self.damping = equations.damping_step(
                self.damping, self.damping_target, self._damping_rate)

    def finish_replayed_step(self) -> None:
        """The host side of a step that refreshed nothing and whose device
        work a CUDA graph replayed (:mod:`chainerkfac.graphs.kfac_step`):
        what :meth:`update` does on the host for such a step, but the
        update rules' ``t``, which the caller advances."""
        step = self.t
        self.t += 1
        self.fisher_diffs = {}
        self._close_step(set(), 0, step)
        self._begin_step()

    def _begin_step(self) -> None:
        """Decide the factors due at the coming step and start capturing
        them (the graph too, until the first step: eq. 20 'auto' and the
        registration table)."""
        self.estimator.start_step(self._factors_due(),
                                  record_graph=not (self._table_shown and
                                                    self.rescale.decided))

    @staticmethod
    def _frozen(block) -> bool:
        return bool(block.params) and not any(
            hooks.updates(p) for p in block.params)

    def _warn_whole_model_hooks(self) -> None:
        """Say once which hooks on ∇L of the whole model act on each
        process's own gradient (:mod:`chainerkfac.optimizers.hooks`)."""
        names = [n for n in hooks.whole_model_gradient_hooks(self)
                 if n not in self._warned_hooks]
        if not names:
            return
        self._warned_hooks.update(names)
        if self.transport.rank == 0:
            logger.warning(
                'K-FAC multi-node: the optimizer hook(s) %s act on the whole '
                "model's gradient (call_for_each_param is False), which no "
                "process holds averaged: they act on each process's own "
                'gradient before the reduction, so the step is the single '
                "process's only where they are linear in the gradient",
                ', '.join(names))

    def _decide_again_if_unfrozen(self, can: bool) -> None:
        """A step's factors are decided at the end of the step before;
        a link frozen then and unfrozen since (``enable_update()``) would
        take the step without its curvature. Before the step's passes
        (``update(lossfun)`` at its first micro-batch, ``can``): decide
        again, the link due; after some (``loss.backward();
        optimizer.update()``, or a later micro-batch): say so, once per
        block."""
        unfrozen = [block for block in self.blocks
                    if self.frozen_when_decided.get(block.name) and
                    not self._frozen(block)]
        if not unfrozen:
            return
        if can:
            self._frozen_restored = None
            self._begin_step()
            return
        said = [b.name for b in unfrozen
                if b.name not in self._warned_unfrozen]
        self._warned_unfrozen.update(said)
        if said and self.transport.rank == 0:
            logger.warning(
                'K-FAC: %s frozen when this step\'s curvature was decided '
                '(at the last update) and updated now (enable_update()): '
                'its curvature was not captured in this step\'s backward '
                'passes, so it takes this step without it (a plain '
                'gradient step if it has none yet), preconditioned from '
                'the next; update(lossfun) decides again where a link is '
                'unfrozen before a step\'s first micro-batch',
                ', '.join(said))

    def _factors_due(self):
        self._step_intervals = {
            kind: schedule(self.t, self.epoch)
            for kind, schedule in self.refresh_intervals.items()}
        due = {}
        # a load's record decides until the first step after it is taken
        # (the first update decides again: :meth:`_start`)
        restored = self._frozen_restored
        for block in self.blocks:
            frozen = self._frozen(block)
            if restored is not None and block.name in restored:
                frozen = restored[block.name]
            self.frozen_when_decided[block.name] = frozen
            if frozen:
                # disable_update(): no capture, exchange or inverse for it;
                # due again once it is not
                continue
            names = frozenset(
                name for name, kind in block.factor_kinds.items()
                if self._is_due(block.last_refresh[name], kind.interval))
            if names:
                due[block] = names
        return due

    def _is_due(self, last: int, interval: str) -> bool:
        return last < 0 or self.t - last >= self._step_intervals[interval]

    def _decide_rescale(self) -> None:
        """Eq. (20) 'auto' from the first step's graph, before its update
        (from the first that runs its normalising layers in train mode,
        where earlier ones ran them in test mode only, on some process);
        then the registration table, at the first step."""
        graph = self.estimator.graph
        if self.rescale.mode == 'auto' and not self.rescale.decided:
            # no backward pass yet, or only test-mode normalisation, on
            # some process: every process decides at a later step (agreed
            # first: the decision below is a collective)
            waiting = not graph or self.rescale.waits_for_train_mode(graph)
            if self.transport.all_sum(numpy.array([int(waiting)],
                                                  numpy.int64))[0]:
                if graph:
                    self.estimator.clear_graph()    # recorded afresh
                    self._show_table()
                return
            self.rescale.decide_from_graph(
                graph, lambda flags: self.transport.all_sum(flags) ==
                self.transport.size)
        self.estimator.stop_recording_graph()
        self._show_table()

    def _show_table(self) -> None:
        """The registration table, once."""
        if self._table_shown:
            return
        self._table_shown = True
        if self.verbose and self.transport.rank == 0:
            _logging.ensure_visible()
            logger.info('K-FAC registration\n%s', self.registration_table())

    def _warn_uncaptured(self, due, counts, present) -> None:
        """A due factor that no process captured: the block keeps its old
        curvature (or none yet); say which and why, once per block, in one
        line for the blocks alike (a backbone run under no_backprop_mode
        gave a line per layer). A frozen block (``disable_update()``) is
        not said."""
        groups = {}
        for block, names in due.items():
            missing = sorted(n for n in names if n not in counts[block])
            if not missing or block.name in self._warned_uncaptured or \
                    block in self.estimator.empty_blocks:
                continue
            self._warned_uncaptured.add(block.name)
            if self.transport.rank != 0 or \
                    not any(hooks.updates(p) for p in block.params):
                continue
            kept = block.has_inverses() or any(
                block.last_refresh[n] >= 0 for n in missing)
            if not any(present[block]):
                state_text = 'is not updated while it has no gradient' + (
                    ', and keeps its previous curvature' if kept else '')
                why = ('no backward pass ran through it since the last '
                       'update (not called, called in test mode or under '
                       'no_backprop_mode, or its output reached no loss)')
            elif self.fisher != 'emp' and all(
                    not block.factor_kinds[n].forward for n in missing):
                state_text = ('keeps its previous curvature' if kept else
                              'gets the plain gradient until they are')
                why = ("its parameters have gradients, but fisher='{}' "
                       'takes the output gradients from passes from the '
                       "model's logits (softmax cross-entropy, softmax, "
                       'log-softmax), and none reached it: its output '
                       'enters the loss otherwise (a regression term, a '
                       "head of its own); fisher='emp' takes every term"
                       .format(self.fisher))
            else:
                state_text = ('keeps its previous curvature' if kept else
                              'gets the plain gradient until they are')
                why = ('its parameters have gradients, but no backward pass '
                       'through a call of {} reached the hook ({}used by '
                       'another function, or run in another thread?)'.format(
                           ', '.join(t.__name__
                                     for t in block.function_types),
                           ''.join('called in test mode, as {}; '.format(
                               t.__name__)
                               for t in block.test_mode_function_types)))
            groups.setdefault((why, state_text), []).append(
                '{} ({}): factor{} {}'.format(
                    block.name, block.kind, 's' if len(missing) > 1 else '',
                    ', '.join(missing)))
        for (why, state_text), names in groups.items():
            shown = names if len(names) <= 6 else names[:5] + [
                'and {} more blocks'.format(len(names) - 5)]
            logger.warning('K-FAC step %d: %s due but not captured: %s; %s '
                           '%s', self.t, '; '.join(shown), why,
                           'each' if len(names) > 1 else 'it', state_text)

    def _report(self, refreshed, retries, step: int):
        """The step's observation; ``step`` numbers it as the warnings of
        its inversions do (the value of ``t`` the step began with)."""
        preconditioned = sum(
            1 for b in self.blocks if b.factor_names and
            all(b.last_refresh[n] >= 0 for n in b.factor_names))
        self.last_step = {'damping': float(self.damping)}
        self.last_step.update(self._step_intervals)
        observation = {
            'kfac/damping': self.damping,
            'kfac/refresh_A': float('A' in refreshed),
            'kfac/refresh_G': float('G' in refreshed),
            'kfac/refresh_F': float('F' in refreshed),
            'kfac/inverse_retries': float(retries),
            'kfac/skipped_step': self.guard.observation(),
            'kfac/preconditioned_blocks': float(preconditioned),
            'kfac/plain_blocks': float(len(self.blocks) - preconditioned),
            'kfac/low_rank_factors': float(
                low_rank.held_low_rank(self.blocks)),
        }
        if self.step_bound is not None:
            observation.update(self.step_bound.observation())
            held = self.step_bound.held_back(step + 1)
            if held is not None and self.transport.rank == 0:
                logger.warning('K-FAC step %d: %s', step, held)
        for (layer, factor), value in self.fisher_diffs.items():
            observation['kfac/diff/{}{}'.format(factor, layer)] = value
        chainer.reporter.report(observation)
        if self.guard.checks_on_host and self.guard.skipped:
            logger.warning('K-FAC step %d: non-finite preconditioned '
                           'gradient, update skipped (weights and running '
                           'statistics unchanged)', step)

    @property
    def last_refresh(self) -> Dict[str, int]:
        """``{'A': step, 'G': step, 'F': step}``: the last step that
        refreshed any factor scheduled by each interval (-1: none)."""
        out = {'A': -1, 'G': -1, 'F': -1}
        for block in self.blocks:
            for name, kind in block.factor_kinds.items():
                key = kind.interval
                out[key] = max(out[key], block.last_refresh[name])
        return out

    # -- state ----------------------------------------------------------------
    def _check_loaded_velocities(self) -> None:
        """Raise ValueError, naming the parameter, where a loaded
        velocity does not have its parameter's shape (a snapshot of
        another model: Chainer takes it as it is, and the first update
        failed in broadcasting, naming nothing)."""
        for name, param in self.target.namedparams():
            rule = param.update_rule
            if rule is None or param.array is None or not rule.state:
                continue
            for key, value in rule.state.items():
                shape = getattr(value, 'shape', None)
                if shape is not None and tuple(shape) != param.shape:
                    raise ValueError(
                        'K-FAC state of {}: the snapshot\'s {} has shape '
                        '{}, the parameter {}: the snapshot is of another '
                        'model or other layer sizes'.format(
                            name, key, tuple(shape), param.shape))

    def serialize(self, serializer):
        """Optimizer state: t, epoch, velocities (Chainer's), and K-FAC's
        own (:func:`chainerkfac.optimizers.state.serialize`)."""
        if (self._started and
                not isinstance(serializer, chainer.serializer.Deserializer)):
            self._init_never_updated_states()
        if self.shard_update and self.transport.size > 1 and isinstance(
                serializer, chainer.serializer.Deserializer):
            # each process's file holds the velocities it owned (on one
            # process, every one: strict)
            super().serialize(sharding.PartialStateDeserializer(serializer))
        else:
            try:
                super().serialize(serializer)
            except ValueError as error:
                if 'could not broadcast' not in str(error):
                    raise
                # Chainer copies a loaded velocity into the one it holds
                raise ValueError(
                    'K-FAC: the snapshot\'s velocities do not fit this '
                    "model's parameters ({}): the snapshot is of another "
                    'model or other layer sizes'.format(error)) from None
        if isinstance(serializer, chainer.serializer.Deserializer):
            self._check_loaded_velocities()
        state.serialize(self, serializer)
        if isinstance(serializer, chainer.serializer.Deserializer):
            if self._started:
                for block in self.blocks:
                    if self.transport.owns(block):
                        block.restore_inverses(state.restore_method(self))
                if self.shard_update:
                    self._drop_unowned_state()
            # What is due follows the restored step; the running statistics
            # to restore on a skipped step are those of the restored model,
            # taken at the next update(lossfun) (Chainer's updaters load
            # the model after its optimizer), and until then those of now:
            # a loop that runs its own forward restored nothing, and its
            # skipped step left NaN in them.
            self._micro = 0
            self._begin_step()
            # a snapshot inside a step: the step so far, taken up again
            state.resume_accumulation(self)
            self.guard.checkpoint(self.target)
            self._checkpoint_due = True

"""The interface every Fisher block implements.

A block owns the curvature of one link: it accumulates its factors from the
calls the capture hands it (stages 1-2), turns averaged factors into damped
inverses (stage 4), and preconditions the gradients of its parameters
(stage 5). Who computes which block, and how factors travel, is decided
elsewhere (:mod:`chainerkfac.assignment`, :mod:`chainerkfac.transport`);
blocks only do the maths, identically on NumPy and CuPy, and keep their own
state: the optimizer reads and changes it through the methods below.

A block declares its factors in :attr:`FisherBlock.factor_kinds`, each with
a :class:`FactorKind`: whether it is estimated from the layer's inputs or
from gradients. The refresh schedule of the stale Fisher (eqs. 22-23) and
the way calls combine key on that kind, never on a factor's name.

Several calls of a link
-----------------------
A link called several times for one loss (a discriminator on real and fake
batches, 35 time steps of BPTT, shared weights) contributes every call. As
KFC does for the locations of a convolution (Grosse & Martens 2016; Martens,
Ba & Grosse 2018 for the time steps of an RNN), the calls are taken as
independent and alike: ``F ≈ Σ_calls A_c ⊗ G_c ≈ (Σ_c A_c) ⊗ (mean_c G_c)``.
So a factor of kind ``INPUTS`` is the **sum** over calls, one of kind
``OUTPUT_GRADS`` the **mean** over the calls of one backward pass, and one
of kind ``PARAM_GRADS`` (a Fisher of the parameters' own gradients, whose
per-sample gradient is the sum over calls) the **sum** over calls.
"""
import enum
from typing import Dict, List, Optional, Sequence, Tuple

import numpy

from chainer.backend import get_array_module

from chainerkfac import dtypes
from chainerkfac import linalg
from chainerkfac import low_rank
from chainerkfac import packing
from chainerkfac.fused import regularized_grad


class FactorKind(enum.Enum):
    """What a factor is estimated from: how calls combine and the refresh
    interval that schedules it (``KFAC(refresh_interval_a/g/f)``).

    ``INPUTS``
        From the layer's inputs (K-FAC's ``A``), summed over calls;
        refreshed every ``refresh_interval_a`` steps.
    ``OUTPUT_GRADS``
        From the gradients of the loss w.r.t. the layer's outputs (K-FAC's
        ``G``), averaged over the calls of a backward pass;
        ``refresh_interval_g``.
    ``PARAM_GRADS``
        A Fisher of per-sample parameter gradients (the BatchNormalization
        ``F``), summed over calls; ``refresh_interval_f``.

    Every kind is captured when the backward pass runs through the call: a
    call that no backward pass reaches contributes nothing.
    """

    INPUTS = 'forward'
    OUTPUT_GRADS = 'backward'
    PARAM_GRADS = 'backward (parameters)'

    @property
    def forward(self) -> bool:
        """Estimated from the call's inputs (else from gradients)."""
        return self is FactorKind.INPUTS

    @property
    def interval(self) -> str:
        """The refresh interval that schedules it: ``'A'``, ``'G'`` or
        ``'F'``."""
        return _INTERVAL_OF[self]


_INTERVAL_OF = {FactorKind.INPUTS: 'A', FactorKind.OUTPUT_GRADS: 'G',
                FactorKind.PARAM_GRADS: 'F'}


class Unsupported(Exception):
    """Raised by a block factory for a link it cannot model.

    The link's parameters then get the plain (unpreconditioned) gradient;
    the message says why in the registration table.

    Parameters
    ----------
    reason : str
    rescaled_weight : chainer.Parameter, optional
        The weight eq. (20) concerns even though the link gets the plain
        gradient (a grouped convolution's kernel), with
    output_size : int, optional
        its d_out.
    """

    def __init__(self, reason: str, rescaled_weight=None,
                 output_size: Optional[int] = None):
        super().__init__(reason)
        self.rescaled_weight = rescaled_weight
        self.output_size = output_size


class BlockOptions:
    """Options of the optimizer that shape the blocks it builds.

    Parameters
    ----------
    factor_dtype : dtype-like or 'tf32'
        ``float16`` builds factors from half-precision products; ``'tf32'``
        keeps float32 factors whose products take their operands in TF32
        (:attr:`factor_tf32`).
    bn_fisher : {'full', 'diag'}
        Fisher of BatchNormalization's (γ, β): full or diagonal.
    max_factor_dim : int or None
        A factor larger than this (n×n with n > ``max_factor_dim``) is kept
        as its diagonal instead (inverting it would cost n³ and n² memory).
        ``None``: no limit.
    conv_a_strategy : {'unfolded', 'shifted'}, optional
        How a convolution forms ``A`` (:func:`chainerkfac.fisher_blocks.
        patches.patch_gram`); by default the library's choice (by cost on
        the CPU, by timing on the GPU under ``chainer.config.autotune``).
    low_rank : bool
        Capture a Kronecker factor of few per-sample vectors in per-sample
        form and precondition by Woodbury where that is cheaper
        (:mod:`chainerkfac.low_rank`). Only exact factors qualify: not with
        fp16 products (their rounded Gram matrix is not low rank).
    precondition_tf32 : bool
        Stage 5's dense products of float32 Kronecker blocks on TF32
        Tensor Cores (:func:`chainerkfac.linalg.tf32_matmul`).
    """

    def __init__(self, factor_dtype='float32', bn_fisher: str = 'full',
                 max_factor_dim: Optional[int] = None,
                 conv_a_strategy: Optional[str] = None,
                 low_rank: bool = False, precondition_tf32: bool = False):
        #: Float32 products from TF32 operands (Tensor Cores on the GPU).
        self.factor_tf32 = dtypes.is_tf32(factor_dtype)
        self.factor_dtype = numpy.dtype(
            numpy.float32 if self.factor_tf32 else factor_dtype)
        self.bn_fisher = bn_fisher
        self.max_factor_dim = max_factor_dim
        self.conv_a_strategy = conv_a_strategy
        self.low_rank = bool(low_rank) and \
            self.factor_dtype != numpy.float16
        self.precondition_tf32 = bool(precondition_tf32)

    def too_large(self, n: int) -> bool:
        """Whether an n×n factor exceeds :attr:`max_factor_dim`."""
        return self.max_factor_dim is not None and n > self.max_factor_dim


class FisherBlock:
    """Base class of the per-link curvature blocks.

    A subclass sets :attr:`factor_kinds` and :attr:`function_types`, and
    implements :attr:`params`, :meth:`factor_shapes`, the capture methods,
    :meth:`inverse_requests` and :meth:`precondition`.

    The capture routes a function call to a block when the function node
    is an instance of :attr:`function_types` and its second input is the
    block's first parameter (``params[0]``): ``linear(x, W, b)``,
    ``convolution_2d(x, W, b)``, ``batch_normalization(x, gamma, beta)``.
    The calls are handed over when the backward pass runs through them,
    with the inputs the function retained for its own backward.

    Parameters
    ----------
    name : str
        The link's path in the model (``'/res2/a/conv1'``).
    link : chainer.Link
        The link whose parameters this block preconditions.
    options : BlockOptions, optional
    """

    #: Short label in the registration table.
    kind = 'base'
    #: Factor name -> what it is estimated from; empty for plain blocks.
    factor_kinds: Dict[str, FactorKind] = {}
    #: FunctionNode type(s) this block captures from.
    function_types: tuple = ()
    #: FunctionNode types that normalise their first input per channel
    #: (BatchNormalization): a layer whose output reaches only these is
    #: scale invariant (:mod:`chainerkfac.scale_invariance`, eq. 20).
    normalizing_function_types: tuple = ()
    #: FunctionNode types of the same layer in test mode (running
    #: statistics), which do not: eq. 20 'auto' waits for a step that runs
    #: the layer in train mode before it decides.
    test_mode_function_types: tuple = ()

    def __init__(self, name: str, link, options: Optional[BlockOptions] = None):
        options = options or BlockOptions()
        self.name = name
        self.link = link
        self.factor_dtype = options.factor_dtype
        self.factor_tf32 = options.factor_tf32
        #: Stage 5's dense products on TF32 Tensor Cores (float32 blocks).
        self.precondition_tf32 = options.precondition_tf32
        # This step's capture: sums over the closed micro-batches, and the
        # open micro-batch's sums and calls.
        self._step_sums: Dict[str, object] = {}
        self._step_counts: Dict[str, int] = {}
        self._open: Dict[str, object] = {}
        self._calls: Dict[str, int] = {}
        self._scales: Dict[str, float] = {}
        self._collect: frozenset = frozenset()
        #: Averaged (and reduced) factors, as last refreshed.
        self.factors: Dict[str, object] = {}
        #: Damped inverses computed from :attr:`factors`.
        self.inverses: Dict[str, object] = {}
        #: The damping each inverse was computed with (after retries).
        self.inverse_damping: Dict[str, float] = {}
        #: Factors loaded while the link had no shape yet (lazily sized,
        #: before its first forward): ``(stored value, held flag)``, set
        #: into :attr:`factors` once it has one (:meth:`settle_loaded`).
        self._loaded: Dict[str, tuple] = {}
        #: K-FAC step of the last refresh of each factor (-1: never).
        self.last_refresh: Dict[str, int] = {n: -1 for n in self.factor_names}
        #: Diff(t) of eq. (21) at the last refresh of each factor.
        self.diff: Dict[str, float] = {}
        #: How many times each factor was computed / inverted (diagnostics).
        self.refresh_count: Dict[str, int] = {n: 0 for n in self.factor_names}
        self.inverse_count: Dict[str, int] = {n: 0 for n in self.factor_names}
        #: Rows of the registration table's last column (why plain, ...).
        self.note = ''
        #: Processes whose captures are summed (set at the first step): a
        #: factor's per-sample budget is shared among them.
        self.processes = 1

    # -- description -------------------------------------------------------
    @property
    def factor_names(self) -> Tuple[str, ...]:
        """The block's factors, in declaration order."""
        return tuple(self.factor_kinds)

    @property
    def params(self) -> List:
        """Parameters in the order :meth:`precondition` takes them."""
        raise NotImplementedError

    @property
    def rescaled_weight(self):
        """The weight eq. (20) may rescale (a Linear or convolution kernel),
        or None."""
        return None

    @property
    def output_size(self) -> Optional[int]:
        """d_out of :attr:`rescaled_weight` (eq. 20's norm is √(2·d_out))."""
        return None

    def factor_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """``{factor name: shape}`` of the factors the block estimates
        and inverts: ``(n, n)`` for a symmetric matrix (it travels packed),
        ``(n,)`` for a diagonal. A subclass must implement it."""
        raise NotImplementedError

    def symmetric(self, factor: str) -> bool:
        """Whether a factor is a symmetric matrix (travels packed)."""
        return len(self.factor_shapes()[factor]) == 2

    def inverse_cost(self) -> float:
        """Cost model for assignment: inverting an n×n factor ~ n³ (0 for a
        link not initialised yet)."""
        if any(p.array is None for p in self.params):
            return 0.0
        cost = 0.0
        for shape in self.factor_shapes().values():
            cost += float(shape[0]) ** 3 if len(shape) == 2 else shape[0]
        return cost

    def damping_scale(self, rho_bn: float) -> float:
        """Multiplier of the global damping for this block (ρ_BN for BN)."""
        return 1.0

    def describe(self) -> str:
        if any(p.array is None for p in self.params):
            return '(not initialised)'
        shapes = self.factor_shapes()
        return ', '.join(
            '{} {}'.format(n, 'x'.join(map(str, shapes[n])) if
                           len(shapes[n]) == 2 else
                           '{} (diag)'.format(shapes[n][0]))
            for n in self.factor_names)

    # -- stages 1-2: capture -------------------------------------------------
    def start_capture(self, names) -> None:
        """Collect the named factors from now on (a new step); others are
        dropped (a block that computes several factors in one call keeps
        only those due)."""
        self.reset_capture()
        self._collect = frozenset(names)

    def collects(self, kind: FactorKind) -> bool:
        """Whether a factor of ``kind`` is being collected this step."""
        return any(self.factor_kinds[n] is kind for n in self._collect)

    def scale_capture(self, scales: Dict[str, float]) -> None:
        """Multiply what the rest of this micro-batch captures of each named
        factor (the optimizer's correction for a summed loss, the weight of
        a Monte-Carlo sample)."""
        self._scales = dict(scales)

    def capture_inputs(self, function, in_data) -> None:
        """A call's contribution to the factors of kind ``INPUTS``
        (``in_data``: the inputs the function retained)."""

    def capture_gradients(self, function, in_data, out_grad) -> None:
        """A call's contribution to the factors of kinds ``OUTPUT_GRADS``
        and ``PARAM_GRADS`` (``out_grad``: the gradients w.r.t. the
        function's outputs)."""

    def accumulate(self, factor: str, value) -> None:
        """Add one call's estimate of ``factor`` to the open micro-batch
        (an array, or a :class:`~chainerkfac.low_rank.LowRank`): what a
        block's ``capture_*`` methods call. A factor not due this step is
        ignored; the micro-batch's calls and scales are the base class's."""
        if factor not in self._collect:
            return
        scale = self._scales.get(factor)
        if scale is not None:
            value = low_rank.scaled(value, scale)
        if factor in self._open:
            self._open[factor] = low_rank.add(self._open[factor], value)
        else:
            self._open[factor] = value
        self._calls[factor] = self._calls.get(factor, 0) + 1

    #: The name of :meth:`accumulate` before 2026-11-27 (a custom block of
    #: docs/kfac.md's example calls it so).
    _accumulate = accumulate

    def captured_rank(self, factor: str) -> Optional[int]:
        """Columns of ``factor`` captured this step in per-sample form (0
        if none yet), or None once it is dense."""
        total = 0
        for store in (self._open, self._step_sums):
            value = store.get(factor)
            if value is None:
                continue
            if not isinstance(value, low_rank.LowRank):
                return None
            total += value.rank
        return total

    def discard_open(self) -> None:
        """Forget what the open micro-batch captured (its parameters'
        gradients were cleared: what it saw is no part of the gradient)."""
        self._open = {}
        self._calls = {}

    def scale_open(self, scales: Dict[str, float]) -> None:
        """Multiply what the open micro-batch captured of each named factor
        (a backward pass scaled by a loss scale ``S``: its gradient
        factors are ``S²`` too large)."""
        for factor, scale in scales.items():
            if factor in self._open:
                self._open[factor] = low_rank.scaled(self._open[factor],
                                                     scale)

    def end_micro_batch(self, passes: int = 1,
                        calls_per_pass: Optional[int] = None) -> None:
        """Close a micro-batch: its factors join the step's sums.

        ``passes`` backward passes ran over the same calls to estimate the
        gradient factors (Monte-Carlo samples, columns of the loss
        Hessian's root): a factor of kind ``OUTPUT_GRADS`` is the mean over
        the calls of one pass (see the module docstring). Where passes
        reach only some of the calls (the exact Fisher's passes of one
        output of several), ``calls_per_pass`` is the number of the
        layer's calls that any pass reached, and the factor the sum over
        the passes divided by it.
        """
        self.resume_capture()       # a restored one not yet on its device
        for factor, value in self._open.items():
            if self.factor_kinds[factor] is FactorKind.OUTPUT_GRADS:
                scale = (passes / self._calls[factor]
                         if calls_per_pass is None else 1.0 / calls_per_pass)
                if scale != 1.0:
                    value = low_rank.scaled(value, scale)
            if factor in self._step_sums:
                self._step_sums[factor] = low_rank.add(
                    self._step_sums[factor], value)
                self._step_counts[factor] += 1
            else:
                self._step_sums[factor] = value
                self._step_counts[factor] = 1
        self.discard_open()
        self._scales = {}

    def captured(self) -> Dict[str, Tuple[object, int]]:
        """``{factor: (sum over micro-batches, number of micro-batches)}``
        of this step's capture, then forget it."""
        self.resume_capture()
        out = {f: (self._step_sums[f], self._step_counts[f])
               for f in self._step_counts}
        self._step_sums = {}
        self._step_counts = {}
        return out

    def reset_capture(self) -> None:
        """Forget everything captured this step and collect nothing (a
        restored capture not yet resumed stays for :meth:`resume_capture`)."""
        self._step_sums = {}
        self._step_counts = {}
        self.discard_open()
        self._scales = {}
        self._collect = frozenset()

    # -- stage 4: factors and inverses --------------------------------------
    def candidate(self, factor: str, value, decay: float = 0.0):
        """The refreshed value of ``factor``: ``value``, or with ``decay``
        the exponential average with the stored factor (of two low-rank
        factors, low rank with both ranks)."""
        old = self.factors.get(factor)
        if old is not None and decay > 0:
            return low_rank.add(low_rank.scaled(old, decay),
                                low_rank.scaled(value, 1.0 - decay))
        return value

    def low_rank_capable(self, factor: str) -> bool:
        """Whether ``factor`` may be captured and inverted in low-rank form
        (:mod:`chainerkfac.low_rank`)."""
        return False

    def _columns_fit(self, factor: str, columns: int) -> bool:
        """Whether ``columns`` more per-sample vectors of ``factor`` are
        kept as such (within :func:`chainerkfac.low_rank.rank_budget`;
        else the call's Gram matrix is formed)."""
        if factor not in self._collect or \
                not self.low_rank_capable(factor):
            return False
        held = self.captured_rank(factor)
        dim = self.factor_shapes()[factor][0]
        return held is not None and held + columns <= \
            low_rank.rank_budget(dim, self.processes)

    def precondition_width(self, factor: str) -> int:
        """Rows of the gradient matrix that ``factor``'s inverse multiplies
        (the other Kronecker factor's dimension): the cost model's ``o``."""
        raise NotImplementedError

    def inverse_requests(self, candidates: Dict[str, object], damping: float
                         ) -> Dict[str, Tuple[object, float]]:
        """``{factor: (matrix, damping)}`` to invert for the refreshed
        ``candidates`` (``damping`` is this block's γ). Factors the block
        cannot invert yet (e.g. the other Kronecker factor is missing) are
        left out."""
        raise NotImplementedError

    def traced_factors(self, candidates: Dict[str, object]) -> List:
        """The factors whose traces :meth:`inverse_requests` reads
        (:func:`chainerkfac.low_rank.mean_eigenvalue`) for these
        ``candidates``: the optimizer reads them all at once first. None
        by default."""
        return []

    def keep_candidate(self, factor: str, value) -> None:
        """Store a refreshed factor that cannot be inverted yet (its
        Kronecker partner is missing); its inverse follows at a later
        refresh."""
        self.factors[factor] = value
        self.refresh_count[factor] += 1

    def commit(self, factor: str, value, result: linalg.InverseResult,
               with_diff: bool = False, refill: bool = False) -> bool:
        """Store a refreshed factor and its inverse.

        A factor whose inverse failed (non-finite, or not positive definite
        at any tried damping) is not stored: the block keeps its previous
        factor and inverse (none on the first step: the block then goes
        unpreconditioned). Returns whether the factor was stored. With
        ``refill`` the new inverse goes into the previous one's arrays where
        it fits them (:func:`chainerkfac.low_rank.refilled`), so that
        whatever reads those arrays — a captured CUDA graph — applies it.
        """
        self.refresh_count[factor] += 1
        if result.inverse is None:
            return False
        old = self.factors.get(factor)
        if with_diff and old is not None:
            old, new = low_rank.dense(old), low_rank.dense(value)
            xp = get_array_module(new)
            denom = float(xp.linalg.norm(old))
            self.diff[factor] = (float(xp.linalg.norm(new - old)) / denom
                                 if denom > 0 else float('inf'))
        self.factors[factor] = value
        inverse = low_rank.inverse_of(value, result.inverse, result.damping)
        if refill:
            inverse = low_rank.refilled(self.inverses.get(factor), inverse)
            if isinstance(inverse, low_rank.WoodburyInverse) and \
                    inverse.columns is not getattr(value, 'columns', None):
                # refilled: the factor's columns are the inverse's again
                # (one d × k array, not two with the same values)
                self.factors[factor] = low_rank.LowRank(inverse.columns)
        self.inverses[factor] = inverse
        self.inverse_damping[factor] = float(result.damping)
        self.inverse_count[factor] += 1
        return True

    def mark_refreshed(self, factor: str, step: int) -> None:
        """Record that ``factor`` was refreshed at K-FAC step ``step`` (its
        staleness counts from there)."""
        self.last_refresh[factor] = int(step)

    def forget_refresh(self, factor: str) -> None:
        """Make ``factor`` due at the next step (a restored state lacks
        it)."""
        self.last_refresh[factor] = -1

    def drop_factors(self) -> None:
        """Forget factors and inverses (a process that no longer owns the
        block); the refresh bookkeeping stays."""
        self._loaded = {}
        self.factors = {}
        self.inverses = {}
        self.inverse_damping = {}

    def has_inverses(self) -> bool:
        return all(n in self.inverses for n in self.factor_names)

    # -- stage 5: precondition ----------------------------------------------
    def regularization_means(self) -> List[float]:
        """μ of eq. (13) for each parameter: where the damping's term
        ``γ(w − μ)`` pulls it (0; BatchNormalization's γ: 1)."""
        return [0.0] * len(self.params)

    def regularized_grads(self, grads: Sequence, damping: float) -> List:
        """∇E = ∇L + γ(w − μ) of eq. (13) for each parameter, the vector
        :meth:`precondition` preconditions; zeros for a parameter without
        a gradient (``None``: frozen, or no backward pass reached it),
        which the step does not move: its γ(w − μ) would move the others
        of its block (a frozen W its bias)."""
        return [get_array_module(p.array).zeros_like(p.array) if g is None
                else regularized_grad(g, p.array, damping, mean=mean)
                for g, p, mean in zip(grads, self.params,
                                      self.regularization_means())]

    def precondition(self, grads: Sequence, damping: float) -> List:
        """Return ``(F + γI)⁻¹ ∇E`` for this block's parameters.

        ``grads`` are the (reduced) gradients ∇L aligned with :attr:`params`;
        ∇E = ∇L + γ(w − μ) (eq. 13) is formed here. ``damping`` is this
        block's γ (already multiplied by :meth:`damping_scale`).
        """
        raise NotImplementedError

    # -- state ----------------------------------------------------------------
    def serialize(self, serializer) -> None:
        """Refresh bookkeeping always; factors (not inverses; symmetric
        ones as their upper triangle) and the damping of their inverses
        where this process holds them.

        Inverses are a function of a factor and its damping: on loading
        they are recomputed (bit for bit, see :meth:`restore_inverses`).
        Loading several files (one per process of a run) merges their
        factors: a file that does not hold a factor leaves it alone.
        """
        saving = not _is_deserializer(serializer)
        self.settle_loaded()
        # 0: not held, 1: held (dense), 2: held low rank (its columns U).
        held = numpy.array(
            [self._loaded[n][1] if n in self._loaded else
             0 if n not in self.factors else
             2 if isinstance(self.factors[n], low_rank.LowRank) else 1
             for n in self.factor_names], dtype=numpy.uint8)
        held = numpy.asarray(serializer('held', held))
        for factor, has in zip(self.factor_names, held):
            self.last_refresh[factor] = int(serializer(
                'last_refresh_' + factor, self.last_refresh[factor]))
            self.refresh_count[factor] = int(serializer(
                'refresh_count_' + factor, self.refresh_count[factor]))
            self.inverse_count[factor] = int(serializer(
                'inverse_count_' + factor, self.inverse_count[factor]))
            if not has:
                continue
            if not saving:
                # read as stored (a packed triangle, low-rank columns),
                # not into the live factor of another shape: loading into
                # an optimizer that holds factors (a roll-back, the same
                # file twice) broadcast (66,) into (11, 11)
                value = None
            elif factor in self._loaded:    # unsettled: as it was stored
                value = self._loaded[factor][0]
            else:
                value = self.factors.get(factor)
                if isinstance(value, low_rank.LowRank):
                    value = value.columns
                elif saving and value is not None and value.ndim == 2:
                    # Symmetric: its upper triangle, half the bytes. The
                    # inverse reads only that triangle (Cholesky), so the
                    # one recomputed on loading is the same bit for bit.
                    value = packing.triu_pack(value)
            value = serializer(factor, value)
            damping = float(serializer(factor + '_damping',
                                       self.inverse_damping.get(factor, 0.0)))
            if not saving:
                self.factors.pop(factor, None)
                self._loaded[factor] = (value, int(has))
                self.inverse_damping[factor] = damping
                self.inverses.pop(factor, None)
        if not saving:
            self.settle_loaded()

    def serialize_capture(self, serializer) -> None:
        """Save or load this step's capture so far (a snapshot inside an
        accumulation): per factor the number of closed micro-batches and
        their sum, as it is held (dense, or a low-rank sum's columns), so
        that the resumed step adds the coming micro-batches to it bit for
        bit. Loaded, it is held back until :meth:`resume_capture` (the
        optimizer starts the step again first)."""
        saving = not _is_deserializer(serializer)
        # saved again before it was resumed (a lazily sized link loaded
        # before its first forward): as it was loaded
        parked = getattr(self, '_restored_capture', None) or {}
        restored = {}
        for factor in self.factor_names:
            value, kind, count = None, 1, 0
            if saving and factor in self._step_counts:
                value = self._step_sums[factor]
                count = self._step_counts[factor]
                if isinstance(value, low_rank.LowRank):
                    value, kind = value.columns, 2
            elif saving and factor in parked:
                value, kind, count = parked[factor]
            count = int(serializer('count_' + factor, count))
            kind = int(serializer('kind_' + factor, kind))
            if not count:
                continue
            restored[factor] = (serializer(factor, value), kind, count)
        if not saving:
            self._restored_capture = restored

    def resume_capture(self) -> None:
        """Take the capture loaded by :meth:`serialize_capture` as this
        step's (after :meth:`start_capture`), on the link's device once
        the link has one (a lazily sized link loaded before its first
        forward: at the next micro-batch's end)."""
        restored = getattr(self, '_restored_capture', None)
        if not restored:
            return
        like = self.params[0].array
        if like is None:
            return
        for factor, (value, kind, count) in restored.items():
            value = linalg.to_device_of(value, like)
            self._step_sums[factor] = (low_rank.LowRank(value) if kind == 2
                                       else value)
            self._step_counts[factor] = count
        self._restored_capture = {}

    def settle_loaded(self) -> None:
        """Set the loaded factors into :attr:`factors` on the link's device
        and in their shapes, once the link has them: at once, or, for a
        lazily sized link loaded before its first forward (a Trainer
        snapshot loads the optimizer before the model), when they are
        next needed."""
        if not self._loaded:
            return
        like = self.params[0].array
        if like is None:
            return
        shapes = self.factor_shapes()
        for factor, (value, has) in self._loaded.items():
            _check_loaded(self.name, factor, value, has, shapes[factor])
            value = linalg.to_device_of(value, like)
            if has == 2:
                value = low_rank.LowRank(value)
            elif len(shapes[factor]) == 2 and value.ndim == 1:
                value = packing.triu_unpack(value, shapes[factor][0])
            self.factors[factor] = value
        self._loaded = {}

    def restore_inverses(self, method: str = 'cholesky') -> List[str]:
        """Recompute the inverses of held factors that lack one (after
        loading), with the damping each was computed with, by ``method``
        (:func:`chainerkfac.linalg.damped_inverses`). Returns the factors
        whose inverse could not be restored."""
        self.settle_loaded()
        missing = [f for f in self.factor_names
                   if f in self.factors and f not in self.inverses]
        if not missing:
            return []
        results = linalg.damped_inverses(
            [low_rank.inversion_matrix(self.factors[f]) for f in missing],
            [self.inverse_damping[f] for f in missing], max_tries=1,
            method=method)
        failed = []
        for factor, result in zip(missing, results):
            if result.inverse is None:
                failed.append(factor)
            else:
                self.inverses[factor] = low_rank.inverse_of(
                    self.factors[factor], result.inverse, result.damping)
        return failed


class PlainBlock(FisherBlock):
    """Parameters K-FAC does not precondition: the plain gradient.

    They travel through the same stages (reduced, "preconditioned" by the
    identity, gathered) and get the same update rule (eq. 19), so every
    parameter belongs to exactly one block.

    Parameters
    ----------
    name, link, options
        As for :class:`FisherBlock`.
    params : list of chainer.Parameter
        The link's own parameters.
    reason : str
        Why this link gets no curvature (shown in the registration table).
    rescaled_weight, output_size : optional
        The weight eq. (20) still concerns, and its d_out (see
        :class:`Unsupported`).
    """

    kind = 'plain gradient'
    factor_kinds: Dict[str, FactorKind] = {}

    def __init__(self, name, link, options=None, params=(), reason='',
                 rescaled_weight=None, output_size=None):
        super().__init__(name, link, options)
        self._params = list(params)
        self.note = reason
        self._rescaled_weight = rescaled_weight
        self._output_size = output_size

    @property
    def params(self):
        return self._params

    @property
    def rescaled_weight(self):
        return self._rescaled_weight

    @property
    def output_size(self):
        return self._output_size

    def factor_shapes(self):
        return {}

    def describe(self) -> str:
        return ''

    def inverse_cost(self):
        return float(sum(p.size for p in self._params if p.array is not None))

    def inverse_requests(self, candidates, damping):
        return {}

    def precondition(self, grads, damping):
        return list(grads)

    def serialize(self, serializer):
        pass


def _check_loaded(block: str, factor: str, value, has: int,
                  shape: Tuple[int, ...]) -> None:
    """Raise ValueError, naming the block and factor, where a loaded
    factor does not fit the model's (a snapshot of another model: it had
    failed in packing, naming neither)."""
    n = shape[0]
    if has == 2:                            # low rank: its columns, n x k
        fits = value.ndim == 2 and value.shape[0] == n
    elif len(shape) == 2 and value.ndim == 1:   # a packed triangle
        fits = value.size == n * (n + 1) // 2
    else:
        fits = tuple(value.shape) == tuple(shape)
    if not fits:
        raise ValueError(
            'K-FAC state of {}: the snapshot\'s factor {} has shape {}, '
            'which does not fit this model\'s {} ({}): the snapshot is of '
            'another model or other layer sizes'.format(
                block, factor, tuple(value.shape), 'x'.join(map(str, shape)),
                'stored as its upper triangle, {} elements'.format(
                    n * (n + 1) // 2) if len(shape) == 2 else 'a diagonal'))


def _is_deserializer(serializer) -> bool:
    from chainer import serializer as serializer_module
    return isinstance(serializer, serializer_module.Deserializer)

"""Stages 1-2: K-FAC's factors, estimated from the backward passes of the
links the optimizer was set up on.

:class:`CurvatureEstimator` listens to a
:class:`~chainerkfac.capture.BackwardCapture` and hands each call to the
block of its link, for the factors due this step. What counts for one
optimizer step is exactly what makes up the gradient that step uses:

* a **gradient pass** (the backward of the loss, run by the user's loop or
  by ``update(lossfun)``) gives the factors of kind ``INPUTS`` of every call
  it runs through and, with the empirical Fisher, the gradient factors;
* a pass that meets a link whose gradients were **cleared** since its last
  pass (``cleargrads()``, as every Chainer loop does before the backward of
  the loss it updates with) first forgets what that link captured since the
  last update: a GAN's generator loss backpropagated through the
  discriminator after the discriminator's update enters neither the
  discriminator's factors (its next ``cleargrads`` drops it) nor, the other
  way round, the discriminator's loss the generator's;
* with ``fisher='mc'`` or ``'exact'`` the gradient factors come from
  **Fisher passes** the estimator runs itself from the logits of the loss:
  ``mc_samples`` passes with labels drawn from the model's softmax, or one
  pass per class with a column of the loss Hessian's symmetric root
  (KFLR's ``G``, exact). They need the loss function: ``update(lossfun,
  ...)``. A loss of several outputs (heads, the time steps of a sequence)
  is the sum of its negative log-likelihoods ``ℓ_kn`` with weights
  ``w_kn = ∂loss/∂ℓ_kn`` (a head's coefficient, ``1/count`` of a mean,
  0 for an ignored label, a class weight), read from the loss's own
  backward pass: the passes estimate its generalised Gauss-Newton matrix
  ``Σ_kn w_kn J_knᵀ H_kn J_kn`` (every output sampled independently in
  one pass, each row scaled by ``√w_kn``; exactly, one pass per output
  and class).

Each ``update`` call closes a micro-batch (:meth:`end_micro_batch`).
"""
import logging
from typing import Dict, List, Optional

import numpy

import chainer
import chainer.functions as F
from chainer.functions.activation import log_softmax as log_softmax_module
from chainer.functions.activation import softmax as softmax_module
from chainer.functions.math import basic_math
from chainer.functions.math import sum as sum_module

from chainerkfac import capture as capture_module
from chainerkfac import fisher_blocks
from chainerkfac import sampling
from chainerkfac.fisher_blocks import FactorKind

logger = logging.getLogger(__name__)


class LabelSampler:
    """Labels drawn from a categorical model's softmax (the MC Fisher).

    Parameters
    ----------
    seed : int, optional

    Attributes
    ----------
    rng : numpy.random.RandomState
        The sampler's own generator (seeded by ``seed``, saved in
        snapshots).
    source : numpy.random.Generator or RandomState, optional
        Where the draws come from instead of :attr:`rng`, when set: a
        training harness sets one derived from the position in the data
        for each micro-batch, so that a run resumed on another number of
        processes draws the same labels.
    """

    def __init__(self, seed: Optional[int] = None):
        self.rng = numpy.random.RandomState(seed)
        self.source = None

    def sample(self, logits):
        """One label per row drawn from ``softmax(logits)`` (int32, on the
        device of ``logits``)."""
        probs = chainer.backend.CpuDevice().send(
            F.softmax(logits.astype(numpy.float64)).array)
        rng = self.rng if self.source is None else self.source
        draws = rng.random((probs.shape[0], 1))
        labels = sampling.inverse_cdf(probs, draws[:, 0]).astype(numpy.int32)
        return chainer.backend.get_device_from_array(logits).send(labels)

    def serialize(self, serializer) -> None:
        name, keys, position, has_gauss, gauss = self.rng.get_state()
        keys = serializer('mc_rng_keys', keys)
        position = int(serializer('mc_rng_position', position))
        self.rng.set_state((name, numpy.asarray(keys, numpy.uint32),
                            position, has_gauss, gauss))


def softmax_hessian_root(logits):
    """The symmetric roots ``S_n = diag(√p_n) − p_n √p_nᵀ`` of the Hessians
    ``diag(p_n) − p_n p_nᵀ`` of the softmax cross-entropy w.r.t. the logits
    (``p_n = softmax(logits_n)``), as an array (N, C, C): column ``c`` of
    ``S_n`` is ``root[n, :, c]``; ``S_n S_nᵀ`` is the Hessian."""
    xp = chainer.backend.get_array_module(logits)
    p = F.softmax(logits).array
    sqrt_p = xp.sqrt(p)
    root = -p[:, :, None] * sqrt_p[:, None, :]
    diagonal = xp.arange(p.shape[1])
    root[:, diagonal, diagonal] += sqrt_p
    return root


class CurvatureEstimator:
    """Capture and factor estimation of one optimizer.

    Parameters
    ----------
    fisher : {'emp', 'mc', 'exact'}
    mc_samples : int
        Label draws per micro-batch for ``fisher='mc'``.
    loss_reduction : {'mean', 'sum'}
    seed : int, optional
        Of the label sampler.
    """

    def __init__(self, fisher: str = 'emp', mc_samples: int = 1,
                 loss_reduction: str = 'mean', seed: Optional[int] = None):
        self.fisher = fisher
        self.mc_samples = mc_samples
        self.loss_reduction = loss_reduction
        self.label_sampler = LabelSampler(seed)
        self.blocks: List = []
        #: ``{id(weight): (function types, block)}`` (the capture's routes).
        self.routes: Dict[int, tuple] = {}
        self._capture = capture_module.BackwardCapture(self)
        self._due: Dict = {}
        self._gradient_due: Dict = {}
        self._touched: Dict = {}
        self._passes = 1
        #: fisher='exact': each block's calls the Fisher passes reached
        #: (their ids): its passes, one output's each, reach only the calls
        #: of that output; calls no output reaches count in none.
        self._pass_calls: Dict = {}
        #: The pass and the block :attr:`batch_size` was learned from.
        self._batch_pass: Optional[int] = None
        self._batch_block = None
        # pass index / block -> the first axis's length of what the pass's
        # F.sum summed (None: not known)
        self._summed_passes: Dict[int, Optional[int]] = {}
        #: loss_reduction='sum': the passes from a batch-mean loss (the
        #: function's name), refused if the step's batch comes from one.
        self._mean_passes: Dict[int, object] = {}
        self._summed_blocks: Dict[object, Optional[int]] = {}
        #: Samples of the open micro-batch (first axis of the first routed
        #: call's input), and of the step so far.
        self.batch_size: Optional[int] = None
        self.samples = 0
        #: The blocks whose backward passes this step came with no sample
        #: (an empty micro-batch: nothing captured, no warning for it).
        self.empty_blocks: set = set()
        #: Micro-batches of the step so far that had no sample.
        self.empty_micro_batches = 0
        self._empty_seen = False
        #: The sizes of the step's micro-batches so far, and whether
        #: unequal ones were warned about (once).
        self._sizes: set = set()
        self._warned_sizes = False
        #: The counts the step's micro-batches' mean losses divided by
        #: (softmax / sigmoid cross-entropy), the open one's, whether
        #: unequal ones were warned about (once), and the capturing steps
        #: left to check (reading a count on a GPU waits for it).
        self._normalisers: set = set()
        self._open_normaliser: Optional[float] = None
        self._warned_normalisers = False
        self._normaliser_checks = NORMALISER_CHECKS
        #: Whether a loss scaled by a constant is still checked for the
        #: batch's length (``F.sum(l) / N``, ``F.mean(l) * N``): at the
        #: first micro-batch only, whose size is the run's own (a later
        #: batch whose size happens to equal a constant of the loss, a
        #: last one of 2 under ``2 * loss``, is not refused mid-run).
        self._scaled_checks = True

    # -- copies (copy.deepcopy, pickle) ---------------------------------------
    def __getstate__(self):
        """The state without the function hook: a copy gets a hook of its
        own (:meth:`__setstate__`); the original's, copied, would still
        answer to the original and never be in the hooks."""
        state = self.__dict__.copy()
        capture = state.pop('_capture')
        state['_capture_state'] = (capture.installed, capture.record_graph,
                                   capture.record_logits,
                                   capture._logits_types)
        return state

    def __setstate__(self, state) -> None:
        installed, record_graph, record_logits, logits_types = state.pop(
            '_capture_state')
        self.__dict__.update(state)
        self._capture = capture_module.BackwardCapture(self)
        self._capture.record_graph = record_graph
        if record_logits:
            self._capture.start_recording_logits(logits_types)
        self.refresh_routes()       # routes are keyed by the parameters' ids
        if installed:
            self._capture.install()

    @property
    def needs_loss_function(self) -> bool:
        """Whether the Fisher passes need ``update(lossfun, ...)``."""
        return self.fisher != 'emp'

    def setup(self, blocks) -> None:
        self.blocks = list(blocks)
        self.refresh_routes()

    def refresh_routes(self) -> None:
        """Route by the blocks' weights (after lazily initialised links got
        their parameters, the parameter objects are the same)."""
        self.routes = {id(b.params[0]): (b.function_types, b)
                       for b in self.blocks if b.function_types}

    @property
    def capture_hook(self) -> capture_module.BackwardCapture:
        """The function hook that captures this estimator's calls (in the
        thread's function hooks while something is to be captured)."""
        return self._capture

    # -- steps ----------------------------------------------------------------
    def start_step(self, due, record_graph: bool = False) -> None:
        """Collect the factors ``due`` (``{block: names}``) from now on;
        the hook stays installed only while something is to be captured."""
        self._due = {b: frozenset(n) for b, n in due.items() if n}
        self._gradient_due = {
            b: names for b, names in self._due.items()
            if any(not b.factor_kinds[n].forward for n in names)}
        for block in self.blocks:
            block.start_capture(self._due.get(block, ()))
        self._touched = {}
        self._passes = 1
        self.batch_size = None
        self.samples = 0
        self.empty_blocks = set()
        self.empty_micro_batches = 0
        self._empty_seen = False
        self._sizes = set()
        self._normalisers = set()
        self._open_normaliser = None
        if self._normaliser_checks and (self._due or record_graph):
            self._normaliser_checks -= 1
        self._capture.record_graph = record_graph
        if not record_graph:
            self._capture.clear_graph()
        if self._due or record_graph or self.loss_reduction == 'sum':
            self._capture.install()
        else:
            # A stale step captures nothing: no hook on every function.
            self._capture.remove()

    @property
    def due(self) -> Dict:
        """``{block: names}`` of the factors due this step."""
        return dict(self._due)

    @property
    def capturing(self) -> bool:
        """Whether this step's capture has begun (a routed call was seen)."""
        return self.batch_size is not None or self.samples > 0

    @property
    def graph(self) -> List:
        """The function nodes of the backward passes since recording began
        (:class:`chainerkfac.capture.GraphNode`)."""
        return self._capture.graph

    def clear_graph(self) -> None:
        """Forget the graph recorded so far (recording goes on)."""
        self._capture.clear_graph()

    def stop_recording_graph(self) -> None:
        self._capture.record_graph = False
        self._capture.clear_graph()

    def end_micro_batch(self) -> None:
        """Close the micro-batch of the calls since the last one.

        Raises
        ------
        ValueError
            if the backward pass of a loss that sums over the mini-batch
            contributed (``loss_reduction='mean'``).
        """
        batch = self.batch_size
        summed = [n for n in self._summed_blocks.values()
                  if n is None or batch is None or n == batch]
        mean = self._mean_passes.get(self._batch_pass)
        self._summed_blocks, self._summed_passes = {}, {}
        self._mean_passes = {}
        if summed:
            raise ValueError(_SUMMED_LOSS.format(batch))
        if mean is not None and _is_mean_loss(mean, batch,
                                              self._scaled_checks):
            raise ValueError(_MEAN_LOSS.format(type(mean).__name__))
        if self.fisher == 'emp':
            self._unscale_gradient_factors()
        self._check_size()
        self._check_normaliser()
        self._scaled_checks = False
        for block in self._due:
            if self.fisher == 'exact':
                block.end_micro_batch(self._passes,
                                      len(self._pass_calls.get(block, ())) or
                                      1)
            else:
                block.end_micro_batch(self._passes)
        self.samples += self.batch_size or 0
        if self.batch_size is None and self._empty_seen:
            self.empty_micro_batches += 1
        self._empty_seen = False
        self.batch_size = None
        self._passes = 1
        self._pass_calls = {}
        self._touched = {}

    def _check_size(self) -> None:
        """Warn (once) where a step's micro-batches differ in size: each
        micro-batch's mean counts alike in the step's factors and gradient
        (as ChainerMN averages processes), so the step is the mean of their
        means, not the mean over their samples."""
        size = self.batch_size
        if not size:
            return
        if self._sizes and size not in self._sizes and \
                not self._warned_sizes:
            self._warned_sizes = True
            sizes = sorted(self._sizes | {size})
            logger.warning(
                'K-FAC: micro-batches of %s samples in one step: each '
                "micro-batch's mean counts alike in the step's factors and "
                'gradient (as ChainerMN averages processes), so the step '
                'is the mean of their means, not that of one batch of '
                'their samples; micro-batches of one size give that '
                '(warned once)', ', '.join(map(str, sizes)))
        self._sizes.add(size)

    def _check_normaliser(self) -> None:
        """Warn (once) where a step's micro-batches' mean losses divide by
        different counts (``ignore_label`` labels, which
        ``softmax_cross_entropy`` leaves out of its count): each
        micro-batch's mean counts alike, so the step is not that of one
        batch of their samples even where their sizes agree."""
        count, self._open_normaliser = self._open_normaliser, None
        if count is None:
            return
        if self._normalisers and count not in self._normalisers and \
                not self._warned_normalisers:
            self._warned_normalisers = True
            logger.warning(
                "K-FAC: the micro-batches' mean losses of one step divide "
                'by %s labels (ignore_label leaves some out of the count): '
                "each micro-batch's mean counts alike in the step's "
                'factors and gradient, so the step is the mean of their '
                'means, not that of one batch of their samples; '
                'softmax_cross_entropy(..., normalize=False) divides by '
                'the rows and gives that (warned once)', ', '.join(
                    '{:g}'.format(c) for c in sorted(self._normalisers |
                                                     {count})))
        self._normalisers.add(count)

    def _unscale_gradient_factors(self) -> None:
        """A backward pass started from a loss scale ``S``
        (``loss.backward(loss_scale=S)``, Chainer's loss scaling: Chainer
        records it on the parameters) captured output gradients ``S`` times
        too large: its gradient factors are divided by ``S²``."""
        for block, names in self._gradient_due.items():
            scale = getattr(block.params[0], '_loss_scale', None)
            if scale is None or scale == 1:
                continue
            block.scale_open({n: 1.0 / float(scale) ** 2 for n in names
                              if not block.factor_kinds[n].forward})

    def discard_micro_batch(self) -> None:
        """Forget the open micro-batch (it is computed again)."""
        for block in self._due:
            block.discard_open()
        self.batch_size = None
        self._empty_seen = False
        self._touched = {}
        self._pass_calls = {}
        self._summed_blocks = {}
        self._open_normaliser = None

    def close(self) -> None:
        """Take the hook out (the optimizer is done with)."""
        self._capture.remove()

    # -- the listener of the capture ------------------------------------------
    def on_pass(self, function, pass_info) -> None:
        if self._normaliser_checks and not pass_info.explicit:
            count = _mean_loss_count(function)
            if count is not None:
                self._open_normaliser = count
        if self.loss_reduction == 'mean' and _is_summed_loss(
                function, scaled=self._scaled_checks):
            # Refused if what it captures is still part of the update
            # (other passes, e.g. for input gradients, may sum).
            self._summed_passes[pass_info.index] = _summed_length(function)
        if self.loss_reduction == 'sum' and _is_mean_loss(
                function, scaled=self._scaled_checks):
            self._mean_passes[pass_info.index] = function

    def on_backward(self, block, function, in_data, out_grad, pass_info):
        if in_data[0] is not None and in_data[0].shape[:1] == (0,):
            # an empty micro-batch (a rank's share at an epoch's end): no
            # sample to capture (a factor of 0/0); the factors stay due
            self.empty_blocks.add(block)
            self._empty_seen = True
            return
        names = self._due.get(block)
        if pass_info.explicit:
            if names and block in self._gradient_due:
                block.capture_gradients(function, in_data, out_grad)
                if self.fisher == 'exact':
                    self._pass_calls.setdefault(block, set()).add(
                        id(function))
            return
        if self.batch_size is None or (
                pass_info.index != self._batch_pass and
                self._batch_block.params[0].grad_var is None):
            # the first pass of the micro-batch; or a later one after the
            # gradients of the pass learned from were cleared (a diagnostic
            # pass on other samples, another model's loss): it is no part
            # of the update
            self._learn_batch(int(in_data[0].shape[0]))
            self._batch_pass, self._batch_block = pass_info.index, block
        if not names:
            return
        if self._touched.get(block) != pass_info.index:
            self._touched[block] = pass_info.index
            if block.params[0].grad_var is None:
                # Cleared since the last pass: what the link captured
                # before is no part of the gradient of this update.
                block.discard_open()
                self._summed_blocks.pop(block, None)
            if pass_info.index in self._summed_passes:
                self._summed_blocks[block] = \
                    self._summed_passes[pass_info.index]
        if block.collects(FactorKind.INPUTS):
            if in_data[0] is None:
                raise RuntimeError(
                    'K-FAC: {} ({}) captures its layer inputs when the '
                    'backward pass runs through {}, but that function did '
                    'not retain its first input'.format(
                        block.name, type(block).__name__,
                        type(function).__name__))
            block.capture_inputs(function, in_data)
        if self.fisher == 'emp' and block in self._gradient_due:
            block.capture_gradients(function, in_data, out_grad)

    def _learn_batch(self, batch: int) -> None:
        self.batch_size = batch
        if self.loss_reduction == 'sum' and self.fisher == 'emp':
            # A summed loss delivers per-sample output gradients N times
            # larger than a mean's: gradient factors are quadratic in them.
            scale = 1.0 / float(batch) ** 2
            for block, names in self._gradient_due.items():
                block.scale_capture({n: scale for n in names
                                     if not block.factor_kinds[n].forward})

    # -- update(lossfun, ...) --------------------------------------------------
    def run_loss(self, lossfun, args, kwds, params, loss_scale=None) -> None:
        """The micro-batch of ``update(lossfun, *args, **kwds)``: the loss,
        its backward pass (gradients into ``param.grad``), then the Fisher
        passes of ``fisher='mc'`` / ``'exact'``.

        Parameters
        ----------
        params : list of chainer.Parameter
            The optimizer's parameters (the Fisher passes differentiate
            w.r.t. them only, leaving every ``grad`` as it is).
        loss_scale : float, optional
            The optimizer's loss scale (Chainer's loss scaling): the
            backward pass starts from it.
        """
        fisher_passes = self.fisher != 'emp' and bool(self._gradient_due)
        if fisher_passes:
            self._capture.start_recording_logits(
                fisher_blocks.logits_functions())
        try:
            loss = lossfun(*args, **kwds)
        finally:
            self._capture.record_logits = False
        try:
            loss.backward(loss_scale=loss_scale)
        except BaseException:
            self._capture.forget_logits()
            raise
        # after the backward pass, which tells the batch's size
        if self.loss_reduction == 'mean' and _is_summed_loss(
                loss.creator, self.batch_size, self._scaled_checks):
            raise ValueError(_SUMMED_LOSS.format(self.batch_size))
        if self.loss_reduction == 'sum' and _is_mean_loss(
                loss.creator, self.batch_size, self._scaled_checks):
            raise ValueError(_MEAN_LOSS.format(type(loss.creator).__name__))
        if self.loss_reduction == 'sum' and self.batch_size is None and \
                not self._empty_seen:
            raise RuntimeError(
                "KFAC(loss_reduction='sum') takes the batch size from the "
                'first modelled layer (Linear, Convolution2D, '
                'BatchNormalization); the loss called none')
        if fisher_passes:
            try:
                outputs = self._outputs_of(loss, loss_scale)
            finally:
                self._capture.forget_logits()
            self._fisher_passes(outputs, params)

    def _outputs_of(self, loss, loss_scale=None) -> list:
        """The outputs the Fisher passes sample from, as ``(logits,
        root_weights)``: the input of each logits-function call the loss
        comes from on a modelled layer's output (no modelled layer between
        it and the loss), and per row ``√(w_n / (S N))``, with ``w_n =
        ∂loss/∂ℓ_n`` the row's weight in the loss, ``N`` the captured
        batch and ``S`` 1 for a batch-mean loss, ``N`` for a sum: the
        scale at which a pass gives the factors of the loss's generalised
        Gauss-Newton matrix in the capture's batch-mean convention (for a
        plain mean, ``1/N`` per row)."""
        calls = self._capture.logits_calls_of(loss)
        if not calls:
            raise RuntimeError(
                "fisher='{}' needs the logits: the loss (its last "
                'operation {}) must apply one of {} to the model\'s output '
                '(register others with '
                'chainerkfac.fisher_blocks.register_logits_function); '
                "for a regression loss use fisher='emp'".format(
                    self.fisher, type(loss.creator).__name__
                    if loss.creator is not None else 'none',
                    ', '.join(t.__name__
                              for t in fisher_blocks.logits_functions())))
        outputs = []
        for call in calls:
            logits = self._logits_of_call(loss, call)
            if logits is None:
                continue
            weights = _row_weights(call, self._capture.logits_grads(call),
                                   self.fisher)
            if weights is None:
                continue         # no gradient reached it: no weight
            if loss_scale is not None:
                weights = weights / float(loss_scale)
            outputs.append((logits, weights))
        rows = sum(len(logits) for logits, _ in outputs)
        if not outputs:
            raise RuntimeError(
                "fisher='{}': none of the loss's logits ({} calls of {}) "
                'comes from a modelled layer of the optimizer\'s model'
                .format(self.fisher, len(calls), ', '.join(sorted(
                    {type(c).__name__ for c in calls}))))
        if rows == 0 or not self.batch_size:
            return []            # an empty micro-batch: nothing to capture
        scale = float(self.batch_size) * (
            float(self.batch_size) if self.loss_reduction == 'sum' else 1.0)
        return [(logits, (weights / scale) ** 0.5)
                for logits, weights in outputs]

    def _logits_of_call(self, loss, call):
        """The logits of one logits-function call of the loss, None if
        no modelled layer computes them (a teacher's, say), refused if the
        call is inside the model."""
        logits_node = call.inputs[0]
        if not any(len(n.inputs) >= 2 and id(
                n.inputs[1].get_variable_or_none()) in self.routes
                for n in capture_module.graph_of(logits_node)):
            return None
        inside = [f for f in capture_module.functions_between(loss, call)
                  if len(f.inputs) >= 2 and
                  id(f.inputs[1].get_variable_or_none()) in self.routes]
        if inside:
            raise RuntimeError(
                "fisher='{}': the loss's {} call is inside the model, not "
                'on its output: its output goes through {} before the '
                "loss (a softmax gate, or attention). Use fisher='emp', "
                'or apply the loss to the model\'s logits'.format(
                    self.fisher, type(call).__name__, ', '.join(
                        type(f).__name__ for f in inside[:3])))
        logits = logits_node.get_variable()
        if logits.array is None:
            # F.log_softmax and F.softmax keep their output, not their input
            # (whose variable the loss function let go): logits up to a
            # constant per sample, which neither the sampled distribution
            # nor the gradients of eq. (9)'s passes see
            logits.array = _logits_from_output(call)
        if logits.array is None:
            raise RuntimeError(
                "fisher='{}': the {} call of the loss did not keep its input "
                '(the logits the Fisher passes sample from): apply '
                'F.softmax_cross_entropy or F.log_softmax to the logits'
                .format(self.fisher, type(call).__name__))
        if logits.ndim != 2:
            raise RuntimeError(
                "fisher='{}': the {} call of the loss takes logits of shape "
                '{}; the Fisher passes take (rows, classes): reshape them '
                '(F.rollaxis and F.reshape) before the loss'.format(
                    self.fisher, type(call).__name__, logits.shape))
        return logits

    def _fisher_passes(self, outputs, params) -> None:
        """The passes of ``outputs`` (:meth:`_outputs_of`)."""
        if not outputs:
            return
        inputs = [p for p in params
                  if p.array is not None and p.requires_grad]
        if self.fisher == 'mc':
            # One pass per draw: every output's rows with labels drawn from
            # its softmax, each row's loss scaled by its root weight (the
            # draws of different outputs and rows are independent and of
            # mean zero, so the products across them vanish in expectation).
            weight = 1.0 / self.mc_samples
            for _ in range(self.mc_samples):
                losses = [F.softmax_cross_entropy(
                    logits, self.label_sampler.sample(logits.array),
                    reduce='no') for logits, _ in outputs]
                if self.mc_samples > 1:
                    self._scale_gradient_capture(weight)
                with self._capture.explicit_pass():
                    chainer.grad(losses, inputs, grad_outputs=[
                        root.astype(logits.dtype, copy=False)
                        for logits, root in outputs])
            self._passes = self.mc_samples
            return
        # 'exact': per output, one pass per class with column c of S_n
        # times the row's root weight (1/N per sample for a mean loss): the
        # capture scales output gradients by N (per-sample gradients of a
        # mean loss), so G = (1/N) Σ_n Σ_c J_nᵀ S_nc S_ncᵀ J_n for one plain
        # output. Outputs go in passes of their own: a pass of two would
        # add the products across them.
        passes = 0
        for logits, weights in outputs:
            root = softmax_hessian_root(logits.array)
            weights = weights.astype(root.dtype, copy=False)[:, None]
            for c in range(root.shape[1]):
                column = chainer.Variable(root[:, :, c] * weights)
                with self._capture.explicit_pass():
                    chainer.grad([logits], inputs, grad_outputs=[column])
            passes += root.shape[1]
        self._passes = passes

    def _scale_gradient_capture(self, scale: float) -> None:
        for block, names in self._gradient_due.items():
            block.scale_capture({n: scale for n in names
                                 if not block.factor_kinds[n].forward})


def _row_weights(call, out_grad, fisher: str):
    """``w_n = ∂loss/∂ℓ_n`` for each row of a logits call's input (None
    where no gradient reached the call), from
    the gradients its outputs got in the loss's backward pass (with the
    loss scale): ``ℓ_n`` the row's negative log-likelihood. Softmax
    cross-entropy: the output's gradient over the rows its reduction
    divides by, 0 for an ignored label, times a class weight. Log-softmax:
    ``−Σ_c ∂loss/∂log p_nc`` (exact where the loss is linear in the
    log-probabilities: ``−Σ_c q_c log p_c`` with any ``q``); softmax:
    the same through ``p ∂loss/∂p``."""
    from chainer.functions.loss import softmax_cross_entropy as sce
    grad = None if out_grad is None else out_grad[0]
    if grad is None:
        return None
    rows = call.inputs[0].shape[0]
    xp = chainer.backend.get_array_module(grad)
    if rows == 0:               # an empty micro-batch
        return xp.zeros((0,), numpy.float64)
    grad = grad.astype(numpy.float64, copy=False)
    if isinstance(call, sce.SoftmaxCrossEntropy):
        t = call.inputs[1].data
        if call.soft_target:
            # −Σ_c q_c log p_c (or the KL divergence): the Hessian in the
            # logits is Σ_c q_c times the softmax's
            weights = grad * call._coeff if call.reduce == 'mean' else grad
            weights = weights * t.astype(numpy.float64).reshape(
                rows, -1).sum(axis=1)
        else:
            valid = (t != call.ignore_label).reshape(rows, -1)
            if call.reduce == 'mean':
                weights = valid.astype(numpy.float64) * (grad * call._coeff)
            else:
                weights = valid * grad.reshape(rows, -1)
            if call.class_weight is not None:
                class_weight = xp.asarray(call.class_weight, numpy.float64)
                weights = weights * class_weight[
                    (t * (t != call.ignore_label)).reshape(rows, -1)]
            weights = weights.sum(axis=1)
    elif isinstance(call, softmax_module.Softmax):
        p = call.output_data[0].astype(numpy.float64, copy=False)
        weights = -(p * grad).reshape(rows, -1).sum(axis=1)
    else:
        weights = -grad.reshape(rows, -1).sum(axis=1)
    scale = float(abs(weights).max()) if rows else 0.0
    if rows and float(weights.min()) < -1e-7 * scale:
        raise RuntimeError(
            "fisher='{}' takes a loss that adds up the negative "
            'log-likelihoods of its outputs with weights of at least 0 (a '
            'mean, a sum, heads with their coefficients); the loss '
            'decreases with the likelihood of the {} call\'s rows (weight '
            "{:.3g}): use fisher='emp'".format(
                fisher, type(call).__name__, float(weights.min())))
    return xp.maximum(weights, 0.0)


def _logits_from_output(call):
    """Logits (up to a constant per sample) from the kept output of a
    LogSoftmax (itself) or Softmax call (its log), or None."""
    kept = getattr(call, 'output_data', None)
    if not kept or kept[0] is None:
        return None
    if isinstance(call, log_softmax_module.LogSoftmax):
        return kept[0]
    if isinstance(call, softmax_module.Softmax):
        xp = chainer.backend.get_array_module(kept[0])
        with numpy.errstate(divide='ignore'):
            return xp.log(kept[0])
    return None


#: Capturing steps at whose micro-batches the mean losses' counts are
#: compared (:meth:`CurvatureEstimator._check_normaliser`; a GPU waits for
#: each count read).
NORMALISER_CHECKS = 10


_SUMMED_LOSS = (
    'K-FAC: the loss looks like a sum over the mini-batch (its last '
    'operation is F.sum, of an array whose first axis has the batch\'s '
    'length, {}, or a batch mean times that length), but K-FAC scales the '
    'factors for a batch-mean loss. Use '
    "a mean (F.mean, or reduce='mean' in the loss function), or "
    "KFAC(loss_reduction='sum'). If it sums something else (the losses "
    'of as many time steps, say), write that sum as a Python sum() or '
    'F.add of the terms.')


_MEAN_LOSS = (
    "K-FAC(loss_reduction='sum') scales the factors for a loss summed over "
    'the mini-batch, but the loss looks like a batch mean (its last '
    "operation is {}): use loss_reduction='mean' (the default), or a sum "
    "(reduce='no' and F.sum, or F.sum in place of F.mean). If it averages "
    'something else whose count is the batch\'s (as many time steps), '
    'write that mean as sum(terms) / T.')


def _mean_loss_count(function) -> Optional[float]:
    """The count a softmax or sigmoid cross-entropy with ``reduce='mean'``
    divided its sum by (its labels less the ignored ones, or its rows with
    ``normalize=False``), or None for another function."""
    from chainer.functions.loss import sigmoid_cross_entropy
    from chainer.functions.loss import softmax_cross_entropy
    if getattr(function, 'reduce', None) != 'mean':
        return None
    if isinstance(function, softmax_cross_entropy.SoftmaxCrossEntropy):
        coeff = getattr(function, '_coeff', None)
        return None if coeff is None else round(1.0 / float(coeff), 6)
    if isinstance(function, sigmoid_cross_entropy.SigmoidCrossEntropy):
        count = getattr(function, 'count', None)
        return None if count is None else float(count)
    return None


def _is_mean_loss(function, batch: Optional[int] = None,
                  scaled: bool = True) -> bool:
    """Whether ``function`` (a loss's creator) is a batch mean Chainer
    writes so: ``softmax_cross_entropy`` / ``sigmoid_cross_entropy`` with
    ``reduce='mean'``, ``mean_squared_error``, ``mean_absolute_error``,
    ``F.mean`` of an array whose first axis has the batch's length (where
    known; a mean over time steps passes), or ``F.sum`` of such an array
    divided by that length."""
    from chainer.functions.loss import mean_absolute_error
    from chainer.functions.loss import mean_squared_error
    from chainer.functions.loss import sigmoid_cross_entropy
    from chainer.functions.loss import softmax_cross_entropy
    from chainer.functions.math import average
    if isinstance(function, (softmax_cross_entropy.SoftmaxCrossEntropy,
                             sigmoid_cross_entropy.SigmoidCrossEntropy)):
        return getattr(function, 'reduce', None) == 'mean'
    if isinstance(function, (mean_squared_error.MeanSquaredError,
                             mean_absolute_error.MeanAbsoluteError)):
        return True
    if scaled and isinstance(function, basic_math.MulConstant) and \
            function.inputs:
        # F.sum(losses) / N: a sum over the batch's rows divided by them
        inner = function.inputs[0].creator
        length = _summed_length(inner) if inner is not None else None
        return bool(length) and _is_summed_loss(inner, batch) and \
            _is_scalar(function.value) and \
            abs(float(function.value) * length - 1.0) < 1e-9
    if isinstance(function, average.Mean) and function.inputs:
        shape = function.inputs[0].shape
        return bool(shape) and (batch is None or shape[0] == batch) and \
            function.axis in (None, (0,), 0)
    return False


def _is_scalar(value) -> bool:
    return numpy.ndim(value) == 0 and numpy.isrealobj(value)


def sums_over_batch(loss, batch: Optional[int]) -> bool:
    """Whether the scalar ``loss`` (a Variable) looks like a sum over a
    batch of ``batch`` samples rather than their mean: its last operation
    ``F.sum`` of an array whose first axis has that length, not a mean
    written as a sum (:func:`_is_summed_loss`)."""
    return _is_summed_loss(loss.creator, batch)


def _is_summed_loss(function, batch: Optional[int] = None,
                    scaled: bool = True) -> bool:
    """Whether ``function`` (a loss's creator) sums into a scalar an
    array whose first axis has the batch's length ``batch`` (where
    known), and is not a mean written as a sum
    (:func:`_is_mean_as_sum`). A guess from the last operation: a sum
    over other things (time steps) of batch means passes where their
    count is not the batch's. A batch mean times the batch's length
    (``F.mean(losses) * N``) is a sum too."""
    if scaled and _is_scaled_mean(function, batch):
        return True
    if not isinstance(function, sum_module.Sum):
        return False
    outputs = [o() for o in function.outputs]
    if not all(o is not None and o.shape == () for o in outputs):
        return False
    length = _summed_length(function)
    if batch is not None and length is not None and length != batch:
        return False
    return not _is_mean_as_sum(function)


def _is_scaled_mean(function, batch: Optional[int] = None) -> bool:
    """``F.mean(losses) * N`` (or a softmax cross-entropy's mean times N),
    ``N`` > 1 the number of what the mean averaged, one value a sample
    (the batch's, where known): a sum over the batch. A mean over several
    values a sample (a squared error over D outputs) times N is not told
    from one times D, and passes."""
    from chainer.functions.loss import softmax_cross_entropy
    from chainer.functions.math import average
    if not isinstance(function, basic_math.MulConstant) or \
            not function.inputs or not _is_scalar(function.value):
        return False
    inner = function.inputs[0].creator
    rows = _first_axis(inner)
    if not rows or rows == 1 or (batch is not None and rows != batch):
        return False
    shape = inner.inputs[0].shape
    if isinstance(inner, average.Mean):
        one_a_sample = int(numpy.prod(shape)) == rows
    else:
        one_a_sample = isinstance(
            inner, softmax_cross_entropy.SoftmaxCrossEntropy) and \
            len(shape) == 2
    return one_a_sample and _is_mean_loss(inner, rows) and \
        abs(float(function.value) - rows) < 1e-9 * rows


def _first_axis(function) -> Optional[int]:
    """The length of the first axis of ``function``'s first input (0 for
    a 0-d array; None where not known)."""
    node = function.inputs[0] if function is not None and \
        function.inputs else None
    shape = node.shape if node is not None else None
    if shape is None:
        return None
    return int(shape[0]) if shape else 0


def _summed_length(function) -> Optional[int]:
    """The length of the first axis of what an ``F.sum`` node summed, or
    a scaled mean averaged (:func:`_is_scaled_mean`) (0 for a 0-d array;
    None where not known)."""
    if isinstance(function, basic_math.MulConstant):
        return _first_axis(function.inputs[0].creator
                           if function.inputs else None)
    return _first_axis(function)


def _is_mean_as_sum(function) -> bool:
    """``F.sum(x * c)`` with ``c = ±1/n``, ``n`` the number of ``x``'s
    elements: a mean. Chainer's ``softmax_cross_entropy(...,
    enable_double_backprop=True)``, which a gradient penalty needs, makes
    its batch mean so (with labels ignored, ``n`` is the others' count:
    that stays refused, as is ``F.sum(0.5 * x)``). A sum over one element
    is its mean too."""
    node = function.inputs[0] if function.inputs else None
    size = int(numpy.prod(node.shape)) if node is not None and \
        node.shape is not None else 0
    if size == 1:
        return True
    creator = node.creator if node is not None else None
    if not isinstance(creator, basic_math.MulConstant):
        return False
    value = creator.value
    if not numpy.isscalar(value) or not value:
        return False
    return abs(abs(float(value)) * size - 1) < 1e-9

"""What the computational graph of one extraction allows.

After the gradient pass, :class:`ModelGraph` sorts every parameter that got
a gradient into

* a :class:`~chainerkfac.curvature.slots.Slot`: all its uses are calls with
  an adapter, whose first axis is the sample axis: its per-sample
  quantities come from those calls' inputs and output gradients;
* a **per-sample-pass** parameter: some use has no adapter (``L.Scale``,
  ``L.EmbedID``, ``L.PReLU``, ``L.LayerNormalization``, a parameter used in
  an arbitrary expression, ``F.linear`` over several batch axes), or the
  samples are coupled (BatchNormalization in training mode): its
  per-sample gradients come from one backward pass per sample
  (:mod:`chainerkfac.curvature.sample_passes`).

It also refuses what is not defined: a loss that uses a parameter outside
the predictor (per-sample losses must depend on the parameters only
through the logits), and, when the samples are coupled, the quantities that
assume independent samples.
"""
import logging
from typing import Dict, List, Optional

import chainer.functions.normalization.batch_normalization as bn_module
import chainer.functions.normalization.batch_renormalization as brn_module
import chainer.functions.normalization.decorrelated_batch_normalization \
    as dbn_module

from chainerkfac.curvature.adapters import Use
from chainerkfac.curvature.slots import Slot

logger = logging.getLogger(__name__)

#: Function types whose output for one sample depends on the other samples.
COUPLING_TYPES = (bn_module.BatchNormalization,
                  dbn_module.DecorrelatedBatchNormalization)
#: Old-style functions (wrapped in a FunctionAdapter) that couple samples.
COUPLING_OLD_STYLE = (brn_module.BatchRenormalizationFunction,)
#: ChainerMN's synchronised BN, known by name (importing ChainerMN starts
#: MPI).
COUPLING_NAMES = ('MultiNodeBatchNormalizationFunction',)

TRAIN_MODE_HINT = (
    "run the forward in test mode, with chainer.using_config('train', "
    'False), where BatchNormalization is an affine layer per channel')


class UnsupportedGraph(ValueError):
    """A quantity is not defined (or not implemented) for this graph; the
    message says why and what works instead."""


def ancestors(variable) -> List:
    """The function nodes ``variable`` depends on, each once."""
    seen = set()
    order = []
    stack = [variable.creator_node] if variable.creator_node else []
    while stack:
        function = stack.pop()
        if function in seen:
            continue
        seen.add(function)
        order.append(function)
        for node in function.inputs:
            if node.creator_node is not None:
                stack.append(node.creator_node)
    return order


def couples_samples(function) -> bool:
    """Whether ``function`` mixes the samples of its batch."""
    if isinstance(function, COUPLING_TYPES):
        return True
    if isinstance(getattr(function, 'function', None), COUPLING_OLD_STYLE):
        return True
    return type(function).__name__ in COUPLING_NAMES


def _param_of(node, params_by_id) -> Optional[str]:
    return params_by_id.get(id(node.get_variable_or_none()))


class ModelGraph:
    """The graph from the inputs to the logits, and its parameters.

    Parameters
    ----------
    logits, loss : chainer.Variable
        The predictor's output and the (scaled) mean loss.
    params : dict
        ``{path: chainer.Parameter}`` in ``namedparams()`` order.
    calls : list of adapters.Call
        The calls recorded in the gradient pass.
    batch : int
        Local samples.

    Attributes
    ----------
    slots : list of Slot
    sampled : dict
        ``{path: reason}`` of the per-sample-pass parameters.
    coupled : str or None
        The function type that couples the samples, if any.
    functions : list
        The function nodes the logits depend on.
    """

    def __init__(self, logits, loss, params: Dict[str, object], calls,
                 batch: int):
        self.logits = logits
        self.batch = batch
        self.params = params
        self.calls = calls
        self.functions = ancestors(logits)
        by_id = {id(p): path for path, p in params.items()}
        model = set(self.functions)
        for function in ancestors(loss):
            if function in model:
                continue
            for node in function.inputs:
                path = _param_of(node, by_id)
                if path is not None:
                    raise UnsupportedGraph(
                        'the loss uses the parameter {} outside the '
                        'predictor ({}): per-sample losses must depend on '
                        'the parameters only through the logits'.format(
                            path, type(function).__name__))
        coupling = [f for f in self.functions if couples_samples(f)]
        self.coupled = type(coupling[0]).__name__ if coupling else None
        reached = [path for path, p in params.items() if p.grad is not None]
        self.reached = reached
        uses, sampled = self._sort_uses(by_id)
        if self.coupled:
            sampled = {path: 'samples coupled by {}'.format(self.coupled)
                       for path in reached}
        self.sampled: Dict[str, str] = {p: sampled[p] for p in reached
                                        if p in sampled}
        self.slots: List[Slot] = [
            Slot(path, uses[path]) for path in reached
            if path not in self.sampled and path in uses]
        # Calls that serve some slot (the extra passes need no others).
        served = {use.call for slot in self.slots for use in slot.uses}
        self.slot_calls = [call for call in calls if call in served]

    def _sort_uses(self, by_id):
        calls = {call.function: call for call in self.calls}
        accepted = {call: call.adapter.accepts(call, self.batch)
                    for call in self.calls}
        uses: Dict[str, List[Use]] = {}
        sampled: Dict[str, str] = {}
        for function in self.functions:
            call = calls.get(function)
            for position, node in enumerate(function.inputs):
                path = _param_of(node, by_id)
                if path is None:
                    continue
                role = call.adapter.positions.get(position) if call else None
                if role is None:
                    sampled.setdefault(path, 'used by {} (input {})'.format(
                        type(function).__name__, position))
                elif accepted[call] is not None:
                    sampled.setdefault(path, 'in a {} call where {}'.format(
                        type(function).__name__, accepted[call]))
                else:
                    call.params[role] = path
                    uses.setdefault(path, []).append(Use(call, role))
        return uses, sampled

    def require_slots(self, quantity: str) -> None:
        """Raise unless every parameter takes its quantities from adapted
        calls: ``quantity`` needs their structure."""
        if self.sampled:
            raise UnsupportedGraph(
                '{} needs every parameter in a Linear, Convolution2D or '
                'BatchNormalization call; not so for {}'.format(
                    quantity, '; '.join('{} ({})'.format(path, reason)
                                        for path, reason in
                                        self.sampled.items())))

    @property
    def slot(self) -> Dict[str, Slot]:
        return {slot.path: slot for slot in self.slots}

    def check_independent(self, quantity: str) -> None:
        """Raise if the samples are coupled: ``quantity`` assumes they are
        not."""
        if self.coupled:
            raise UnsupportedGraph(
                '{} assumes independent samples, but {} couples them '
                '(BatchNormalization in training mode); the per-sample and '
                'diagonal quantities are computed exactly by per-sample '
                'passes, or {}'.format(quantity, self.coupled,
                                       TRAIN_MODE_HINT))

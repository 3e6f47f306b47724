"""Stages 1-2: capture layer inputs and output gradients.

:class:`FactorCapture` is a Chainer ``FunctionHook`` that the optimizer
activates only inside ``update``. For each function call it finds the block
in O(1) by the identity of the call's weight (its second input): the
parameter's array in the forward pass, where the function's input nodes do
not exist yet, and the parameter itself in the backward pass. It hands the
block the arrays it needs, when one of the block's factors of that pass is
due. A link called several times per micro-batch contributes every call.

It also remembers the batch size (the first axis of the first modelled
layer's input) and the logits of the loss (the input of the last softmax /
log-softmax / softmax cross-entropy), which the Monte-Carlo Fisher needs to
sample labels from the model.
"""
from typing import Dict, Iterable, Mapping, Optional

import chainer
from chainer.functions.activation import log_softmax as log_softmax_module
from chainer.functions.activation import softmax as softmax_module
from chainer.functions.loss import softmax_cross_entropy as sce_module

_LOGIT_FUNCTIONS = (sce_module.SoftmaxCrossEntropy,
                    log_softmax_module.LogSoftmax,
                    softmax_module.Softmax)


class FactorCapture(chainer.FunctionHook):
    """Route function calls to their Fisher blocks.

    Parameters
    ----------
    blocks : iterable of FisherBlock
        Every block of the model (those without factors are ignored).
    due : mapping, optional
        ``{block: names of its factors due this step}``; the forward pass
        captures the due factors of kind ``INPUTS``, the backward pass the
        others. Default: nothing is due (the hook then only records the
        batch size and the logits).
    record_logits : bool
        Keep the last logits variable (for the MC Fisher).

    Attributes
    ----------
    forward : bool
        Capture in forward passes (the optimizer turns it off once the
        loss is computed: the backward of some functions calls the forward
        of others).
    batch_size : int or None
        First axis of the first modelled layer's input in the forward pass.
    """

    name = 'KFACFactorCapture'

    def __init__(self, blocks: Iterable, due: Optional[Mapping] = None,
                 record_logits: bool = False):
        due = due or {}
        self._by_param: Dict[int, object] = {}
        self._by_array: Dict[int, object] = {}
        self._forward_due = set()
        self._backward_due = set()
        for block in blocks:
            if not block.function_types:
                continue
            weight = block.params[0]
            self._by_param[id(weight)] = block
            if weight.array is not None:
                self._by_array[id(weight.array)] = block
            kinds = block.factor_kinds
            names = due.get(block, ())
            if any(kinds[n].forward for n in names):
                self._forward_due.add(block)
            if any(not kinds[n].forward for n in names):
                self._backward_due.add(block)
        self.forward = True
        self.record_logits = record_logits
        self.batch_size = None
        self._logit_function = None

    @property
    def logits(self):
        """The logits variable of the last softmax-type call, or None."""
        if self._logit_function is None or \
                self._logit_function.inputs is None:
            return None
        return self._logit_function.inputs[0].get_variable()

    def _block_forward(self, function, in_data):
        if len(in_data) < 2:
            return None
        block = self._by_array.get(id(in_data[1]))
        if block is None:
            # A lazily initialised parameter got its array in this call.
            block = self._lazy_lookup(in_data[1])
        return _matching(block, function)

    def _lazy_lookup(self, array):
        for block in self._by_param.values():
            if block.params[0].array is array:
                self._by_array[id(array)] = block
                return block
        return None

    def _block_backward(self, function):
        inputs = function.inputs
        if len(inputs) < 2:
            return None
        param = inputs[1].get_variable_or_none()
        return _matching(self._by_param.get(id(param)), function)

    def forward_preprocess(self, function, in_data):
        if self.record_logits and isinstance(function, _LOGIT_FUNCTIONS):
            # Its input nodes exist only after the forward: keep the call.
            self._logit_function = function
        if not self.forward:
            return
        block = self._block_forward(function, in_data)
        if block is None:
            return
        if self.batch_size is None:
            self.batch_size = int(in_data[0].shape[0])
        if block in self._forward_due:
            block.capture_forward(function, in_data)

    def backward_preprocess(self, function, in_data, out_grad):
        if not self._backward_due:
            return
        block = self._block_backward(function)
        if block in self._backward_due:
            block.capture_backward(function, in_data, out_grad)


def _matching(block, function):
    if block is None or not isinstance(function, block.function_types):
        return None
    return block

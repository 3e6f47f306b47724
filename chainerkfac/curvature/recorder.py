"""The calls of the gradient pass, as seen by the library's one capture.

:class:`CallRecorder` is a listener of
:class:`chainerkfac.capture.BackwardCapture`, as the optimizer's
:class:`~chainerkfac.estimator.CurvatureEstimator` is: routed by the
identity of a call's second input (the weight), it keeps each call of a
function type that has an adapter (:mod:`chainerkfac.curvature.adapters`)
with the inputs the function retained, the gradient w.r.t. its output and
its output node. The hook is installed for the gradient pass only; the
extra passes ask Chainer for the gradients w.r.t. the recorded outputs
directly.
"""
import contextlib
from typing import Dict, List

from chainerkfac import capture as capture_module
from chainerkfac.curvature import adapters


class CallRecorder:
    """Listener that records the calls of the gradient pass.

    Parameters
    ----------
    params : dict
        ``{path: chainer.Parameter}``; calls whose second input is one of
        them are recorded.

    Attributes
    ----------
    calls : list of adapters.Call
        In the order the backward pass met them.
    out_grads : dict
        ``{call: gradient w.r.t. its output}`` of the gradient pass.
    """

    def __init__(self, params: Dict[str, object]):
        types = adapters.function_types()
        self.routes = {id(p): (types, path) for path, p in params.items()}
        self.calls: List[adapters.Call] = []
        self.out_grads: Dict[adapters.Call, object] = {}
        self._capture = capture_module.BackwardCapture(self)

    def on_backward(self, target, function, in_data, out_grad, pass_info):
        call = adapters.Call(function, adapters.adapter_for(function),
                             in_data, function.outputs[0]())
        self.calls.append(call)
        self.out_grads[call] = out_grad[0]

    @contextlib.contextmanager
    def recording(self):
        """Record the calls of the backward passes run inside."""
        self._capture.install()
        try:
            yield self
        finally:
            self._capture.remove()

"""Stages 1-2: see every backward pass through the links being watched.

:class:`BackwardCapture` is the one capture mechanism of the library: the
optimizer's factor estimation (:mod:`chainerkfac.estimator`) and the
curvature quantities (:mod:`chainerkfac.curvature`) both listen to it. It is
a Chainer ``FunctionHook`` kept in the thread's function hooks while
installed (K-FAC installs it at ``setup`` and keeps it while a factor is
due), so it sees the passes whoever runs them: a ``StandardUpdater``, a
hand-written ``loss.backward(); optimizer.update()``, BPTT over 35 time
steps, a GAN updater, ChainerMN's multi-node optimizer.

Everything is taken when the backward pass runs through a call, never in
the forward pass: a call counts only if the backward pass of some loss
reaches it (an evaluation pass, a forward under ``no_backprop_mode`` or an
output that no loss uses contributes nothing). A call is routed to its
listener's target by the identity of its second input, the weight
parameter (``linear(x, W, b)``, ``convolution_2d(x, W, b)``,
``batch_normalization(x, gamma, beta)``), and its function type; the target
gets the inputs the function retained for its own backward (``x`` for these
three) and the gradients w.r.t. its outputs.

Backward passes
---------------
Chainer processes one backward pass in order of decreasing rank (a
function's depth in its graph). A call whose rank is higher than that of the
node before it, or a watched call seen a second time, therefore starts a new
pass; the listener is told the pass's index with each call. (A pass whose
first node has the rank of the previous pass's last one is taken for its
continuation: it needs a graph of one level.) Passes that the listener runs
itself — the extra passes of the Monte-Carlo or exact Fisher — are opened
with :meth:`BackwardCapture.explicit_pass` instead.

The hook also keeps, on request, the functions of the backward passes (the
graph for eq. 20's scale-invariance analysis) and the logits of the last
call of a registered logits function in the forward pass (for the
Monte-Carlo and exact Fisher).

Passes run inside :func:`unobserved` are seen by no capture: a listener's
auxiliary passes (the curvature module's extra passes from the logits) must
not enter another listener's statistics, e.g. the factors of a K-FAC
optimizer set up on the same model.
"""
import contextlib
import itertools
import threading
import weakref
from typing import Dict, List, NamedTuple, Optional, Tuple

import chainer


class PassInfo(NamedTuple):
    """The backward pass a call belongs to.

    Attributes
    ----------
    index : int
        Counts the passes this hook has seen (implicit and explicit).
    explicit : bool
        A pass opened by :meth:`BackwardCapture.explicit_pass` (the
        listener's own extra pass), not a pass of some loss's backward.
    """
    index: int
    explicit: bool


class GraphNode(NamedTuple):
    """A function node of a backward pass, with its input and output
    variable nodes held (a later ``unchain_backward`` empties the
    function's own ``inputs``)."""
    function: object
    inputs: tuple
    outputs: tuple


_serial = itertools.count()
# Depth of unobserved() blocks in this thread (Chainer's function hooks are
# per thread too).
_unobserved = threading.local()


@contextlib.contextmanager
def unobserved():
    """Hide the backward passes run inside from every
    :class:`BackwardCapture` of this thread."""
    depth = getattr(_unobserved, 'depth', 0)
    _unobserved.depth = depth + 1
    try:
        yield
    finally:
        _unobserved.depth = depth


class BackwardCapture(chainer.FunctionHook):
    """Route the backward calls of watched parameters to a listener.

    Parameters
    ----------
    listener : object
        Held weakly (the hook lives in the thread's function hooks; it must
        not keep a model alive). It provides ``routes``, a mapping
        ``{id(parameter): (function types, target)}``, and
        ``on_backward(target, function, in_data, out_grad, pass_info)``;
        optionally ``on_pass(function, pass_info)``, called with the first
        function of every implicit pass (the loss's creator).

    Attributes
    ----------
    record_logits : bool
        Keep the calls of a logits function
        (:func:`chainerkfac.fisher_blocks.logits_functions`) in forward
        passes (:meth:`logits_calls_of`), and the gradients of their
        outputs in the next backward pass (:meth:`logits_grads`): how much
        each output weighs in the loss.
    record_graph : bool
        Keep every function node of the backward passes that reach the
        listener's parameters: :attr:`graph`. The nodes of a pass are held
        weakly until its first routed call, so that a listener not in a
        pass (another model's, or an optimizer no longer used and not yet
        collected) keeps none of its nodes, nor the arrays they hold; and
        a pass of the same graph as one kept (the next step's, while the
        listener takes no step: its model trained by another optimizer) is
        dropped when the next pass begins, so that at most one pass of
        each graph is held.
    """

    def __init__(self, listener):
        self.name = 'chainerkfac.capture.{}'.format(next(_serial))
        self._listener = weakref.ref(listener)
        self._hooks: Optional[Dict] = None
        self._pass = 0
        self._explicit = False
        self._last_rank = -1
        self._seen = weakref.WeakSet()
        self.record_logits = False
        self.record_graph = False
        self.graph: List[GraphNode] = []
        # This pass's nodes before its first routed call (weakly), and
        # whether that call has come.
        self._pending: List[weakref.ref] = []
        self._routed = False
        # Where the open pass's nodes begin in the graph, and the graphs of
        # the passes kept (:func:`_shape_of`).
        self._pass_start = 0
        self._shapes: set = set()
        self._logits_types: Tuple[type, ...] = ()
        self._logit_functions: List = []
        self._logit_grads: Dict[int, tuple] = {}
        # Forget the hook once the listener is gone (removed at the next
        # install or removal of any capture: never while Chainer iterates
        # over the hooks).
        self._dead = [False]
        weakref.finalize(listener, _mark_dead, self._dead, weakref.ref(self))

    # -- installation ---------------------------------------------------------
    @property
    def installed(self) -> bool:
        return self._hooks is not None

    def install(self) -> None:
        """Put the hook into this thread's function hooks (idempotent)."""
        hooks = chainer.get_function_hooks()
        _purge_dead(hooks)
        if self._hooks is not None:
            return
        hooks[self.name] = self
        self._hooks = hooks
        self._last_rank = -1

    def remove(self) -> None:
        """Take the hook out of the function hooks it was put into."""
        if self._hooks is not None:
            self._hooks.pop(self.name, None)
            _purge_dead(self._hooks)
            self._hooks = None

    @contextlib.contextmanager
    def explicit_pass(self):
        """Mark the backward pass run inside as one pass of the listener's
        own (rank-based detection is off inside)."""
        self._pass += 1
        self._explicit = True
        self._seen = weakref.WeakSet()
        self._close_recorded_pass()
        try:
            yield self._pass
        finally:
            self._explicit = False
            self._last_rank = -1

    def logits_calls_of(self, loss) -> list:
        """The recorded logits-function calls that ``loss`` comes from, in
        call order (not those of another forward pass in the loss
        function: a validation pass, an accuracy's softmax)."""
        ancestors = {id(n.function) for n in graph_of(loss)}
        return [f for f in self._logit_functions
                if id(f) in ancestors and f.inputs is not None]

    def logits_grads(self, call):
        """The output gradients ``call`` (a recorded logits call) got in
        the backward pass after its forward, or None."""
        return self._logit_grads.get(id(call))

    def forget_logits(self) -> None:
        self._logit_functions = []
        self._logit_grads = {}

    def start_recording_logits(self, logits_types) -> None:
        """Record logits in the coming forward passes (see
        :attr:`logits`)."""
        self._logits_types = tuple(logits_types)
        self._logit_functions = []
        self._logit_grads = {}
        self.record_logits = True

    # -- the hook ---------------------------------------------------------------
    def forward_preprocess(self, function, in_data):
        if self._dead[0]:
            return
        if self.record_logits and isinstance(function, self._logits_types):
            # Its input nodes exist only after the forward: keep the call.
            self._logit_functions.append(function)

    def backward_preprocess(self, function, in_data, out_grad):
        if self._dead[0] or getattr(_unobserved, 'depth', 0):
            return
        if self._logit_functions and not self._explicit and \
                isinstance(function, self._logits_types) and \
                any(f is function for f in self._logit_functions):
            # the weight of its output in the loss (the estimator's
            # row weights); a few calls per loss, so a list
            self._logit_grads[id(function)] = tuple(out_grad)
        listener = self._listener()
        if listener is None:
            return
        rank = function.rank
        if not self._explicit and rank > self._last_rank:
            self._new_pass()
            on_pass = getattr(listener, 'on_pass', None)
            if on_pass is not None:
                on_pass(function, PassInfo(self._pass, False))
        self._last_rank = rank
        inputs = function.inputs
        route = None
        if len(inputs) >= 2:
            route = listener.routes.get(id(inputs[1].get_variable_or_none()))
            if route is not None and not isinstance(function, route[0]):
                route = None
        if self.record_graph:
            self._record(function, route is not None)
        if route is None:
            return
        if function in self._seen and not self._explicit:
            self._new_pass()
        self._seen.add(function)
        listener.on_backward(route[1], function, in_data, out_grad,
                             PassInfo(self._pass, self._explicit))

    def _record(self, function, routed: bool) -> None:
        """Keep ``function``'s node in :attr:`graph` once its pass has
        reached the listener (with the pass's earlier nodes, held weakly
        until then: all are alive while the pass runs)."""
        if not self._routed and not routed:
            self._pending.append(weakref.ref(function))
            return
        if not self._routed:
            self._routed = True
            earlier = [ref() for ref in self._pending]
            self._pending = []
            self._pass_start = len(self.graph)
            self.graph.extend(_node(f) for f in earlier if f is not None)
        self.graph.append(_node(function))

    def _close_recorded_pass(self) -> None:
        """The pass recorded last is kept if its graph is new, else its
        nodes go; the next pass starts unrouted."""
        if self._routed:
            shape = _shape_of(self.graph[self._pass_start:])
            if shape in self._shapes:
                del self.graph[self._pass_start:]
            else:
                self._shapes.add(shape)
        self._pending, self._routed = [], False
        self._pass_start = len(self.graph)

    def clear_graph(self) -> None:
        """Forget the recorded graph (recording goes on if it is on)."""
        self.graph = []
        self._shapes = set()
        self._pending, self._routed, self._pass_start = [], False, 0

    def _new_pass(self) -> None:
        self._pass += 1
        self._seen = weakref.WeakSet()
        self._close_recorded_pass()


def graph_of(variable) -> List[GraphNode]:
    """The function nodes that ``variable`` (a loss) was computed by, each
    with its input and output nodes (what the capture records in a
    backward pass)."""
    seen, stack, out = set(), [variable.creator_node], []
    while stack:
        function = stack.pop()
        if function is None or id(function) in seen:
            continue
        seen.add(id(function))
        out.append(_node(function))
        stack.extend(node.creator_node for node in function.inputs)
    return out


def functions_between(loss, function) -> list:
    """The function nodes on a path from ``function``'s output to ``loss``
    (``loss`` comes from ``function``), ``function`` excluded."""
    reaches = {id(function): True}
    order, stack = [], [(loss.creator_node, False)]
    while stack:
        node, expanded = stack.pop()
        if node is None or (id(node) in reaches and not expanded):
            continue
        if expanded:
            reaches[id(node)] = any(
                reaches.get(id(i.creator_node), False) for i in node.inputs)
            if reaches[id(node)]:
                order.append(node)
            continue
        reaches.setdefault(id(node), False)
        stack.append((node, True))
        stack.extend((i.creator_node, False) for i in node.inputs
                     if i.creator_node is not None and
                     id(i.creator_node) not in reaches)
    return order


def _shape_of(nodes) -> tuple:
    """A pass's graph without its arrays: each function's type and where
    each input comes from (another function of the pass, by position, a
    parameter, by identity, or elsewhere). Two passes of one model's
    forward code have the same."""
    position = {id(n.function): k for k, n in enumerate(nodes)}
    shape = []
    for n in nodes:
        sources = []
        for node in n.inputs:
            creator = node.creator_node
            if creator is not None:
                sources.append(position.get(id(creator), -1))
            else:
                variable = node.get_variable_or_none()
                sources.append(('param', id(variable)) if isinstance(
                    variable, chainer.Parameter) else None)
        shape.append((type(n.function), tuple(sources)))
    return tuple(shape)


def _node(function) -> GraphNode:
    return GraphNode(function, tuple(function.inputs),
                     tuple(o() for o in function.outputs))


def _mark_dead(flag, capture_ref) -> None:
    flag[0] = True
    capture = capture_ref()
    if capture is not None:     # what it holds goes with the listener
        capture.clear_graph()
        capture._logit_functions = []
        capture._logit_grads = {}


def _purge_dead(hooks) -> None:
    for name in [n for n, h in hooks.items()
                 if isinstance(h, BackwardCapture) and h._dead[0]]:
        del hooks[name]

"""Layer-parallel forward and backward propagation: :class:`MGRIT`.

The forward solve is nonlinear MGRIT (:mod:`.cycle`) on the state
equations u_{n+1} = Φ_n(u_n) (seed section 3.1); the backward solve is
MGRIT on the adjoint equations ū_n = (∂_u Φ_n)^T ū_{n+1} in reversed layer
order (section 3.2), every transposed layer applied at the stored fine-grid
forward state u_n — on coarse levels too, at the coarse points. A coarse
level is the same layers with step c^l h and the weights of the layer at
the start of each coarse step (injection). Weight gradients (eq. 2.19) are
accumulated once, on the finest level, after the adjoint solve.

Layers are distributed over the processes in contiguous blocks
(:func:`.partition.layer_blocks`); each process computes the gradient of
the layers it owns. The opening layer lives on rank 0, the classifier on
the owner of the last layer.
"""
import collections
import contextlib
import logging
import math
import time
from typing import List, Optional, Tuple

import numpy

import chainer
import chainer.functions as F
from chainer import backend

from chainerkfac.layer_parallel import cycle
from chainerkfac.layer_parallel import partition
from chainerkfac.layer_parallel.network import ResidualODE
from chainerkfac.layer_parallel.transport import agree_on_weights
from chainerkfac.layer_parallel.transport import transport_for

logger = logging.getLogger(__name__)

# Above every tag the cycle uses (levels × kinds of exchange).
_TAG_WEIGHTS = 10000


class _ForwardPropagator:
    """Φ from fine point ``start`` to ``stop``: layer ``start`` with step
    (stop - start) h (dt = t_stop - t_start, as the authors' code)."""

    def __init__(self, net: ResidualODE):
        self.net = net

    def step(self, start: int, stop: int, u, out=None):
        return self.net.step(start, u, (stop - start) * self.net.h, out)


class _AdjointPropagator:
    """The adjoint in reversed layer order: point k is ū_{N-k}; the step
    from k = ``start`` to ``stop`` applies layer N - stop transposed, at
    the fine-grid state u_{N-stop}, with step (stop - start) h — on a coarse
    level the transpose of the forward coarse step over the same layers.

    ``slopes[n]`` is σ'(K_n u_n + b_n) of every owned layer ``n``, set by
    :meth:`MGRIT.backward` before the solve.
    """

    def __init__(self, net: ResidualODE):
        self.net = net
        self.slopes = {}

    def step(self, start: int, stop: int, ubar, out=None):
        n = self.net.n_layers - stop
        return self.net.step_adjoint(n, self.slopes[n], ubar,
                                     (stop - start) * self.net.h, out)


#: ``tol=None``'s tolerance by the states' item size (bytes): float64,
#: float32, float16.
DEFAULT_TOL = {8: 1e-10, 4: 1e-5, 2: 1e-2}


def _integer(value) -> bool:
    return isinstance(value, (int, numpy.integer)) and \
        not isinstance(value, bool)


def _check_options(coarsening, tol, max_iter, rtol, levels=None) -> None:
    """MGRIT's numbers, refused before any work where they make no
    solve (a coarsening of 0 divided by zero, a negative tolerance ran
    every solve to its cap, an ``rtol`` of 1 stopped every solve after its
    first iteration as converged, ``levels=2.5`` built 3 levels)."""
    if not _integer(coarsening) or coarsening < 2:
        raise ValueError('coarsening must be an integer >= 2, not {!r}'
                         .format(coarsening))
    if levels is not None and (not _integer(levels) or levels < 1):
        raise ValueError('levels must be an integer >= 1 (or None: as '
                         'many as the layers allow), not {!r}'.format(levels))
    _check_max_iter(max_iter)
    _check_tol(tol)
    _check_rtol(rtol)


def _finite_at_least_0(value) -> bool:
    return isinstance(value, (int, float, numpy.integer,
                              numpy.floating)) and \
        not isinstance(value, bool) and math.isfinite(value) and value >= 0


def _check_max_iter(max_iter) -> None:
    if not _integer(max_iter) or max_iter < 1:
        raise ValueError('max_iter must be positive, not {!r}'.format(
            max_iter))


def _check_tol(tol) -> None:
    if tol is not None and not _finite_at_least_0(tol):
        raise ValueError('tol must be a finite number >= 0 (or None: by '
                         'the dtype), not {!r}'.format(tol))


def _check_rtol(rtol) -> None:
    if not _finite_at_least_0(rtol) or rtol >= 1:
        raise ValueError('rtol must be a number in [0, 1), not {!r} (the '
                         "first iteration's residual is its reference: 1 "
                         'or more ends every solve there)'.format(rtol))


class MGRIT:
    """Layer-parallel forward and backward propagation through a
    :class:`ResidualODE` by nonlinear multigrid over the layers.

    Parameters
    ----------
    net : ResidualODE
        The network, the same on every process: where its weights differ
        (built with different seeds), rank 0's are broadcast, with a
        warning. Each process reads and writes only the layers it owns
        (and receives the weights its coarse levels need at every
        :meth:`forward`).
    comm : None, mpi4py communicator or ChainerMN communicator
        The processes the layers are distributed over (``None``: one).
    coarsening : int
        Coarsening factor c between levels.
    levels : int or None
        Number of levels; ``None`` coarsens while a level has at least 2
        steps. ``levels=1`` is layer-serial forward and back propagation.
    relax : str
        ``'FCF'`` or ``'F'`` relaxation.
    tol : float or None
        Stop a solve once the residual norm (2-norm over the C-points of
        the batch's states) is at most ``tol``. ``None``: by the states'
        dtype (:data:`DEFAULT_TOL`: 1e-10 in float64, 1e-5 in float32,
        whose residuals stop falling near 5e-7 on a 256-layer network at
        batch 500: a float64 tolerance there ran every solve to
        ``max_iter``). ``tol=0`` with ``rtol=0`` runs ``max_iter``
        iterations of every solve, a fixed-iteration history (the
        convergence experiment's): :attr:`converged` records whether a
        solve reached 0, and no warning is given.
    max_iter : int
        Iteration cap of a solve (overridable per call: simultaneous
        training runs a fixed m1 / m2).
    rtol : float
        Also stop once the residual is at most ``rtol`` times the first
        iteration's; in [0, 1).
    warm_start : bool
        Start every solve from the last solve's states (forward) or
        adjoints (backward) when the batch shape is unchanged.

    Attributes
    ----------
    blocks : list of range
        The layers each rank owns.
    """

    # -- options: the tolerances settable, the hierarchy fixed ---------------
    @property
    def tol(self) -> Optional[float]:
        """The absolute tolerance (None: by the dtype); settable, checked
        as the constructor checks it."""
        return self._abs_tol

    @tol.setter
    def tol(self, value) -> None:
        _check_tol(value)
        self._abs_tol = value

    @property
    def rtol(self) -> float:
        """The relative tolerance, in [0, 1); settable, checked."""
        return self._rtol

    @rtol.setter
    def rtol(self, value) -> None:
        _check_rtol(value)
        self._rtol = value

    @property
    def max_iter(self) -> int:
        """The iteration cap of a solve; settable, checked."""
        return self._max_iter

    @max_iter.setter
    def max_iter(self, value) -> None:
        _check_max_iter(value)
        self._max_iter = value

    def _fixed(name):
        def get(self):
            return self._structure[name]

        def refuse(self, value):
            raise AttributeError(
                'MGRIT.{0} is fixed at construction (the levels, the '
                'solvers and the weights\' routes are built from it): '
                'build a new MGRIT(net, ..., {0}={1!r})'.format(name, value))
        return property(get, refuse, doc='The ``{}`` argument the '
                        'hierarchy was built with (fixed; ``levels`` None: '
                        'as many as the layers allow, '
                        '``forward_solver.n_levels`` counts them).'.format(
                            name))

    coarsening = _fixed('coarsening')
    levels = _fixed('levels')
    relax = _fixed('relax')
    del _fixed

    def __init__(self, net: ResidualODE, comm=None, coarsening: int = 4,
                 levels: Optional[int] = None, relax: str = 'FCF',
                 tol: Optional[float] = None, max_iter: int = 50,
                 rtol: float = 0.0,
                 warm_start: bool = True):
        _check_options(coarsening, tol, max_iter, rtol, levels)
        self.net = net
        self.transport = transport_for(comm)
        self.rank = self.transport.rank
        self._agree_on_weights()
        self._structure = {'coarsening': coarsening, 'levels': levels,
                           'relax': relax}
        self.tol = tol
        self.max_iter = max_iter
        self.rtol = rtol
        #: Whether the last forward and adjoint solves converged (reached
        #: ``tol`` or ``rtol``): ``{'forward': bool, 'adjoint': bool}``.
        self.converged: dict = {}
        self._warned: set = set()
        self.warm_start = warm_start
        n_layers = net.n_layers
        self.blocks = partition.layer_blocks(n_layers, self.transport.size,
                                             coarsening)
        self.owners = partition.layer_owners(self.blocks)
        self.opening_owner = self.owners[0]
        self.classifier_owner = self.owners[-1]
        self.forward_solver = cycle.FASSolver(
            _ForwardPropagator(net),
            partition.forward_point_owners(self.owners), self.transport,
            coarsening, levels, relax)
        self._adjoint = _AdjointPropagator(net)
        self.adjoint_solver = cycle.FASSolver(
            self._adjoint, partition.adjoint_point_owners(self.owners),
            self.transport, coarsening, levels, relax)
        self._routes = partition.coarse_weight_routes(
            self.owners, coarsening,
            [layout.steps for layout in self.forward_solver.layouts])
        # Kept from forward for backward: the opening layer's output and
        # the classifier's input, with their graphs.
        self._opening_out = None
        self._final_state = None
        self._logits = None
        self._state_shape = None
        self._xp = None
        #: Seconds spent in each phase on this process, summed over calls
        #: (the unit costs of the performance model come from these; on a
        #: GPU each phase is synchronised).
        self.timings = collections.Counter()
        if self.rank == 0:
            logger.info(
                'MGRIT: %d layers on %d processes (%s layers each), '
                '%d levels %s, c=%d, %s-relaxation',
                n_layers, self.transport.size,
                '/'.join(str(len(b)) for b in self.blocks),
                self.forward_solver.n_levels,
                [layout.steps for layout in self.forward_solver.layouts],
                coarsening, relax)

    def _agree_on_weights(self) -> None:
        """Every process starts from rank 0's weights: each owns some
        layers, and one whose copy differs would run a network made of
        several processes' layers."""
        if agree_on_weights(self.transport, self.net) and self.rank == 0:
            logger.warning(
                "MGRIT: the network's weights differed between processes "
                "(built with different seeds?); rank 0's were broadcast")

    def _cap(self, max_iter: Optional[int]) -> int:
        """A solve's iteration cap: the call's (0 is refused by the
        solver, not taken for the default), else the constructor's."""
        return self.max_iter if max_iter is None else max_iter

    def _tol(self, dtype) -> float:
        if self.tol is not None:
            return self.tol
        return DEFAULT_TOL.get(numpy.dtype(dtype).itemsize, 1e-10)

    # -- ownership ---------------------------------------------------------

    @property
    def owned_layers(self) -> range:
        """The residual layers whose gradients this process computes."""
        return self.blocks[self.rank]

    def owned_links(self, rank: Optional[int] = None
                    ) -> List[Tuple[str, chainer.Link]]:
        """(name, link) of the links process ``rank`` (this one by default)
        owns, in a fixed order: the opening layer, its layers, the
        classifier."""
        rank = self.rank if rank is None else rank
        links = []
        if rank == self.opening_owner:
            links.append(('/opening', self.net.opening))
        links += [('/layers/{}'.format(n), self.net.layers[n])
                  for n in self.blocks[rank]]
        if rank == self.classifier_owner:
            links.append(('/classifier', self.net.classifier))
        return links

    def owned_params(self) -> List[Tuple[str, chainer.Parameter]]:
        """(name, parameter) of everything this process owns, in the order
        of :meth:`owned_links`."""
        return [(prefix + name, param)
                for prefix, link in self.owned_links()
                for name, param in sorted(link.namedparams())]

    def share_weights(self) -> None:
        """Copy every parameter from its owner to every process (e.g. to
        evaluate or save the whole network on one process)."""
        mine = {name: backend.CpuDevice().send(param.array)
                for name, param in self.owned_params()}
        params = dict(self.net.namedparams())
        for part in self.transport.allgather(mine):
            for name, array in part.items():
                target = params[name].array
                target[...] = backend.get_array_module(target).asarray(array)

    # -- forward -----------------------------------------------------------

    def forward(self, x, max_iter: Optional[int] = None):
        """Logits of the batch ``x`` by the forward MGRIT solve.

        Parameters
        ----------
        x : array
            The input batch (the same on every process).
        max_iter : int or None
            Iteration cap of this solve (default: the constructor's).

        Returns
        -------
        logits : array, (batch, n_out)
            On every process.
        history : list of float
            Residual norm of every iteration.
        """
        net = self.net
        net.check_input(x)          # before any solve
        with self._timed('weights'):
            self._fetch_coarse_weights()
        xp = backend.get_array_module(x)
        dtype = net.opening.W.dtype
        g0 = None
        with self._timed('ends'):
            if self.rank == self.opening_owner:
                self._opening_out = net.open(x)
                g0 = self._opening_out.array
        with self._timed('forward_solve'):
            history = self.forward_solver.solve(
                g0, net.state_shape(x.shape), dtype, xp,
                self._cap(max_iter), self._tol(dtype), self.rtol,
                self.warm_start)
        self._check_converged('forward', history, dtype)
        with self._timed('ends'):
            n_out = net.classifier.out_size
            if self.rank == self.classifier_owner:
                self._final_state = chainer.Variable(
                    self.forward_solver.value(net.n_layers).copy())
                self._logits = net.classifier(self._final_state)
                logits = self._logits.array
            else:
                logits = xp.empty((x.shape[0], n_out), dtype)
            self.transport.bcast_array(logits, root=self.classifier_owner)
        self._state_shape = net.state_shape(x.shape)
        self._xp = xp
        return logits, history

    # -- backward ----------------------------------------------------------

    def backward(self, t, max_iter: Optional[int] = None):
        """Mean cross-entropy of the last :meth:`forward` against labels
        ``t``, and the gradients by the adjoint MGRIT solve.

        Accumulates into the ``grad`` of the parameters this process owns
        (:meth:`owned_params`), like ``loss.backward()``; others are left
        untouched.

        Returns
        -------
        loss : float
            On every process.
        history : list of float
            Residual norm of every adjoint iteration.
        """
        if self._state_shape is None:
            raise RuntimeError('MGRIT.backward needs a forward first')
        net = self.net
        n_layers, h = net.n_layers, net.h
        forward = self.forward_solver
        g0, loss = None, None
        with self._timed('ends'):
            if self.rank == self.classifier_owner:
                loss_var = F.softmax_cross_entropy(self._logits, t)
                # The seed of this call's adjoint solve alone (a second
                # backward of one forward accumulates, as Chainer's does).
                self._final_state.cleargrad()
                loss_var.backward()
                loss = float(loss_var.array)
                g0 = self._final_state.grad
            loss = self.transport.bcast(loss, root=self.classifier_owner)
        with self._timed('linearise'):
            slopes = {n: net.slope(n, forward.value(n))
                      for n in self.owned_layers}
        self._adjoint.slopes = slopes
        with self._timed('adjoint_solve'):
            history = self.adjoint_solver.solve(
                g0, self._state_shape, net.opening.W.dtype, self._xp,
                self._cap(max_iter), self._tol(net.opening.W.dtype),
                self.rtol,
                self.warm_start)
        self._check_converged('adjoint', history, net.opening.W.dtype)
        adjoint = self.adjoint_solver
        with self._timed('layer_grads'):
            for n in self.owned_layers:
                net.accumulate_layer_grad(n, forward.value(n), slopes[n],
                                          adjoint.value(n_layers - n - 1), h)
        with self._timed('ends'):
            if self.rank == self.opening_owner:
                self._opening_out.grad = adjoint.value(n_layers).copy()
                self._opening_out.backward()
        return loss, history

    def _check_converged(self, solve: str, history, dtype) -> None:
        """Record in :attr:`converged` whether the ``solve`` ('forward' or
        'adjoint') reached ``tol`` or ``rtol`` before its cap, and warn the
        first time one did not: its states, and the logits or gradients
        from them, are then MGRIT's iterate, not the serial network's (a
        cap of 1 left the logits 18 % off, silently). Training with a
        fixed small number of iterations, as the seed does, is such a
        solve on purpose: the warning comes once per solve."""
        tol = self._tol(dtype)
        last = history[-1] if history else 0.0
        done = last <= tol or last <= self.rtol * history[0]
        self.converged[solve] = done
        fixed = self.tol == 0 and self.rtol == 0     # max_iter, on purpose
        if not done and not fixed and solve not in self._warned:
            self._warned.add(solve)
            logger.warning(
                'MGRIT: the %s solve stopped after %d iteration(s) with the '
                'residual at %.3g, above tol %.3g: its results are not the '
                'serial network\'s (raise max_iter, or set tol/rtol; '
                'MGRIT.converged says which solves converged; this is said '
                'once)', solve, len(history), last, tol)

    @contextlib.contextmanager
    def _timed(self, phase: str):
        # On a GPU the device's queue is drained at both ends: the phase's
        # own kernels are what is timed.
        self.net.synchronize()
        begin = time.perf_counter()
        yield
        self.net.synchronize()
        self.timings[phase] += time.perf_counter() - begin

    def _fetch_coarse_weights(self) -> None:
        """Receive the weights of the layers this process's coarse levels
        use but others own (they change at every optimizer step)."""
        net, requests, received, sent = self.net, [], [], []
        for layer, src, dst in self._routes:
            if dst == self.rank:
                flat = net.pack_layer(layer)
                requests.append(self.transport.irecv(
                    flat, src, _TAG_WEIGHTS + layer))
                received.append((layer, flat))
        for layer, src, dst in self._routes:
            if src == self.rank:
                sent.append(net.pack_layer(layer))
                requests.append(self.transport.isend(
                    sent[-1], dst, _TAG_WEIGHTS + layer))
        self.transport.waitall(requests)
        for layer, flat in received:
            net.unpack_layer(layer, flat)

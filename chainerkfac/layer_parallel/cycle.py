"""Nonlinear MGRIT: the FAS V-cycle over the points one process owns.

Solves u_0 = g_0, u_j = Φ(u_{j-1}) + g_j (j = 1 .. M) — forward
propagation through the layers when Φ is a layer step and g = 0 — by the
seed's Algorithm 1 applied recursively (section 3.1.1):

1. relax: F (every F-point from its left neighbour, each interval of c
   points independently) or FCF (F, then every C-point, then F again);
2. restrict by injection to every c-th point, with the FAS right-hand side
   g_Δ,J = Φ(u_{Jc-1}) + g_{Jc} - Φ_Δ(u_{(J-1)c}) (the residual at the
   C-points plus the coarse operator at the current values);
3. solve on the coarse level: recursively (a V-cycle), or serially by
   forward substitution on the coarsest;
4. correct the C-points with the coarse values and F-relax.

The residual norm of the finest level is the norm of the C-point
residuals right after relaxation (the F-point residuals are zero there),
computed where step 2 needs Φ(u_{Jc-1}) anyway, as XBraid does. The
finest level's F-relaxation after the correction is deferred to the next
iteration, which starts with one (and done once after the last).

The propagator is any object with ``step(start, stop, u)``: the value at
fine point ``stop`` from ``u`` at fine point ``start`` (a coarse step spans
stop - start fine steps). Layouts come from :mod:`.partition`.
"""
import math
from typing import List, Optional, Protocol

from chainerkfac.layer_parallel import partition
from chainerkfac.layer_parallel import transport as transport_module

RELAXATIONS = ('F', 'FCF')

# Message tags: one per kind of exchange, so a message can only ever match
# the receive it was meant for.
_TAG_F, _TAG_C, _TAG_RESTRICT, _TAG_SERIAL, _TAG_GHOST = range(5)
_TAGS_PER_LEVEL = 5


class Propagator(Protocol):
    def step(self, start: int, stop: int, u, out=None):
        """The value at fine point ``stop`` propagated from ``u`` at
        ``start``, into ``out`` (never ``u``) or a new array."""


class VCycle:
    """The order of one FAS V-cycle's operations: relaxation (F or FCF),
    the C-point values restricted to the next level, the coarser cycle, the
    correction, a last F-relaxation; on the coarsest level the serial
    solve. :class:`FASSolver` does the operations and
    :class:`~chainerkfac.layer_parallel.perf_model.Schedule` times them,
    so the model follows the solver's order by construction.

    Subclasses have ``layouts`` (one per level) and ``relax``
    (:data:`RELAXATIONS`), and provide ``_f_relax``, ``_c_relax``,
    ``_c_values``, ``_restrict(level, values)``, ``_correct`` and
    ``_serial``.
    """

    def _cycle(self, level: int) -> None:
        if level == len(self.layouts) - 1:
            self._serial(level)
            return
        self._relax(level)
        self._restrict(level, self._c_values(level))
        self._cycle(level + 1)
        self._correct(level)
        self._f_relax(level)

    def _relax(self, level: int) -> None:
        self._f_relax(level)
        if self.relax == 'FCF':
            self._c_relax(level)
            self._f_relax(level)


class FASSolver(VCycle):
    """MGRIT (FAS V-cycle) for one propagator on one process.

    Parameters
    ----------
    propagator : Propagator
        Φ on every level.
    fine_owners : sequence of int
        Owner of every fine point 0 .. N.
    transport : transport.LocalTransport or transport.MPITransport
        Messages between the owners.
    coarsening : int
        c.
    levels : int or None
        Number of levels (``None``: :func:`partition.level_sizes`).
    relax : str
        ``'F'`` or ``'FCF'``.

    Attributes
    ----------
    u : list of arrays
        Per level, shape (owned points + 1, *state shape): slot 0 is the
        ghost (the point left of the first owned one), slot k the k-th
        owned point. ``u[0]`` is kept between solves (the warm start).
    steps : list of int
        Applications of Φ on each level so far, on this process.
    """

    def __init__(self, propagator: Propagator, fine_owners, transport,
                 coarsening: int, levels: Optional[int], relax: str):
        if relax not in RELAXATIONS:
            raise ValueError('relax must be one of {}, not {!r}'.format(
                RELAXATIONS, relax))
        self.propagator = propagator
        self.transport = transport
        self.coarsening = coarsening
        self.relax = relax
        n_steps = len(fine_owners) - 1
        sizes = partition.level_sizes(n_steps, coarsening, levels)
        self.layouts = [
            partition.LevelLayout(steps, coarsening ** level, fine_owners,
                                  transport.rank, coarsening)
            for level, steps in enumerate(sizes)]
        self.u: List = []
        self.g: List = []
        self.xp = None
        self.steps = [0] * len(sizes)

    @property
    def n_levels(self) -> int:
        return len(self.layouts)

    def index(self, level: int, j: int) -> int:
        """Slot of point ``j`` in ``u[level]`` (0 is the ghost)."""
        return j - self.layouts[level].first + 1

    def value(self, j: int):
        """The current value at finest point ``j`` (owned, or the ghost)."""
        return self.u[0][self.index(0, j)]

    # -- the solve ---------------------------------------------------------

    def solve(self, g0, shape, dtype, xp, max_iter: int, tol: float,
              rtol: float, warm_start: bool) -> List[float]:
        """Iterate from the kept (``warm_start``) or a zero initial guess.

        ``g0`` is u_0, given on the owner of point 0 (``None`` elsewhere).
        Returns the residual norm of every iteration; stops at the first
        one at most ``tol`` or ``rtol`` times the first, or after
        ``max_iter`` iterations.

        Raises
        ------
        FloatingPointError
            The residual is not finite (a NaN or an infinity in the input,
            the weights or the states): no iteration can bring it down, so
            the solve ends there instead of at ``max_iter``.
        """
        if max_iter < 1:
            raise ValueError('max_iter must be positive, not {}'.format(
                max_iter))
        self._allocate(shape, dtype, xp, warm_start)
        first = self.layouts[0]
        if first.count and first.first == 0:
            self.u[0][1] = g0
        history: List[float] = []
        if self.n_levels == 1:
            self._serial(0)
            history.append(self._residual_norm(0, self._c_values(0)))
        else:
            corrected = False
            for _ in range(max_iter):
                self._relax(0)
                values = self._c_values(0)
                history.append(self._residual_norm(0, values))
                if not math.isfinite(history[-1]):
                    raise FloatingPointError(
                        'MGRIT: the residual is {} at iteration {} (a NaN '
                        'or an infinity in the input, the weights or the '
                        'states)'.format(history[-1], len(history)))
                if history[-1] <= tol or history[-1] <= rtol * history[0]:
                    corrected = False
                    break
                self._restrict(0, values)
                self._cycle(1)
                self._correct(0)
                corrected = True
            if corrected:
                self._f_relax(0)
        self._refresh_ghost(0)
        return history

    def _allocate(self, shape, dtype, xp, warm_start: bool) -> None:
        """Arrays for every level, reused while the state's shape stays:
        fresh memory costs a page fault per page on first touch, more than
        the layers on small states. A cold start zeroes the finest level
        (the coarse levels are overwritten by every restriction)."""
        shape = tuple(shape)
        if self.u and self.u[0].shape[1:] == shape and \
                self.u[0].dtype == dtype:
            if not warm_start:
                self.u[0].fill(0)
            return
        self.xp = xp
        self.u = [xp.zeros((layout.count + 1,) + shape, dtype)
                  for layout in self.layouts]
        # The finest level's right-hand side is zero but for u_0 = g_0.
        self.g = [None] + [xp.zeros((layout.count + 1,) + shape, dtype)
                           for layout in self.layouts[1:]]

    # -- Φ -----------------------------------------------------------------

    def _phi(self, level: int, j: int, value, out=None):
        """Φ on ``level`` from point j - 1 (holding ``value``) to j."""
        layout = self.layouts[level]
        self.steps[level] += 1
        return self.propagator.step(layout.fine(j - 1), layout.fine(j),
                                    value, out)

    def _update(self, level: int, j: int) -> None:
        """u_j ← Φ(u_{j-1}) + g_j."""
        slot = self.index(level, j)
        u = self.u[level]
        self._phi(level, j, u[slot - 1], out=u[slot])
        if self.g[level] is not None:
            u[slot] += self.g[level][slot]

    # -- relaxation and the coarsest solve ---------------------------------

    def _f_relax(self, level: int) -> None:
        layout = self.layouts[level]
        if not layout.count:
            return
        right_needs = (layout.right is not None
                       and not layout.is_c(layout.last + 1))
        # A C-point is not changed by F-relaxation: it goes at once; an
        # F-point (an interval split between processes) once it is final.
        early = right_needs and layout.is_c(layout.last)
        self._exchange(level, _TAG_F, send=early,
                       receive=layout.left is not None
                       and not layout.is_c(layout.first))
        for j in layout.owned_f_points():
            self._update(level, j)
        if right_needs and not early:
            self._exchange(level, _TAG_F, send=True, receive=False)

    def _c_relax(self, level: int) -> None:
        layout = self.layouts[level]
        if not layout.count:
            return
        self._exchange_for_c_points(level, _TAG_C)
        for j in layout.owned_c_points():
            self._update(level, j)

    def _serial(self, level: int) -> None:
        """Forward substitution, handed from process to process."""
        layout = self.layouts[level]
        if not layout.count:
            return
        self._exchange(level, _TAG_SERIAL, send=False,
                       receive=layout.left is not None)
        for j in layout.points():
            if j > 0:
                self._update(level, j)
        self._exchange(level, _TAG_SERIAL, send=layout.right is not None,
                       receive=False)

    # -- restriction, residual, correction ---------------------------------

    def _c_values(self, level: int) -> dict:
        """Φ(u_{j-1}) + g_j at every owned C-point j >= 1."""
        layout = self.layouts[level]
        if not layout.count:
            return {}
        self._exchange_for_c_points(level, _TAG_RESTRICT)
        values = {}
        for j in layout.owned_c_points():
            slot = self.index(level, j)
            value = self._phi(level, j, self.u[level][slot - 1])
            if self.g[level] is not None:
                value += self.g[level][slot]
            values[j] = value
        return values

    def _residual_norm(self, level: int, values: dict) -> float:
        squares = [transport_module.squared_norm(
            value - self.u[level][self.index(level, j)])
            for j, value in sorted(values.items())]
        return transport_module.norm_of_squares(
            self.transport.allgather(squares))

    def _restrict(self, level: int, values: dict) -> None:
        """Inject u into the coarse level and set its FAS right-hand side
        g_Δ,J = (Φ(u_{Jc-1}) + g_{Jc}) - Φ_Δ(u_{(J-1)c})."""
        coarse = self.layouts[level + 1]
        if not coarse.count:
            return
        c = self.coarsening
        u_coarse, g_coarse = self.u[level + 1], self.g[level + 1]
        for jc in coarse.points():
            u_coarse[self.index(level + 1, jc)] = \
                self.u[level][self.index(level, jc * c)]
        self._exchange(level + 1, _TAG_RESTRICT,
                       send=coarse.right is not None,
                       receive=coarse.left is not None)
        xp = self.xp
        for jc in coarse.points():
            if jc > 0:
                slot = self.index(level + 1, jc)
                xp.subtract(values[jc * c],
                            self._phi(level + 1, jc, u_coarse[slot - 1]),
                            out=g_coarse[slot])

    def _correct(self, level: int) -> None:
        """u_{Jc} ← v_J: FAS's u + (v - u_Δ), u_Δ = u at the C-points."""
        c = self.coarsening
        for jc in self.layouts[level + 1].points():
            if jc > 0:
                self.u[level][self.index(level, jc * c)] = \
                    self.u[level + 1][self.index(level + 1, jc)]

    # -- messages ----------------------------------------------------------

    def _exchange(self, level: int, kind: int, send: bool,
                  receive: bool) -> None:
        """Send the last owned point to the right neighbour and/or receive
        the ghost from the left one; return when both are done.

        The receive is posted before the send starts: a large message
        needs both ends in MPI to progress (without a single-copy
        transport a send started and left alone does not complete while
        its process computes), and this way neither end waits for the
        other to reach a later call.
        """
        layout = self.layouts[level]
        tag = self._tag(level, kind)
        requests = []
        if receive:
            requests.append(self.transport.irecv(
                self.u[level][0], layout.left, tag))
        if send:
            requests.append(self.transport.isend(
                self.u[level][layout.count], layout.right, tag))
        self.transport.waitall(requests)

    def _exchange_for_c_points(self, level: int, kind: int) -> None:
        """Give the right neighbour the F-point left of its first C-point;
        receive ours."""
        layout = self.layouts[level]
        self._exchange(
            level, kind,
            send=layout.right is not None and layout.is_c(layout.last + 1),
            receive=layout.left is not None and layout.is_c(layout.first))

    def _refresh_ghost(self, level: int) -> None:
        """Make every ghost the final value of its point (the weight
        gradient of a block's first layer needs its input state)."""
        layout = self.layouts[level]
        if layout.count:
            self._exchange(level, _TAG_GHOST, send=layout.right is not None,
                           receive=layout.left is not None)

    @staticmethod
    def _tag(level: int, kind: int) -> int:
        return level * _TAGS_PER_LEVEL + kind

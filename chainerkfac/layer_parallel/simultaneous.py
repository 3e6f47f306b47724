"""Simultaneous layer-parallel training, the seed's Algorithm 2.

Every optimizer step runs only m1 forward and m2 adjoint MGRIT iterations
(m1 = m2 = 2 in the seed), each warm-started from the previous step's
states and adjoints, and updates the weights with the resulting inexact
gradient (the One-shot method, section 4). With m1, m2 large it is
layer-serial training with exact gradients, distributed over the layers.

The seed preconditions with L-BFGS and a line search; here any Chainer
optimizer updates the weights (the experiments use Adam), or K-FAC
(:class:`chainerkfac.optimizers.KFAC`, set up on the owned layers and
distributed over the data replicas by :func:`.kfac.setup_kfac`): each
process updates the parameters it owns, which the next forward sends to
the processes whose coarse levels need them.
"""
import logging
import math
from typing import NamedTuple, Optional

import numpy

from chainerkfac.layer_parallel import kfac
from chainerkfac.layer_parallel.grid import ProcessGrid
from chainerkfac.layer_parallel.mgrit import MGRIT
from chainerkfac.optimizers.kfac import KFAC
from chainerkfac.layer_parallel.regularization import \
    accumulate_time_smoothness

logger = logging.getLogger(__name__)


class StepResult(NamedTuple):
    """One optimizer step: the mean cross-entropy and training accuracy of
    the batch (from the inexact states), the regularisation R(θ), and the
    last state and adjoint residual norms."""

    loss: float
    accuracy: float
    regularization: float
    state_residual: float
    adjoint_residual: float


class SimultaneousTraining:
    """Algorithm 2 with a Chainer optimizer.

    Parameters
    ----------
    mgrit : MGRIT
        With ``warm_start=True`` (the point of the method).
    optimizer : chainer.Optimizer
        Set up here on ``mgrit.net`` if it has no target yet; the update
        rules of the parameters other processes own are disabled, so no
        optimizer state is kept for them. A K-FAC not set up yet is set up
        by :func:`.kfac.setup_kfac` (blocks of the owned layers, its
        factors from MGRIT's states and adjoints, distributed over the
        grid's data replicas with the ``'naive'`` communicator; call
        ``setup_kfac`` first for another).
    m1, m2 : int
        Forward and adjoint MGRIT iterations per step.
    grid : ProcessGrid or None
        Layers × data: gradients are averaged over ``grid.data_comm``
        and the caller passes each replica its share of the batch.
    smoothness : float
        β of the seed's time-derivative regularisation
        (:func:`.regularization.accumulate_time_smoothness`; 0: none).
    """

    def __init__(self, mgrit: MGRIT, optimizer, m1: int = 2, m2: int = 2,
                 grid: Optional[ProcessGrid] = None,
                 smoothness: float = 0.0):
        self.mgrit = mgrit
        self.m1, self.m2 = m1, m2
        self.smoothness = smoothness    # checked before anything is done
        self.grid = grid
        if grid is not None and grid.agree_on_weights(mgrit) and \
                grid.replica == 0:
            logger.warning(
                "SimultaneousTraining: the network's weights differed "
                "between replicas (built with different seeds?); replica "
                "0's were broadcast")
        if isinstance(optimizer, KFAC) and optimizer.target is None:
            kfac.setup_kfac(optimizer, mgrit, grid)
        elif optimizer.target is None:
            optimizer.setup(mgrit.net)
        #: The optimizer averages the gradients over the replicas itself.
        self._optimizer_reduces = kfac.replicas_reduced(optimizer, grid)
        owned = {id(param) for _, param in mgrit.owned_params()}
        for param in mgrit.net.params():
            if id(param) not in owned:
                param.update_rule.enabled = False
        self.optimizer = optimizer

    # -- options, checked where they are set (also after construction) ------
    @property
    def m1(self) -> int:
        """MGRIT iterations of the forward solve a step (an integer >= 1;
        settable, checked)."""
        return self._m1

    @m1.setter
    def m1(self, value) -> None:
        self._m1 = _iterations('m1', value)

    @property
    def m2(self) -> int:
        """MGRIT iterations of the adjoint solve a step (as :attr:`m1`)."""
        return self._m2

    @m2.setter
    def m2(self, value) -> None:
        self._m2 = _iterations('m2', value)

    @property
    def smoothness(self) -> float:
        """β of the time-derivative regularisation (a finite number >= 0;
        settable, checked: -1 rewarded rough weights, NaN made every weight
        NaN after one step)."""
        return self._smoothness

    @smoothness.setter
    def smoothness(self, value) -> None:
        if isinstance(value, bool) or not isinstance(
                value, (int, float, numpy.integer, numpy.floating)) or \
                not math.isfinite(value) or value < 0:
            raise ValueError('smoothness must be a finite number >= 0 (0: '
                             'no regularisation), got {!r}'.format(value))
        self._smoothness = value

    def step(self, x, t) -> StepResult:
        """One optimizer step on the (local) batch ``x``, ``t``."""
        mgrit = self.mgrit
        mgrit.net.cleargrads()
        logits, states = mgrit.forward(x, max_iter=self.m1)
        loss, adjoints = mgrit.backward(t, max_iter=self.m2)
        accuracy = float((logits.argmax(axis=1) == t).mean())
        if self.grid is not None:
            if not self._optimizer_reduces:
                self.grid.allreduce_grads(mgrit)
            loss = self.grid.mean(loss)
            accuracy = self.grid.mean(accuracy)
        regularization = 0.0
        if self.smoothness:
            # Not data: added once, after the replicas' average (or before
            # K-FAC's, the same on every replica, so the average keeps it).
            regularization = accumulate_time_smoothness(mgrit,
                                                        self.smoothness)
        self.optimizer.update()
        return StepResult(loss, accuracy, regularization, states[-1],
                          adjoints[-1])


def _iterations(name, value) -> int:
    if isinstance(value, bool) or not isinstance(
            value, (int, numpy.integer)) or value < 1:
        raise ValueError('{} must be an integer >= 1 (MGRIT iterations a '
                         'step), got {!r}'.format(name, value))
    return value

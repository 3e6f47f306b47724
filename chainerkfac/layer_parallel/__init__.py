"""Layer-parallel training of deep residual networks by nonlinear multigrid
over the layers (Günther, Ruthotto, Schroder, Cyr and Gauger, seed 003).

A ResNet is forward Euler, u_{n+1} = u_n + h σ(K_n u_n + b_n). MGRIT
replaces serial forward and backward propagation by multigrid iterations
over the layer index, with the layers distributed over processes; at
convergence it computes exactly the serial gradient, and stopping it early
gives simultaneous ("one-shot") training.

* :class:`ResidualODE` — the network (a ``chainer.Chain``; dense or
  convolutional layers);
* :class:`MGRIT` — layer-parallel ``forward`` / ``backward``;
* :class:`ProcessGrid` — layers × data on a 2-D grid of processes;
* :class:`SimultaneousTraining` — the seed's Algorithm 2, with any Chainer
  optimizer or K-FAC;
* :func:`setup_kfac` — K-FAC on the layers each process owns, its factors
  from MGRIT's states and adjoints, over the data replicas;
* :func:`time_smoothness`, :func:`accumulate_time_smoothness` — the seed's
  time-derivative regularisation, layer-serial and layer-parallel;
* :mod:`.perf_model` — the critical-path performance model;
* :mod:`.data` — the Peaks level sets and the digits.
"""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

from chainerkfac.layer_parallel.activations import smooth_relu  # NOQA
from chainerkfac.layer_parallel.mgrit import MGRIT  # NOQA
from chainerkfac.layer_parallel.network import ResidualODE  # NOQA
from chainerkfac.layer_parallel.grid import ProcessGrid  # NOQA
from chainerkfac.layer_parallel.kfac import setup_kfac  # NOQA
from chainerkfac.layer_parallel.simultaneous import (  # NOQA
    SimultaneousTraining)
from chainerkfac.layer_parallel.simultaneous import StepResult  # NOQA
from chainerkfac.layer_parallel.regularization import time_smoothness  # NOQA
from chainerkfac.layer_parallel.regularization import (  # NOQA
    accumulate_time_smoothness)

"""BackPACK's gradient statistics and curvature for any Chainer model.

``extract(predictor, x, t, quantities=...)`` returns, alongside the
gradient of the mean loss in ``param.grad``, per-sample gradients and their
statistics, diagonal and Kronecker-factored approximations of the
generalized Gauss-Newton matrix, KFRA and the Hessian diagonal, with the
conventions of BackPACK (Dangel, Kunstner & Hennig, ICLR 2020), so that
numbers compare across the two (:mod:`chainerkfac.curvature.quantities`).

It listens to the same capture as the optimizer
(:class:`chainerkfac.capture.BackwardCapture`) and takes its second-order
quantities from extra backward passes of Chainer's own autodiff, so it
works on residual networks, shared weights, grouped convolutions and
BatchNormalization (test mode as an affine layer; training mode by
per-sample passes), and over several processes with a ChainerMN
communicator.
"""
from chainerkfac.curvature.extraction import extract  # NOQA
from chainerkfac.curvature.graph import UnsupportedGraph  # NOQA
from chainerkfac.curvature.quantities import CONV_FACTORS  # NOQA
from chainerkfac.curvature.quantities import FIRST_ORDER  # NOQA
from chainerkfac.curvature.quantities import KRONECKER  # NOQA
from chainerkfac.curvature.quantities import QUANTITIES  # NOQA
from chainerkfac.curvature.quantities import SECOND_ORDER  # NOQA

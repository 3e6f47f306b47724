"""Chainer Trainer extensions for K-FAC runs.

* :mod:`~chainerkfac.training.lr_schedules` — learning rate and momentum
  of eqs. (17)-(18) (:class:`PolynomialLRDecay`), and the linear warm-up of
  the first-order baselines (:class:`LinearWarmupLR`);
* :mod:`~chainerkfac.training.run_logs` — what a run records for the
  figures: Diff(t) of eq. (21) (:class:`FisherDiffLog`, Figure 5) and the
  time to a target accuracy (:class:`TimeToAccuracy`).
"""
from chainerkfac.training.lr_schedules import LinearWarmupLR  # NOQA
from chainerkfac.training.lr_schedules import PolynomialLRDecay  # NOQA
from chainerkfac.training.lr_schedules import polynomial_decay  # NOQA
from chainerkfac.training.lr_schedules import step_decay  # NOQA
from chainerkfac.training.run_logs import FisherDiffLog  # NOQA
from chainerkfac.training.run_logs import TimeToAccuracy  # NOQA

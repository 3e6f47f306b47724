"""CUDA-graph replay of steady-state training steps (opt-in).

A steady-state step launches the same kernels on the same buffers every
time; Python's share of it (the host time that made Chainer's cuDNN step
host-bound on an H100) can go by capturing it once as a CUDA graph and
replaying it. :class:`~chainerkfac.graphs.step.StepGraph` decides per call
whether to run the step eagerly, capture it or replay it, and says why
(:mod:`chainerkfac.graphs.step`); :mod:`chainerkfac.graphs.gemm` gives the
step GEMMs that may be captured (our own cuBLAS handle, bound by
:mod:`chainerkfac.graphs.cublas`), since CuPy 14 refuses cuBLAS during
capture. The one-line switch::

    optimizer = chainerkfac.graphs.graphed(optimizer)   # after setup
    optimizer.update(model, x, t)     # eager, captured or replayed

Replayable: K-FAC's stale steps (its refresh steps run eagerly:
:mod:`chainerkfac.graphs.kfac_step`),
:class:`~chainerkfac.optimizers.GuardedOptimizer`'s steps
(:mod:`chainerkfac.graphs.guarded_step`) and Chainer's MomentumSGD and SGD,
each on one process. Their skipped-step guard is then
:class:`~chainerkfac.device_guard.DeviceStepGuard` and their learning
rate, momentum and damping live in device memory
(:mod:`chainerkfac.graphs.hyper`), so a schedule needs no new capture.
Nothing here has run on a GPU yet (docs/gpu.md lists the runs that will
tell).
"""
from chainerkfac.graphs.graphed import GraphedOptimizer, graphed  # NOQA
from chainerkfac.graphs.step import ChainerOptimizer, StepGraph  # NOQA

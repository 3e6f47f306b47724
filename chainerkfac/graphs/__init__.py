"""CUDA-graph replay of steady-state training steps (opt-in).

A steady-state step launches the same kernels on the same buffers every
time; Python's share of it (the host time that made Chainer's cuDNN step
host-bound on an H100) can go by capturing it once as a CUDA graph and
replaying it. :class:`~chainerkfac.graphs.step.StepGraph` decides per call
whether to run the step eagerly, capture it or replay it, and says why
(:mod:`chainerkfac.graphs.step`); :mod:`chainerkfac.graphs.gemm` gives the
step GEMMs that may be captured (our own cuBLAS handle, bound by
:mod:`chainerkfac.graphs.cublas`), since CuPy 14 refuses cuBLAS during
capture::

    graph = chainerkfac.graphs.StepGraph(
        lambda x, t: optimizer.update(model, x, t),
        chainerkfac.graphs.ChainerOptimizer(optimizer))
    for x, t in batches:
        graph(x, t)

Replayable today: Chainer's MomentumSGD and SGD without hooks. Not yet:
K-FAC's stale steps and :class:`~chainerkfac.optimizers.GuardedOptimizer`,
whose skipped-step guard reads its finite check on the host (a device-side
guard, capture-safe pointer tables in :mod:`chainerkfac.fused` and device
hyperparameters are what they need); their steps fail to capture, which
:class:`StepGraph` reports before running them eagerly. Nothing here has
run on a GPU yet (docs/gpu.md lists the runs that will tell).
"""
from chainerkfac.graphs.step import ChainerOptimizer, StepGraph  # NOQA

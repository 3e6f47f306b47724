"""CUDA-graph replay of steady-state training steps.

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

Replayable: K-FAC's stale steps (its refresh steps run eagerly, or with
``graphed(optimizer, refresh_steps=True)`` all but their inverse stage
from two graphs: :mod:`chainerkfac.graphs.kfac_step`),
:class:`~chainerkfac.optimizers.GuardedOptimizer`'s steps
(:mod:`chainerkfac.graphs.guarded_step`) and Chainer's MomentumSGD and SGD,
each on one process. Their skipped-step guard is then
:class:`~chainerkfac.device_guard.DeviceStepGuard` and their learning
rate, momentum and damping live in device memory
(:mod:`chainerkfac.graphs.hyper`), so a schedule needs no new capture.
The library leaves it to the caller to wrap an optimizer;
``train_imagenet.py --gpu`` does it by default where it applies
(``--cuda-graphs auto``). Replayed, the kernels' GPU time is the step:
give cuDNN room and time its algorithms
(``chainer.backends.cuda.set_max_workspace_size(1 << 30)``,
``chainer.config.autotune = True``; on an H200 the replayed ResNet-50
SGD step at batch 32 went from 0.0419 s to 0.0202 s). Tested on an H200
(``tests/gpu/test_kfac_graphs_gpu.py``; measurements in docs/gpu.md).
"""
from chainerkfac.graphs.graphed import GraphedOptimizer, graphed  # NOQA
from chainerkfac.graphs.step import ChainerOptimizer, StepGraph  # NOQA

"""Time of one training step: momentum SGD vs K-FAC, K-FAC's stages, and
its factor capture by layer type; or the inverse stage alone.

    python -m benchmarks.step_time [--smoke] [--gpu] [--out FILE.json]
        [--models small,resnet50] [--variants sgd,kfac_every,...]
        [--rounds N] [--resnet50-rounds N] [--interval 20] [--threads 1]
        [--profile] [--conv-a auto|shifted|unfolded] [--inverse-only
        [--inverse-methods cholesky,newton_schulz]
        [--newton-schulz-max-dim N]] [--peer]
        [--batches 32,64,128,256] [--workspace-sizes 8MiB,64MiB,1GiB]
        [--autotune [auto|on|off]]

For each model (CPU: the small ResNet at batch 128, 32x32, and ResNet-50 at
batch 8, 224x224; ``--gpu``: the same small ResNet and ResNet-50 at batch
32 on GPU 0) each variant trains its own copy of the same network on the
same fixed batch:

* ``sgd``: Chainer's MomentumSGD as ``train_imagenet.py`` runs it,
  :class:`chainerkfac.optimizers.FusedMomentumSGD` (its update in
  multi-tensor kernels on the GPU, as PyTorch's SGD; the same steps)
  (cleargrads, forward, backward, update);
* ``kfac_every``: :class:`chainerkfac.optimizers.KFAC`, every factor
  refreshed (and inverted) every step;
* ``kfac_stale``: K-FAC with refresh intervals ``--interval`` (20): its
  steady state, steps that refresh nothing and reuse the stored inverses;
* ``kfac_diag_bn``: every step, diagonal BN Fisher (``bn_fisher='diag'``);
* ``kfac_fp16``: every step, factors built from fp16 products
  (``factor_dtype='float16'``);
* ``kfac_tf32``: every step, float32 factors built from TF32 products
  and stage 5's products in TF32 (``factor_dtype='tf32'``,
  ``precondition_dtype='tf32'``: Tensor Cores on the GPU, for the
  capture's and the preconditioning's GEMMs; the CPU rounds the operands,
  so it is no faster there);
* ``kfac_newton_schulz``: every step, the factors up to n = 1024
  inverted by the batched Newton–Schulz iteration
  (``inverse_method='newton_schulz'``);
* ``kfac_low_rank``: every step at ``KFAC()``'s own default, a factor of
  few per-sample vectors kept low rank and inverted by Woodbury, exactly
  (``low_rank=True``);
* ``kfac_cholesky_solve`` (the CPU only): every step, the damped
  factors' Cholesky factors kept and stage 5 solving with them, no
  inverse formed (``inverse_method='cholesky_solve'``);
* ``kfac_shifted``: every step, each stride-1 convolution's A formed by
  shifted products (``conv_a_strategy='shifted'``; ``kfac_every`` takes
  the library's choice: on the GPU the unfolded product, or under
  autotune the faster by timing; not in ``--gpu``'s default run);
* ``sgd_graph`` (``--gpu``): the momentum SGD step through
  :class:`chainerkfac.graphs.StepGraph`, captured once as a CUDA graph
  and replayed (its counts of eager / captured / replayed steps are
  recorded in ``graph_stats``, the seconds of each capture in
  ``graph_capture_s``);
* ``kfac_stale_graph`` (``--gpu``): ``kfac_stale`` through
  :func:`chainerkfac.graphs.graphed`: refresh steps eager, the stale steps
  replayed (each cycle's first captured again; counts and capture seconds
  as for ``sgd_graph``);
* ``kfac_stale_graph_tf32`` (``--gpu``): the same with ``kfac_tf32``'s
  options (its stale steps' preconditioning on TF32 Tensor Cores);
* ``kfac_every_graph`` (``--gpu``): ``kfac_every`` through
  ``graphs.graphed(..., refresh_steps=True)``: each step's forward and
  backward passes (with the capture of the factors) replayed from a CUDA
  graph, its factors' average and inverses eager, its end (stage 5, the
  update) from another graph; its counts in ``graph_stats`` are
  ``'refresh passes: ...'`` and ``'refresh update: ...'``.

The CPU runs ``sgd``, ``kfac_every`` and ``kfac_stale`` by default,
``--gpu`` all but ``kfac_shifted`` (``--variants`` picks any subset that
has ``sgd``).

**cuDNN on the GPU** is set as ``train_imagenet.py --gpu`` sets it
(:func:`harness.tuning.cudnn_tuning`, whose start-up line the benchmark
prints and records as ``cudnn``): where a replayed variant runs, as a run
replays its steps by default, the convolution algorithms are timed
(``chainer.config.autotune``) with a 1 GiB workspace limit, for every
variant of the run; otherwise cuDNN's heuristics within Chainer's 8 MiB.
``--autotune on|off`` and ``--workspace-sizes`` override either. So the
default ``--gpu --peer`` run times the steps a user's run takes.

After warm-up steps, the variants are timed in *rounds* (one step of each,
in an order rotated every round), so that the machine's noise hits all
alike; each ratio to SGD is the median over rounds of the ratio within a
round. The stale optimizer's refresh steps are kept apart (a refresh step
does the work of an every-step K-FAC step); the *amortised* cost over one
refresh cycle of ``k`` steps is, per round, ``(t_every + (k − 1) t_stale)
/ k``, then the median. A replayed stale variant (``kfac_stale_graph``)
is stepped on, after the rounds, to its next refresh step and one step
past it (``refresh_cycle`` in the JSON): where that step captured the
graph again (the refresh dropped it), what it took beyond a replayed step is
added to every cycle (``recapture_s``); where its cycle could not be
timed, its amortised figures are left out. With ``kfac_every_graph`` in
the run, ``images_per_s`` also has the replayed stale cycle whose refresh
step is replayed too but for its inverses (``--replay-refresh-steps``),
``kfac_stale_graph_amortised_replayed_refresh``: that step's median in
place of ``kfac_every``'s. Stage times
(:attr:`KFAC.stage_times`: forward_backward = stages 1-2 with factor
capture, factors, reduce_scatter, inverse, precondition, all_gather,
update) are medians over the timed steps; for SGD, forward_backward and
update.

**Out of device memory.** Every variant's model, K-FAC state and graphs
live in one process (a graph keeps its step's memory). A variant that
runs out of device memory beside the others, or whose capture does and
is never replayed, is timed again after the rounds, alone with SGD, once
the others are let go (``timed_alone`` in the JSON, a ``TIMED ALONE``
line): ResNet-50 at batch 128 on an 80 GB H100 lost two of seven
variants so (2026-11-27). A variant that fails otherwise is reported
(``failed``) and left out of the figures: what it timed before it failed
may not be the step it names.

**Capture.** K-FAC's capture is measured two ways: as the difference of
forward_backward medians (K-FAC every step minus SGD, both in the rounds),
and directly, in extra every-step K-FAC steps after the rounds in which the
benchmark wraps each Fisher block's ``capture_inputs`` /
``capture_gradients`` in a timer (on GPU with a device synchronisation
before and after each call, which is why those steps are kept out of the
rounds): seconds per refresh step by layer type (``Linear A``,
``Linear G``, ``Conv A``, ``Conv G``, ``BN F``), medians over the steps.
Each of those steps follows an SGD step, and the total's ratio to that SGD
step (median) is the figure to compare between runs.

**GPU** (``--gpu``, CuPy, device 0): the device is synchronised before and
after every timed step, and :attr:`KFAC.synchronize_stage_timers` is set,
so the stage split is the device's, not the launch queue's. A fresh GPU
compiles CuPy's kernels on first use: the warm-up steps absorb that.

**Convolutions' A** is formed the cheaper way by the library's cost model
(:mod:`chainerkfac.fisher_blocks.patches`); ``--conv-a shifted`` or
``unfolded`` forces one wherever it applies, to compare them on a machine.

**Inverse stage alone** (``--inverse-only``; ResNet-50 by default): one
every-step K-FAC step captures the model's real factors (ResNet-50: 161
matrices, 107 K-FAC layers), then the inverse stage runs as the optimizer
runs it: every block's ``inverse_requests`` (the trace-norm split of the
damping for Kronecker blocks, ρ_BN·γ for BN) in one
:func:`chainerkfac.linalg.damped_inverses` call, ``--rounds`` times
(default 5); the median total is reported with the count of matrices, Σn³
and the largest n, and the seconds per factor kind (``A``, ``G``, ``F``,
each as its own call). The in-step figure is
the ``inverse`` stage of the step benchmark. ``--inverse-methods`` times
each listed method of :func:`chainerkfac.linalg.damped_inverses` on the
same factors (``newton_schulz``: the batched GEMM iteration up to
``--newton-schulz-max-dim``), with its largest relative deviation from
Cholesky's inverses.

Goals (reported, not asserted): CPU small ResNet, every step ≤ 1.2x and
stale ≤ 1.3x SGD, ResNet-50 stale ≤ 1.3x SGD (issue 13 and earlier); GPU
ResNet-50, capture ≤ 0.05 s per refresh step and the inverse stage alone
≤ 0.06 s (issue 26), forward_backward with capture ≤ 1.35x SGD's whole
step, fp16 factors faster than fp32 (issue 13), stale ≤ 1.05x SGD
(issue 12). Against the peer in the same run (``--peer``; issue 26,
:data:`PEER_GOALS`): our SGD step ≤ PyTorch's, our stale K-FAC step ≤
0.8x kfac-pytorch's, our every-step K-FAC step ≤ 0.5x kfac-pytorch's
inverse method, each with the replayed step where that variant ran.
Timings are only comparable within one run.

BLAS threads: ``--threads`` (default 1, through threadpoolctl); the JSON
records the count in effect.

**Peer** (``--peer``, with ``--gpu``): after our figures, PyTorch SGD and
kfac-pytorch on torchvision's ResNet-50 at the same batch and size, in the
same process (:mod:`benchmarks.peer_pytorch`; skipped, with the reason in
the JSON, where PyTorch, torchvision or kfac-pytorch cannot be imported),
recorded as ``peer_pytorch`` and tabled beside ours.

**Throughput sweep** (``--batches``, ``--workspace-sizes``): the step
timing again at each per-GPU batch and each cuDNN workspace limit
(``chainer.backends.cuda.set_max_workspace_size``; ``--autotune`` times
cuDNN's algorithms, ``chainer.config.autotune``), and, with ``--peer``, the
peer at each batch in the same run; reported as images per second: SGD,
K-FAC every step, K-FAC stale (its steady state alone, and amortised over
a refresh cycle: ``batch · k / (t_every + (k − 1) t_stale)`` from the
medians), beside PyTorch SGD and kfac-pytorch's inverse method, every step
and stale (amortised the same way), in a table and a PNG beside the JSON
(``--out`` with ``.png``). Why a workspace limit matters: with more
workspace cuDNN's heuristics may pick algorithms (FFT, FFT tiling,
Winograd non-fused) that launch several kernels per convolution and need
hundreds of MiB, which costs host time where the step is host-bound and
GPU time where the heuristics misjudge; timing (``--autotune``) picks by
measurement. The sweep measures which limit is fastest on a machine.
"""
import argparse
import collections
import cProfile
import contextlib
import functools
import gc
import io
import json
import os
import pstats
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable, Dict, List, Optional, Sequence

import chainerkfac  # NOQA  (before chainer: NumPy-2 compatibility shims)
import chainer
import numpy

import models
from benchmarks import _args
from benchmarks import _common
from chainerkfac import fisher_blocks
from chainerkfac.fisher_blocks import patches
from chainerkfac import linalg
from chainerkfac import linalg_cuda
from chainerkfac import newton_schulz
from chainerkfac.optimizers import KFAC, FusedMomentumSGD
from harness import sizes, tuning

#: name -> KFAC keyword arguments (the refresh interval is added).
KFAC_VARIANTS = {
    'kfac_every': {},
    'kfac_stale': {},
    'kfac_diag_bn': {'bn_fisher': 'diag'},
    'kfac_fp16': {'factor_dtype': 'float16'},
    'kfac_tf32': {'factor_dtype': 'tf32', 'precondition_dtype': 'tf32'},
    'kfac_newton_schulz': {'inverse_method': 'newton_schulz'},
    # the library's default: a factor of few per-sample vectors (BN's
    # Fisher and the FC's A at a small per-GPU batch, the 3×3 convs' A of
    # res5) inverted by Woodbury, exactly
    'kfac_low_rank': {'low_rank': True},
    # A of the stride-1 convolutions from shifted products (the CPU's
    # choice where its cost model says so, the GPU's to be timed)
    'kfac_shifted': {'conv_a_strategy': 'shifted'},
    # the CPU only: Cholesky factors kept, stage 5 by triangular solves
    'kfac_cholesky_solve': {'inverse_method': 'cholesky_solve'},
}
#: The opt-in CUDA-graph variants (``--gpu``).
GRAPH_VARIANTS = ('sgd_graph', 'kfac_stale_graph', 'kfac_stale_graph_tf32',
                  'kfac_every_graph')
#: The replayed K-FAC variants: name -> KFAC keyword arguments, and the
#: every-step variant whose step their refresh steps take.
KFAC_GRAPH_VARIANTS = {
    'kfac_stale_graph': ({}, 'kfac_every'),
    'kfac_stale_graph_tf32': (KFAC_VARIANTS['kfac_tf32'], 'kfac_tf32'),
}
VARIANTS = ('sgd',) + tuple(KFAC_VARIANTS) + GRAPH_VARIANTS
CPU_VARIANTS = ('sgd', 'kfac_every', 'kfac_stale')
#: ``inverse_method='cholesky_solve'`` refuses GPU arrays.
CPU_ONLY_VARIANT = 'kfac_cholesky_solve'
#: --gpu's default: every variant, the replayed ones with them
#: (``train_imagenet.py --gpu`` replays the steps that refresh nothing),
#: but the shifted A, which runs apart until a GPU has timed it.
GPU_VARIANTS = tuple(v for v in VARIANTS
                     if v not in ('kfac_shifted', CPU_ONLY_VARIANT))
#: --gpu --batches' default: what the throughput table and the goals
#: against the peer read (SGD, K-FAC every step dense and low-rank, the
#: stale step, the replayed SGD and stale steps): half the default run's
#: variants, its time and its memory at each batch.
SWEEP_GPU_VARIANTS = ('sgd', 'kfac_every', 'kfac_stale', 'kfac_low_rank',
                      'sgd_graph', 'kfac_stale_graph', 'kfac_every_graph')
#: Variants with refresh steps, kept apart as ``<variant>_refresh``.
STALE_VARIANTS = ('kfac_stale', 'kfac_stale_graph', 'kfac_stale_graph_tf32')
#: Every-step variants whose capture is timed by layer type.
CAPTURE_VARIANTS = ('kfac_every', 'kfac_diag_bn', 'kfac_fp16', 'kfac_tf32',
                    'kfac_low_rank', 'kfac_shifted')
STAGES = ('forward_backward', 'factors', 'reduce_scatter', 'inverse',
          'precondition', 'all_gather', 'update')
CAPTURE_TYPES = ('Linear A', 'Linear G', 'Conv A', 'Conv G', 'BN F')
CONV_A = ('auto', 'shifted', 'unfolded')
#: Reported, not asserted; ratios to SGD unless named otherwise.
GOALS = {
    'cpu': {'small': {'kfac_every': 1.2, 'kfac_stale': 1.3},
            'resnet50': {'kfac_stale': 1.3}},
    'gpu': {'resnet50': {'kfac_stale': 1.05, 'capture_s': 0.05,
                         'forward_backward_over_sgd': 1.35,
                         'fp16_over_fp32': 1.0}},
}
INVERSE_GOALS = {'gpu': {'resnet50': 0.06}}
#: Ours over the peer's step in the same run, at most (issue 26): what a
#: run replays where it can (``sgd_graph``, ``kfac_stale_graph``), else
#: the eager step; K-FAC every step against kfac-pytorch's inverse method.
PEER_GOALS = (
    ('SGD step', ('sgd_graph', 'sgd'), 'sgd', 1.0),
    ('K-FAC stale step', ('kfac_stale_graph', 'kfac_stale'),
     'kfac_inverse_stale', 0.8),
    ('K-FAC every step', ('kfac_every_graph', 'kfac_every'),
     'kfac_inverse', 0.5),
    ('K-FAC every step, low-rank factors', ('kfac_low_rank',),
     'kfac_inverse', 0.5),
)

#: name -> model, batch, input size, rounds, warm-up steps, capture steps
FULL = {
    'small': dict(arch='small', kwargs={'depth': 8, 'width': 16,
                                        'n_class': 10},
                  batch=128, size=32, rounds=21, warmup=2, capture_steps=3),
    'resnet50': dict(arch='resnet50', kwargs={'n_class': 1000},
                     batch=8, size=224, rounds=5, warmup=1, capture_steps=1),
}
GPU = {
    'small': dict(FULL['small'], rounds=21, warmup=3, capture_steps=5),
    'resnet50': dict(FULL['resnet50'], batch=32, rounds=11, warmup=3,
                     capture_steps=5),
}
SMOKE = {
    'small': dict(arch='small', kwargs={'depth': 8, 'width': 4,
                                        'n_class': 10},
                  batch=8, size=16, rounds=2, warmup=1, capture_steps=1),
}


def build_model(arch: str, kwargs: Dict) -> chainer.Link:
    numpy.random.seed(0)   # every variant starts from the same weights
    return models.SoftLabelClassifier(models.build_model(arch, **kwargs))


def drop_graph(classifier: chainer.Link) -> None:
    """Let go of the step's graph that a Classifier keeps (``y``,
    ``loss``, ``accuracy``, until its next forward): with every variant's
    model holding its last step's activations, ResNet-50 at batch 256 ran
    out of an H200's 140 GB."""
    classifier.y = classifier.loss = classifier.accuracy = None


def _capture_hook(step):
    """The K-FAC capture hook of a variant's optimizer, or None."""
    estimator = getattr(getattr(step, 'optimizer', None), 'estimator', None)
    return getattr(estimator, 'capture_hook', None)


@contextlib.contextmanager
def alone(step, steps: Dict = None):
    """Run ``step`` with no other variant's K-FAC capture hook in the
    thread's function hooks. An every-step optimizer keeps its hook there
    between steps, and a hook sees every function call of every model:
    with the default run's variants alive, each step of any variant made
    a few hundred calls into the others' hooks (about 1 ms per step on
    a CPU, a few % of a GPU's eager SGD step)."""
    hooks = chainer.get_function_hooks()
    mine = _capture_hook(step)
    others = {}
    for other in (steps or {}).values():
        hook = _capture_hook(other)
        if hook is not None and hook is not mine and \
                hooks.get(hook.name) is hook:
            others[hook.name] = hooks.pop(hook.name)
    try:
        yield
    finally:
        hooks.update(others)


class SGDStep:
    """Momentum SGD (:class:`~chainerkfac.optimizers.FusedMomentumSGD`),
    timed as forward_backward + update."""

    def __init__(self, model, synchronize: Callable[[], None], lr=0.01):
        self.model = model
        self.synchronize = synchronize
        self.optimizer = FusedMomentumSGD(lr=lr, momentum=0.9)
        self.optimizer.setup(model)
        self.stage_times = {}
        self.refreshed = False

    def __call__(self, x, t):
        start = time.perf_counter()
        self.model.cleargrads()
        self.model(x, t).backward()
        self.synchronize()
        middle = time.perf_counter()
        self.optimizer.update()
        self.synchronize()
        self.stage_times = {'forward_backward': middle - start,
                            'update': time.perf_counter() - middle}


class SGDGraphStep:
    """Momentum SGD through :class:`chainerkfac.graphs.StepGraph` (GPU
    only): eager for the warm-up steps, then captured once and replayed;
    timed as a whole step (no stage split: a replay has none)."""

    def __init__(self, model, lr=0.01):
        from chainerkfac import graphs
        self.optimizer = FusedMomentumSGD(lr=lr, momentum=0.9)
        self.optimizer.setup(model)
        self.graph = graphs.StepGraph(
            lambda x, t: self.optimizer.update(model, x, t),
            graphs.ChainerOptimizer(self.optimizer))
        self.stage_times = {}
        self.refreshed = False

    def __call__(self, x, t):
        self.graph(x, t)


class KFACStep:
    """One K-FAC step (``acc_iters = 1``), refresh interval ``interval``,
    eq. (20) on every Conv/FC weight and every factor full (no cost guard)
    as in the paper (and the ImageNet configs): dense factors, the step
    unbounded."""

    def __init__(self, model, interval: int, gpu: bool, lr=0.001, **kwargs):
        self.model = model
        kwargs.setdefault('weight_rescale', True)
        kwargs.setdefault('max_factor_dim', None)
        kwargs.setdefault('low_rank', False)
        kwargs.setdefault('kl_clip', None)
        self.optimizer = KFAC(lr=lr, momentum=0.9, damping=1e-3,
                              refresh_interval_a=interval,
                              refresh_interval_g=interval,
                              refresh_interval_f=interval, verbose=False,
                              **kwargs)
        self.optimizer.setup(model)
        self.optimizer.synchronize_stage_timers = gpu
        self.stage_times = {}
        self.refreshed = False

    def __call__(self, x, t):
        self.optimizer.update(self.model, x, t)
        self.stage_times = dict(self.optimizer.stage_times)
        last = self.optimizer.last_refresh
        self.refreshed = any(v == self.optimizer.t - 1 for v in last.values())


class KFACGraphStep(KFACStep):
    """:class:`KFACStep` through :func:`chainerkfac.graphs.graphed` (GPU
    only): refresh steps eager, stale steps replayed; timed as a whole
    step (no stage timers: a replay has none, and synchronised timers
    would refuse the capture)."""

    def __init__(self, model, interval: int, refresh_steps: bool = False,
                 **kwargs):
        from chainerkfac import graphs
        super().__init__(model, interval, False, **kwargs)
        self.stepper = graphs.graphed(self.optimizer,
                                      refresh_steps=refresh_steps)

    def __call__(self, x, t):
        self.stepper.update(self.model, x, t)
        last = self.optimizer.last_refresh
        self.refreshed = any(v == self.optimizer.t - 1 for v in last.values())

    @property
    def graph(self):
        return self.stepper.graph

    @property
    def capture_seconds(self) -> List[float]:
        """Seconds of each capture: the stale steps' graph's, then each
        refresh passes' graph's and its end's."""
        graphs = []
        for passes in self.stepper.adapter.passes_graphs.values():
            graphs += [passes, passes.adapter.update_graph]
        return list(self.graph.capture_seconds) + [
            s for graph in graphs if graph is not None
            for s in graph.capture_seconds]


class CaptureTimer:
    """Seconds spent in the Fisher blocks' capture calls, by layer type.

    Wraps ``capture_inputs`` / ``capture_gradients`` of each block instance
    of an optimizer in a timer (synchronising the device before and after
    each call) while active; the library is untouched.
    """

    LABELS = ((fisher_blocks.LinearBlock, 'Linear'),
              (fisher_blocks.Convolution2DBlock, 'Conv'),
              (fisher_blocks.BatchNormalizationBlock, 'BN'))

    def __init__(self, blocks, synchronize: Callable[[], None]):
        self.blocks = [b for b in blocks if b.factor_names]
        self.synchronize = synchronize
        self.seconds: Dict[str, float] = collections.defaultdict(float)

    def __enter__(self):
        for block in self.blocks:
            layer = next((label for cls, label in self.LABELS
                          if isinstance(block, cls)), type(block).__name__)
            forward = [n for n, kind in block.factor_kinds.items()
                       if kind.forward]
            backward = [n for n, kind in block.factor_kinds.items()
                        if not kind.forward]
            for method, factors in (('capture_inputs', forward),
                                    ('capture_gradients', backward)):
                if factors:
                    setattr(block, method, self._timed(
                        getattr(block, method),
                        '{} {}'.format(layer, '+'.join(factors))))
        return self

    def __exit__(self, *exc):
        for block in self.blocks:
            for method in ('capture_inputs', 'capture_gradients'):
                block.__dict__.pop(method, None)

    def _timed(self, method, key):
        def timed(*args):
            self.synchronize()
            start = time.perf_counter()
            method(*args)
            self.synchronize()
            self.seconds[key] += time.perf_counter() - start
        return timed


def measure(name: str, spec: Dict, variants: Sequence[str], interval: int,
            rounds: int, warmup: int, array_module, profile: bool = False,
            target: str = 'cpu', kfac_options: Dict = None,
            save: Callable[[Dict], None] = None) -> Dict:
    """Time the variants on one model (see the module docstring); with
    ``profile``, then cProfile one more every-step K-FAC step.
    ``kfac_options`` go to every K-FAC variant (``conv_a_strategy``).
    ``save(result)`` is called with what the rounds measured (``'partial':
    True``) before the capture timing and the profile: a run stopped by a
    time limit keeps its step times."""
    xp = array_module
    gpu = xp is not numpy
    synchronize = _common.synchronizer(xp)
    x, t = _batch(spec, xp)
    steps = {}
    classifiers = {}
    failed = {}
    out_of_memory = set()    # failed for lack of memory beside the others
    timed_alone = {}         # variant -> why it was timed again alone
    released = {}            # variant -> its graph's figures, let go of
    n_kfac = []              # K-FAC layers of the model (once built)

    def attempt(variant, what, run):
        """``run()``'s value; a failure takes the variant out of the run
        (its memory let go), is reported, and gives None: the other
        variants go on."""
        if variant in failed:
            return None
        try:
            return run()
        except Exception as error:   # a variant's bug must not lose the run
            failed[variant] = '{} ({}): {}: {}'.format(
                variant, what, type(error).__name__, error)
            if isinstance(error, MemoryError):
                out_of_memory.add(variant)
            print('FAILED {}; the other variants go on'.format(
                failed[variant]), file=sys.stderr, flush=True)
            traceback.print_exc()
            steps.pop(variant, None)
            classifiers.pop(variant, None)
            gc.collect()
            return None

    def build(variant):
        model = classifiers[variant] = build_model(spec['arch'],
                                                   spec['kwargs'])
        if gpu:
            model.to_device('@cupy:0')
        if variant == 'sgd':
            steps[variant] = SGDStep(model, synchronize)
        elif variant == 'sgd_graph':
            steps[variant] = SGDGraphStep(model)
        elif variant == 'kfac_every_graph':
            steps[variant] = KFACGraphStep(model, 1, refresh_steps=True,
                                           **(kfac_options or {}))
        elif variant in KFAC_GRAPH_VARIANTS:
            steps[variant] = KFACGraphStep(
                model, interval, **dict(KFAC_GRAPH_VARIANTS[variant][0],
                                        **(kfac_options or {})))
        else:
            # the variant's own options win over --conv-a's
            steps[variant] = KFACStep(
                model, interval if variant == 'kfac_stale' else 1, gpu,
                **dict(kfac_options or {}, **KFAC_VARIANTS[variant]))
        blocks = getattr(steps[variant].optimizer, 'blocks', None)
        if blocks is not None and not n_kfac:
            n_kfac.append(sum(1 for b in blocks if b.factor_names))

    def warm(variant):
        for _ in range(warmup):
            with alone(steps[variant], steps):
                steps[variant](x, t)
            drop_graph(classifiers[variant])

    def release(variant):
        """Let a variant's model, optimizer and graphs go, keeping what
        the summary reads of its graphs."""
        step = steps.pop(variant, None)
        classifiers.pop(variant, None)
        if step is not None and variant in GRAPH_VARIANTS:
            released[variant] = graph_figures(step)
            if step.graph is not None:
                step.graph.close()
        del step
        free_device_memory(xp)

    keys = tuple(variants) + tuple(v + '_refresh' for v in variants
                                   if v in STALE_VARIANTS)
    samples = {v: [] for v in keys}
    stages = {v: [] for v in keys}
    ratios = collections.defaultdict(list)
    round_times = []

    def run_rounds(names):
        for r in range(rounds):
            shift = r % len(names)
            times = {}
            round_times.append(times)
            for variant in names[shift:] + names[:shift]:
                if variant in failed:
                    continue
                gc.collect()
                elapsed = attempt(variant, 'round {}'.format(r),
                                  functools.partial(
                                      _timed_step, steps[variant], x, t,
                                      synchronize, steps))
                if elapsed is None:
                    continue
                drop_graph(classifiers[variant])
                key = variant
                if variant in STALE_VARIANTS and steps[variant].refreshed:
                    key = variant + '_refresh'
                times[key] = elapsed
                samples[key].append(elapsed)
                stages[key].append(steps[variant].stage_times)
            print('  round {}/{}: {}'.format(r + 1, rounds, ', '.join(
                '{} {:.4g} s'.format(k, v)
                for k, v in sorted(times.items()))),
                file=sys.stderr, flush=True)
            sgd = times.get('sgd')
            if not sgd:
                continue
            for key, elapsed in times.items():
                if key != 'sgd' and not key.endswith('_refresh'):
                    ratios[key].append(elapsed / sgd)

    # A replayed variant's cycle: what its refresh drops and captures again
    cycles = {}

    def time_cycle(variant):
        try:
            cycles[variant] = refresh_cycle(
                steps[variant], x, t, interval, synchronize, steps)
        except Exception as error:   # its amortised figure is left out
            cycles[variant] = {'failed': '{}: {}'.format(
                type(error).__name__, error)}
            print('the refresh cycle of {} could not be timed ({}); '
                  'its amortised figures are left out'.format(
                      variant, cycles[variant]['failed']),
                  file=sys.stderr, flush=True)
        drop_graph(classifiers[variant])

    capture = {}

    def time_captures(names):
        for variant in names:
            if variant in CAPTURE_VARIANTS and variant in steps:
                seconds = attempt(variant, 'capture timing',
                                  functools.partial(
                                      time_capture, steps[variant], x, t,
                                      spec['capture_steps'], synchronize,
                                      steps.get('sgd'), steps))
                if seconds is not None:
                    capture[variant] = seconds

    for variant in variants:
        attempt(variant, 'set-up', functools.partial(build, variant))
    for variant in variants:
        attempt(variant, 'warm-up', functools.partial(warm, variant))
    run_rounds(list(variants))
    for variant in KFAC_GRAPH_VARIANTS:
        if variant in steps and variant not in failed:
            time_cycle(variant)

    def summary(partial: bool) -> Dict:
        ran = [v for v in variants if v not in failed]
        medians = {k: _common.median(v) if v else None
                   for k, v in samples.items()}
        extras = {v: recapture_seconds(c, medians.get(v))
                  for v, c in cycles.items()}
        amortised = collections.defaultdict(list)
        for times in round_times:
            sgd = times.get('sgd')
            if not sgd:
                continue
            for stale in STALE_VARIANTS:
                every = KFAC_GRAPH_VARIANTS.get(stale, ({}, 'kfac_every'))[1]
                extra = extras.get(stale, 0.0)
                if stale in times and every in times and extra is not None:
                    amortised[stale + '_amortised'].append(
                        cycle_seconds(times[every], times[stale], interval,
                                      extra) / interval / sgd)
        # a variant that failed is left out of the figures: the steps it
        # took before may not be the ones it names (a capture that ran out
        # of memory times its step eagerly, then the eager step fails)
        gone = set(failed)
        result = {
            'model': name, 'arch': spec['arch'],
            'model_kwargs': spec['kwargs'], 'batch': spec['batch'],
            'input': [3, spec['size'], spec['size']],
            'n_kfac_layers': n_kfac[0] if n_kfac and
            _kfac_variant(ran) is not None else None,
            'refresh_interval': interval,
            'rounds': rounds, 'warmup_steps': warmup,
            'median_s': {k: None if _variant_of(k) in gone else v
                         for k, v in medians.items()},
            'ratio_to_sgd': {k: _common.median(v) if v else None
                             for k, v in dict(ratios, **amortised).items()
                             if _variant_of(k) not in gone},
            'stage_times_s': {k: _median_stages(v)
                              for k, v in stages.items()
                              if v and _variant_of(k) not in gone},
            'samples_s': samples,
            'capture_steps': spec['capture_steps'],
            'capture_by_type_s': dict(capture),
            'failed': dict(failed),
        }
        if timed_alone:
            result['timed_alone'] = dict(timed_alone)
        if partial:
            result['partial'] = True
        result['extra_over_sgd'] = extra_over_sgd(result)
        if cycles:
            result['refresh_cycle'] = {
                v: dict(c, recapture_s=extras[v]) for v, c in cycles.items()}
        graphed = dict(released)
        graphed.update((v, graph_figures(steps[v]))
                       for v in GRAPH_VARIANTS if v in steps)
        graphed = {v: graphed[v] for v in GRAPH_VARIANTS if v in graphed}
        if graphed:
            result['graph_stats'] = {v: f['stats']
                                     for v, f in graphed.items()}
            result['not_replayed'] = [
                v for v, f in graphed.items() if not replayed(f['stats'])]
            result['graph_capture_s'] = {v: f['capture_s']
                                         for v, f in graphed.items()}
        if gpu:
            # the ways of forming A and of inverting the lone factors
            # that timing chose (autotune)
            result['conv_a_timed'] = conv_a_timed()
            result['inverse_routes_timed'] = inverse_routes_timed()
        result['goals'] = goals(result, target)
        return result

    if save is not None:
        try:
            save(summary(partial=True))
        except Exception:   # the report of what ran must not lose the run
            print('the rounds could not be saved; the run goes on',
                  file=sys.stderr, flush=True)
            traceback.print_exc()
    time_captures(variants)
    kfac_variant = _kfac_variant([v for v in variants if v not in failed])
    profile_text = None
    if profile and kfac_variant is not None:
        profile_text = profile_step(steps[kfac_variant], x, t)
    # Variants crowded out: beside the others, out of device memory (every
    # variant's model, K-FAC state and graphs live in one process, and a
    # graph keeps its step's memory), or a capture that ran out of it and
    # was never replayed. Each is timed again alone with SGD (an eager
    # step keeps nothing between steps), the others let go first.
    crowded = [v for v in variants
               if v in out_of_memory or (v in steps and v in GRAPH_VARIANTS
                                         and crowded_out(steps[v].graph
                                                         .stats))]
    if crowded:
        for variant in list(steps):
            if variant != 'sgd':
                release(variant)
    for variant in crowded:
        timed_alone[variant] = failed.pop(
            variant, '{}: its capture ran out of device memory and it was '
            'never replayed'.format(variant))
        out_of_memory.discard(variant)
        released.pop(variant, None)
        cycles.pop(variant, None)
        for key in (variant, variant + '_refresh'):
            if key in samples:
                samples[key], stages[key] = [], []
            ratios.pop(key, None)
        for times in round_times:
            times.pop(variant, None)
            times.pop(variant + '_refresh', None)
        print('{} ran out of device memory beside the other variants; '
              'timed again alone{}'.format(
                  variant, ' with sgd' if 'sgd' in steps else ''),
              file=sys.stderr, flush=True)
        attempt(variant, 'set-up, alone', functools.partial(build, variant))
        attempt(variant, 'warm-up, alone', functools.partial(warm, variant))
        run_rounds(['sgd', variant] if variant != 'sgd' and 'sgd' in steps
                   else [variant])
        if variant in KFAC_GRAPH_VARIANTS and variant in steps:
            time_cycle(variant)
        time_captures([variant])
        if variant != 'sgd':    # the others' partner in their rounds
            release(variant)
    result = summary(partial=False)
    if profile_text is not None:
        result['profile'] = profile_text
    return result


def graph_figures(step) -> Dict[str, object]:
    """A replayed variant's graph counts and capture seconds."""
    graph = step.graph
    stats = dict(graph.stats) if graph is not None else {}
    seconds = getattr(step, 'capture_seconds', None)
    if seconds is None:
        seconds = graph.capture_seconds if graph is not None else []
    return {'stats': stats, 'capture_s': list(seconds)}


def crowded_out(stats) -> bool:
    """Whether a graph's counts say its capture ran out of device memory
    (once more after the cached blocks went back) and it was never
    replayed: its step was timed eagerly for want of memory."""
    return bool(stats.get('capture out of memory')) and \
        bool(stats.get('capture failed')) and not replayed(stats)


def _variant_of(key: str) -> str:
    """The variant a ``median_s`` / ``ratio_to_sgd`` key belongs to."""
    for suffix in ('_refresh', '_amortised'):
        if key.endswith(suffix):
            return key[:-len(suffix)]
    return key


def replayed(stats) -> int:
    """Steps (or refresh steps' passes) a graph's counts say were
    replayed."""
    return stats.get('replayed', 0) + stats.get('refresh passes: replayed',
                                                0)


def _timed_step(step, x, t, synchronize: Callable[[], None],
                steps: Dict = None) -> float:
    """Seconds of one synchronised step of a variant (alone)."""
    synchronize()
    start = time.perf_counter()
    with alone(step, steps):
        step(x, t)
    synchronize()
    return time.perf_counter() - start


def refresh_cycle(step: 'KFACGraphStep', x, t, interval: int,
                  synchronize: Callable[[], None], steps: Dict = None
                  ) -> Dict[str, object]:
    """Step a replayed K-FAC variant on to its next refresh step and one
    step past it: what a training run pays once per refresh cycle beyond
    its replayed stale steps. The refresh step runs eagerly; the step
    after it is captured again where the refresh dropped the graph, or
    replayed where the graph was kept.

    Returns ``{'steps_to_refresh', 'refresh_s', 'next_s', 'next'}``:
    seconds of the refresh step and of the step after it, and how that
    step ran (``'captured'``, ``'replayed'`` or ``'eager'``).

    Raises
    ------
    RuntimeError
        No refresh step within ``interval + 1`` steps.
    """
    for n in range(1, interval + 2):
        refresh_s = _timed_step(step, x, t, synchronize, steps)
        if step.refreshed:
            break
    else:
        raise RuntimeError('no refresh step within {} steps'.format(
            interval + 1))
    before = collections.Counter(step.graph.stats)
    next_s = _timed_step(step, x, t, synchronize, steps)
    after = step.graph.stats
    way = next((w for w in ('captured', 'replayed', 'eager')
                if after[w] > before[w]), 'eager')
    return {'steps_to_refresh': n, 'refresh_s': refresh_s,
            'next_s': next_s, 'next': way}


def recapture_seconds(cycle: Dict, replay_s: Optional[float]
                      ) -> Optional[float]:
    """What a refresh cycle of a replayed variant pays beyond its eager
    refresh step and its replayed steps: the step after the refresh less
    a replayed step where it was captured again (at least 0), else 0.
    None where the cycle could not be timed (then its amortised figures
    are left out: without the capture they would flatter it)."""
    if cycle is None or 'failed' in cycle or replay_s is None:
        return None
    if cycle['next'] != 'captured':
        return 0.0
    return max(0.0, cycle['next_s'] - replay_s)


def cycle_seconds(every_s: float, stale_s: float, interval: int,
                  extra_s: float = 0.0) -> float:
    """Seconds of one refresh cycle of ``interval`` steps: one refresh
    step (an every-step step), ``interval − 1`` stale steps, and what the
    cycle pays once beyond them (a replayed variant's capture after each
    refresh: :func:`recapture_seconds`)."""
    return every_s + extra_s + (interval - 1) * stale_s


def conv_a_timed() -> Dict[str, object]:
    """How many input shapes of this process's convolutions took each way
    of forming A by timing (:func:`chainerkfac.fisher_blocks.patches.
    timed_choices`), and the shapes: ``{'shifted': n, 'unfolded': m,
    'shapes': {'N×C×H×W kh×kw products': way}}``, the products'
    precision ``float32``, ``float64``, ``tf32`` or ``fp16`` (a variant's
    ``factor_dtype``: each is timed on its own)."""
    choices = patches.timed_choices()
    out = {way: sum(v == way for v in choices.values())
           for way in ('shifted', 'unfolded')}

    def products(key):
        factor, tf32 = numpy.dtype(key[3]), key[4]
        if factor == numpy.float16:
            return 'fp16'
        return 'tf32' if tf32 else numpy.dtype(key[1]).name
    out['shapes'] = {'{} {}x{} {}'.format(
        'x'.join(map(str, key[0])), key[2].kh, key[2].kw, products(key)):
        way for key, way in choices.items()}
    return out


def inverse_routes_timed() -> Dict[str, str]:
    """How the lone factors of each size went from their Cholesky factor to
    their inverse, by timing (:func:`chainerkfac.linalg_cuda.
    timed_routes`, ``CHOLESKY_INVERSE='auto'`` under autotune):
    ``{'n=4608 float32': 'potrs', ...}``."""
    return {'n={} {}'.format(n, dtype): route for (n, dtype, _), route in
            sorted(linalg_cuda.timed_routes().items())}


def _kfac_variant(variants):
    return next((v for v in variants if v in KFAC_VARIANTS), None)


def _batch(spec, xp, seed: int = 1):
    rng = numpy.random.RandomState(seed)
    x = rng.standard_normal((spec['batch'], 3, spec['size'], spec['size'])
                            ).astype(numpy.float32)
    t = rng.randint(0, spec['kwargs']['n_class'], spec['batch']).astype(
        numpy.int32)
    return xp.asarray(x), xp.asarray(t)


def time_capture(step: KFACStep, x, t, n_steps: int,
                 synchronize: Callable[[], None], sgd: SGDStep = None,
                 steps: Dict = None) -> Dict[str, float]:
    """Capture seconds per refresh step by layer type, medians over
    ``n_steps`` every-step K-FAC steps, with their sum as ``total``; with
    ``sgd``, each step follows an SGD step and ``total_over_sgd`` is the
    median ratio of the two (robust to the machine's load drifting).
    ``steps``: every variant of the run (:func:`alone`)."""
    per_step, over_sgd = [], []
    for _ in range(n_steps):
        if sgd is not None:
            sgd_seconds = _timed_step(sgd, x, t, synchronize, steps)
            drop_graph(sgd.model)
        with CaptureTimer(step.optimizer.blocks, synchronize) as timer, \
                alone(step, steps):
            step(x, t)
        drop_graph(step.model)
        per_step.append(dict(timer.seconds))
        if sgd is not None:
            over_sgd.append(sum(timer.seconds.values()) / sgd_seconds)
    types = [k for k in CAPTURE_TYPES if any(k in s for s in per_step)]
    types += sorted({k for s in per_step for k in s} - set(types))
    out = {k: _common.median([s.get(k, 0.0) for s in per_step])
           for k in types}
    out['total'] = _common.median([sum(s.values()) for s in per_step])
    if over_sgd:
        out['total_over_sgd'] = _common.median(over_sgd)
    return out


def _median_stages(records: List[Dict]) -> Dict[str, float]:
    keys = [s for s in STAGES if any(s in r for r in records)]
    return {k: _common.median([r.get(k, 0.0) for r in records])
            for k in keys}


def extra_over_sgd(result: Dict) -> Dict[str, Dict[str, float]]:
    """Where K-FAC's extra time goes, per stage, in seconds (medians).

    ``capture`` is K-FAC's forward_backward minus SGD's (the factor-capture
    hook); the other stages have no SGD counterpart except ``update``.
    """
    sgd = result['stage_times_s'].get('sgd')
    out = {}
    if not sgd:        # SGD failed: nothing to subtract
        return out
    for variant in KFAC_VARIANTS:
        stage = result['stage_times_s'].get(variant)
        if stage is None:
            continue
        extra = {'capture': stage['forward_backward'] -
                 sgd['forward_backward']}
        for name in STAGES[1:]:
            extra[name] = stage.get(name, 0.0) - (
                sgd['update'] if name == 'update' else 0.0)
        out[variant] = extra
    return out


def goals(result: Dict, target: str) -> Dict[str, Dict]:
    """The goals of :data:`GOALS` that apply to this result and whose
    variants were run, with the measured figure and whether it is met."""
    out = {}
    med, ratio = result['median_s'], result['ratio_to_sgd']
    stage = result['stage_times_s']
    capture = result['capture_by_type_s']
    for key, goal in GOALS[target].get(result['model'], {}).items():
        if key == 'capture_s':
            value = capture.get('kfac_every', {}).get('total')
        elif key == 'forward_backward_over_sgd':
            value = (stage['kfac_every']['forward_backward'] / med['sgd']
                     if stage.get('kfac_every', {}).get('forward_backward')
                     is not None and med.get('sgd') else None)
        elif key == 'fp16_over_fp32':
            value = (med['kfac_fp16'] / med['kfac_every']
                     if med.get('kfac_fp16') and med.get('kfac_every')
                     else None)
        else:
            value = ratio.get(key)
        if value is None:   # its variant was not run
            continue
        met = value < goal if key == 'fp16_over_fp32' else value <= goal
        out[key] = {'goal': goal, 'value': value, 'met': met}
    return out


def profile_step(step: KFACStep, x, t, top: int = 20) -> str:
    """cProfile of one (warm) step: the top functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    step(x, t)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats('tottime').print_stats(top)
    return text.getvalue()


# -- the inverse stage alone --------------------------------------------------
def measure_inverse(name: str, spec: Dict, repeats: int, array_module,
                    target: str = 'cpu', kfac_options: Dict = None,
                    methods: Sequence[str] = ('cholesky',),
                    newton_schulz_max_dim: Optional[int] = None,
                    batched_max_dims: Sequence[Optional[int]] = (None,),
                    cholesky_inverses: Sequence[Optional[str]] = (None,)
                    ) -> List[Dict]:
    """Capture one every-step K-FAC step's factors, then time the inverse
    stage as the optimizer runs it: every block's requests (the trace-norm
    split of the damping for Kronecker blocks, ρ_BN·γ for BN) in one
    :func:`chainerkfac.linalg.damped_inverses` call; and, apart, the same
    per factor kind. One result per inverse method, GPU batch limit
    (:data:`chainerkfac.linalg_cuda.BATCHED_MAX_DIM`; None: the
    library's) and GPU route from a Cholesky factor to its inverse
    (:data:`chainerkfac.linalg_cuda.CHOLESKY_INVERSE`; None: the
    library's), each a separate timing of the same factors; a result other
    than the first records its largest relative deviation (Frobenius) from
    the first's inverses (Cholesky's, when it is first)."""
    xp = array_module
    synchronize = _common.synchronizer(xp)
    x, t = _batch(spec, xp)
    model = build_model(spec['arch'], spec['kwargs'])
    if xp is not numpy:
        model.to_device('@cupy:0')
    step = KFACStep(model, 1, xp is not numpy, **(kfac_options or {}))
    step(x, t)
    optimizer = step.optimizer
    requests = []   # (kind, matrix, damping)
    for block in optimizer.blocks:
        if not block.factors:
            continue
        damping = optimizer.damping * block.damping_scale(optimizer.rho_bn)
        for factor, (matrix, used) in block.inverse_requests(
                block.factors, damping).items():
            requests.append((factor, matrix, used))

    reference = None
    results = []
    for method, max_dim, route in [(m, d, r) for m in methods
                                   for d in batched_max_dims
                                   for r in cholesky_inverses]:
        def invert(subset):
            return linalg.damped_inverses(
                [m for _, m, _ in subset], [d for _, _, d in subset],
                method=method, newton_schulz_max_dim=newton_schulz_max_dim)

        print('  {}{}{}...'.format(
            method, '' if max_dim is None else
            ', batches up to n = {}'.format(max_dim),
            '' if route is None else ', {} alone'.format(route)),
            flush=True)
        with _batched_max_dim(max_dim), _cholesky_inverse(route):
            results.append(_time_inverse(invert, requests, repeats,
                                         synchronize))
            inverses = [r.inverse for r in invert(requests)]
        if reference is None:
            reference = inverses
        else:
            results[-1]['max_rel_vs_cholesky'] = max(
                float(xp.linalg.norm(a - b) / xp.linalg.norm(b))
                for a, b in zip(inverses, reference)
                if a is not None and b is not None)
        results[-1]['method'] = method
        if max_dim is not None:
            results[-1]['batched_max_dim'] = max_dim
        if route is not None:
            results[-1]['cholesky_inverse'] = route
        if method == 'newton_schulz':
            limit = (newton_schulz.MAX_DIM if newton_schulz_max_dim is None
                     else newton_schulz_max_dim)
            results[-1]['newton_schulz_max_dim'] = limit
            results[-1]['newton_schulz_eligible'] = sum(
                1 for _, m, _ in requests
                if m.ndim == 2 and m.shape[0] <= limit)
    sizes = [int(m.shape[0]) for _, m, _ in requests if m.ndim == 2]
    for result in results:
        result.update({
            'model': name, 'batch': spec['batch'],
            'input': [3, spec['size'], spec['size']],
            'n_factors': len(sizes), 'sum_n3': float(sum(float(n) ** 3
                                                        for n in sizes)),
            'max_n': max(sizes), 'repeats': repeats})
        goal = INVERSE_GOALS.get(target, {}).get(name)
        if goal is not None:
            result['goal'] = {'goal': goal, 'value': result['median_s'],
                              'met': result['median_s'] <= goal}
    return results


@contextlib.contextmanager
def _batched_max_dim(max_dim: Optional[int]):
    """Within the block, the GPU inverts equal-size factors up to
    ``max_dim`` in batches (None: the library's limit)."""
    saved = linalg_cuda.BATCHED_MAX_DIM
    if max_dim is not None:
        linalg_cuda.BATCHED_MAX_DIM = max_dim
    try:
        yield
    finally:
        linalg_cuda.BATCHED_MAX_DIM = saved


@contextlib.contextmanager
def _cholesky_inverse(route: Optional[str]):
    """Within the block, the GPU goes from a lone factor's Cholesky factor
    to its inverse by ``route`` (None: the library's)."""
    saved = linalg_cuda.CHOLESKY_INVERSE
    if route is not None:
        linalg_cuda.CHOLESKY_INVERSE = route
    try:
        yield
    finally:
        linalg_cuda.CHOLESKY_INVERSE = saved


def _time_inverse(invert, requests, repeats: int, synchronize) -> Dict:
    """Median seconds of ``invert`` over all requests and per factor kind
    (after one warm-up call of each: kernels, workspaces, streams, the
    timed routes)."""
    kinds = sorted({k for k, _, _ in requests})
    invert(requests)     # and each kind's: a subset's lone factors may
    for kind in kinds:   # be timed for their route (autotune) at first
        invert([r for r in requests if r[0] == kind])
    totals, by_kind = [], collections.defaultdict(list)
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        invert(requests)
        synchronize()
        totals.append(time.perf_counter() - start)
        for kind in kinds:
            subset = [r for r in requests if r[0] == kind]
            synchronize()
            start = time.perf_counter()
            invert(subset)
            synchronize()
            by_kind[kind].append(time.perf_counter() - start)
    return {'median_s': _common.median(totals), 'samples_s': totals,
            'by_kind_s': {k: _common.median(v) for k, v in sorted(
                by_kind.items())}}


# -- output -------------------------------------------------------------------
def tables(data: Dict) -> str:
    """The summary, stage, extra-time and capture tables of a run."""
    results = data['results']
    variants = [v for v in VARIANTS if any(v in r['median_s']
                                           for r in results)]
    kfac = [v for v in variants if v != 'sgd']
    rows = []
    for r in results:
        med, ratio = r['median_s'], r['ratio_to_sgd']
        row = [r['model'], r['batch'], med['sgd']]
        for variant in kfac:
            row += [med.get(variant), ratio.get(variant)]
        for stale in STALE_VARIANTS:
            if stale in kfac:
                row.append(ratio.get(stale + '_amortised'))
        rows.append(row)
    headers = ['model', 'batch', 'SGD [s]']
    for variant in kfac:
        headers += ['{} [s]'.format(variant), 'x SGD']
    for stale in STALE_VARIANTS:
        if stale in kfac:
            headers.append('{} amortised /{} x SGD'.format(
                stale, data['refresh_interval']))
    summary = _common.format_table(headers, rows)
    graph_lines = ''.join(
        '\nCUDA graphs, {} {}: {}; capture {} s (median of {})'.format(
            r['model'], variant, dict(stats),
            _common.median(r['graph_capture_s'][variant])
            if r['graph_capture_s'][variant] else '-',
            len(r['graph_capture_s'][variant]))
        for r in results for variant, stats in
        r.get('graph_stats', {}).items())
    summary += graph_lines
    summary += ''.join(
        '\nNOT replayed: {} {} was timed eagerly (its graph_stats say '
        'why); the goals against the peer leave it out'.format(
            r['model'], variant)
        for r in results for variant in r.get('not_replayed', ()))
    summary += ''.join('\nFAILED {}: {}'.format(r['model'], why)
                       for r in results
                       for why in r.get('failed', {}).values())
    summary += ''.join(
        '\nTIMED ALONE {} {}: out of device memory beside the other '
        'variants ({}); timed again with SGD alone, the others let go'
        .format(r['model'], variant, why)
        for r in results for variant, why in r.get('timed_alone', {}).items())
    goal_rows = [[r['model'], key, g['value'], '<= {:g}'.format(g['goal'])
                  if key != 'fp16_over_fp32' else '< {:g}'.format(g['goal']),
                  'met' if g['met'] else 'NOT met']
                 for r in results for key, g in r['goals'].items()]
    goal_table = _common.format_table(
        ['model', 'goal', 'measured', 'target', ''], goal_rows)
    stage_rows = []
    for r in results:
        for variant in variants:
            st = r['stage_times_s'].get(variant)
            if st:     # a replayed variant has none: timed whole
                stage_rows.append([r['model'], variant] +
                                  [st.get(s) for s in STAGES] +
                                  [sum(st.values())])
    stages = _common.format_table(
        ['model', 'variant'] + list(STAGES) + ['sum'], stage_rows)
    extra_rows = []
    for r in results:
        for variant, extra in r['extra_over_sgd'].items():
            extra_rows.append([r['model'], variant, sum(extra.values())] + [
                extra[k] for k in ['capture'] + list(STAGES[1:])])
    extras = _common.format_table(
        ['model', 'variant', 'extra over SGD', 'capture (fwd+bwd)'] +
        list(STAGES[1:]), extra_rows)
    capture_rows = []
    for r in results:
        for variant, seconds in r['capture_by_type_s'].items():
            capture_rows.append(
                [r['model'], variant] +
                [seconds.get(k) for k in CAPTURE_TYPES] +
                [seconds['total'], seconds.get('total_over_sgd')])
    captures = _common.format_table(
        ['model', 'variant'] + list(CAPTURE_TYPES) +
        ['total', 'total / SGD step (paired)'], capture_rows)
    timed = ''.join(
        '\n{}: convolution input shapes whose A took the shifted / unfolded '
        'product by timing (autotune): {} / {}'.format(
            r['model'], r['conv_a_timed']['shifted'],
            r['conv_a_timed']['unfolded'])
        for r in results if r.get('conv_a_timed', {}).get('shapes'))
    timed += ''.join(
        '\n{}: lone factors inverted by potrs / potri, by timing '
        '(autotune): {}'.format(r['model'], ', '.join(
            '{} {}'.format(k, v)
            for k, v in r['inverse_routes_timed'].items()))
        for r in results if r.get('inverse_routes_timed'))
    return ('Step time, medians over rounds ({}); ratios are per-round '
            'medians\n{}\n\nGoals (reported, not asserted)\n{}\n\n'
            'Stage times [s], medians (replayed variants: none, timed '
            'whole)\n{}\n\n'
            "Where K-FAC's extra time goes [s] (stage medians minus SGD's)\n"
            '{}\n\nCapture per refresh step by layer type [s], medians over '
            '{} timed step(s) ({})\n{}{}'.format(
                _device_words(data), summary, goal_table, stages, extras,
                ', '.join(str(r['capture_steps']) for r in results),
                'device synchronised around each call' if data['gpu']
                else 'wall time', captures, timed))


def inverse_table(data: Dict) -> str:
    rows = [[r['model'], r.get('method', 'cholesky') + (
                ', batches n <= {}'.format(r['batched_max_dim'])
                if 'batched_max_dim' in r else '') + (
                ', {} alone'.format(r['cholesky_inverse'])
                if 'cholesky_inverse' in r else ''), r['batch'],
             r['n_factors'], r['sum_n3'], r['max_n'], r['median_s']] +
            [r['by_kind_s'].get(k) for k in ('A', 'G', 'F')] +
            [r.get('max_rel_vs_cholesky', '-'),
             ('<= {:g}: {}'.format(r['goal']['goal'], 'met' if
                                   r['goal']['met'] else 'NOT met'))
             if 'goal' in r else '-']
            for r in data['inverse']]
    return ('Inverse stage alone: one damped_inverses call over every '
            'block\'s requests after one capture, median of {} ({})\n{}'
            .format(
                ', '.join(str(r['repeats']) for r in data['inverse']),
                _device_words(data), _common.format_table(
                    ['model', 'method', 'batch', 'factors', 'sum n^3',
                     'max n', 'total [s]', 'A [s]', 'G [s]', 'F [s]',
                     'vs first', 'goal'], rows)))


def peer(batch: int, size: int, rounds: int, warmup: int,
         interval: int, xp=numpy) -> Dict:
    """:func:`benchmarks.peer_pytorch.run`, after CuPy's pools are given
    back (PyTorch allocates through its own); a failure of the peer is
    recorded as its skip reason, not the end of our run."""
    from benchmarks import peer_pytorch
    free_device_memory(xp)
    try:
        return peer_pytorch.run(batch, size, rounds, warmup, interval)
    except Exception as error:
        traceback.print_exc()
        return {'skipped': 'the peer failed: {}: {}'.format(
            type(error).__name__, error)}


def run_peer(data: Dict, specs: Dict[str, Dict], interval: int,
             xp=numpy) -> str:
    """Time the PyTorch peer at this run's ResNet-50 batch and size into
    ``data['peer_pytorch']``; returns its table beside our figures, and
    the goals against it (:data:`PEER_GOALS`, into ``data['goals_vs_peer']``
    where the peer ran)."""
    from benchmarks import peer_pytorch
    spec = specs.get('resnet50', GPU['resnet50'])
    data['peer_pytorch'] = peer(spec['batch'], spec['size'], spec['rounds'],
                                spec['warmup'], interval, xp)
    ours = next((r for r in data['results'] if r['model'] == 'resnet50'),
                None)
    text = peer_pytorch.table(data['peer_pytorch'], ours)
    if ours is not None and 'skipped' not in data['peer_pytorch']:
        data['goals_vs_peer'] = goals_vs_peer(
            replayed_medians(ours), data['peer_pytorch']['median_s'])
        text += '\n\n' + goals_vs_peer_table(
            [(ours['batch'], data['goals_vs_peer'])])
    return text


def replayed_medians(result: Dict) -> Dict[str, float]:
    """A result's median steps less those of graphed variants that were
    never replayed (a failed capture times them eagerly under their
    names)."""
    return {k: v for k, v in result['median_s'].items()
            if k not in result.get('not_replayed', ())}


def goals_vs_peer(ours: Dict[str, float], theirs: Dict[str, float]
                  ) -> Dict[str, Dict]:
    """Each goal of :data:`PEER_GOALS` whose steps were both timed: ours
    (the first of its variants that ran: the replayed step where it was;
    pass :func:`replayed_medians`) over the peer's median step, and
    whether it is met."""
    out = {}
    for what, candidates, peer_key, goal in PEER_GOALS:
        mine = next((v for v in candidates if ours.get(v)), None)
        if mine is None or not theirs.get(peer_key):
            continue
        value = ours[mine] / theirs[peer_key]
        out[what] = {'ours': mine, 'theirs': peer_key, 'goal': goal,
                     'value': value, 'met': value <= goal}
    return out


def goals_vs_peer_table(rows) -> str:
    """``rows``: (batch, :func:`goals_vs_peer` result) pairs."""
    return ('Goals against the peer, ours / theirs in this run (reported, '
            'not asserted)\n{}'.format(_common.format_table(
                ['batch', 'goal', 'ours', 'theirs', 'ours / theirs',
                 'target', ''],
                [[batch, what, g['ours'], g['theirs'], g['value'],
                  '<= {:g}'.format(g['goal']),
                  'met' if g['met'] else 'NOT met']
                 for batch, goals_ in rows for what, g in goals_.items()])))


# -- the throughput sweep -----------------------------------------------------
#: images/s keys: ours, then the peer's.
THROUGHPUT = ('sgd', 'kfac_every', 'kfac_stale', 'kfac_stale_amortised')
#: The replayed stale cycle whose refresh step is replayed too but for its
#: inverses (``graphed(..., refresh_steps=True)``): ``kfac_stale_graph``'s
#: step and recapture with ``kfac_every_graph``'s step, the same work.
REPLAYED_REFRESH = 'kfac_stale_graph_amortised_replayed_refresh'
#: ... and the replayed variants' (columns where a row has them): a
#: graphed K-FAC run takes its refresh steps eagerly, so its cycle is
#: amortised with ``kfac_every``'s step as well; with
#: ``--replay-refresh-steps`` with ``kfac_every_graph``'s
#: (:data:`REPLAYED_REFRESH`).
GRAPH_THROUGHPUT = ('sgd_graph', 'kfac_stale_graph',
                    'kfac_stale_graph_amortised', 'kfac_stale_graph_tf32',
                    'kfac_stale_graph_tf32_amortised', 'kfac_every_graph',
                    REPLAYED_REFRESH)
PEER_THROUGHPUT = ('sgd', 'kfac_inverse', 'kfac_inverse_stale',
                   'kfac_inverse_stale_amortised')


def images_per_second(median_s: Dict[str, float], batch: int,
                      interval: int, every: str, *stales: str,
                      extras: Dict[str, Optional[float]] = None
                      ) -> Dict[str, float]:
    """Images per second of each timed step, and of each stale variant
    amortised over a refresh cycle of ``interval`` steps (one every-step
    step, ``interval − 1`` stale ones, from the medians, and ``extras``'
    seconds of the variant: a replayed variant's capture after each
    refresh, :func:`recapture_seconds`; where that is None the amortised
    figure is left out)."""
    extras = extras or {}
    out = {k: batch / v for k, v in median_s.items()
           if v and not k.endswith('_refresh')}
    for stale in stales:
        extra = extras.get(stale, 0.0)
        if median_s.get(every) and median_s.get(stale) and \
                extra is not None:
            cycle = cycle_seconds(median_s[every], median_s[stale],
                                  interval, extra)
            out[stale + '_amortised'] = batch * interval / cycle
    return out


def replayed_refresh_cycle(median_s: Dict[str, float], batch: int,
                           interval: int,
                           extras: Dict[str, Optional[float]]
                           ) -> Dict[str, float]:
    """``{REPLAYED_REFRESH: images/s}``: the replayed stale step amortised
    over a cycle whose refresh step is replayed too but for its inverses
    (what ``--replay-refresh-steps`` runs: ``kfac_every_graph``'s median,
    the same work as a stale run's refresh step), with the stale graph's
    recapture after a refresh; empty where either step was not timed
    replayed (pass :func:`replayed_medians`) or the cycle was not."""
    out = images_per_second(
        {k: median_s.get(k) for k in ('kfac_every_graph',
                                      'kfac_stale_graph')},
        batch, interval, 'kfac_every_graph', 'kfac_stale_graph',
        extras=extras)
    value = out.get('kfac_stale_graph_amortised')
    return {} if value is None else {REPLAYED_REFRESH: value}


def throughput(result: Dict, median_s: Dict[str, float],
               replayed: Dict[str, float], interval: int
               ) -> Dict[str, float]:
    """Images/s of a result's steps (``median_s``), of its stale cycles
    amortised with what each refresh cycle recaptures, and of the stale
    cycle whose refresh step is replayed too (from ``replayed``: the
    medians of the steps that did replay, :func:`replayed_medians`)."""
    extras = recaptures(result)
    batch = result['batch']
    out = images_per_second(median_s, batch, interval, 'kfac_every',
                            'kfac_stale', 'kfac_stale_graph', extras=extras)
    out.update(images_per_second(median_s, batch, interval, 'kfac_tf32',
                                 'kfac_stale_graph_tf32', extras=extras))
    out.update(replayed_refresh_cycle(replayed, batch, interval, extras))
    return out


def recaptures(result: Dict) -> Dict[str, Optional[float]]:
    """A result's :func:`recapture_seconds` by variant (None: not timed;
    a variant whose cycle was not measured at all: None too)."""
    cycles = result.get('refresh_cycle', {})
    return {v: cycles.get(v, {}).get('recapture_s') if v in cycles else None
            for v in KFAC_GRAPH_VARIANTS if result['median_s'].get(v)}


def device_bytes_in_use(xp) -> Optional[int]:
    """Bytes of device memory in use (every process and library), None on
    the CPU: what one sweep point left behind."""
    if xp is numpy:
        return None
    xp.cuda.Device().synchronize()
    free, total = xp.cuda.runtime.memGetInfo()
    return int(total - free)


def free_device_memory(xp) -> None:
    """Give the device memory CuPy's pools hold back (between the sweep's
    points, and before the peer, which allocates through PyTorch)."""
    gc.collect()
    if xp is not numpy:
        xp.get_default_memory_pool().free_all_blocks()


def set_workspace_limit(limit: Optional[int]) -> None:
    """cuDNN's workspace limit for the steps timed next (None: leave
    Chainer's); a note where Chainer has no cuDNN to give it to."""
    from chainer.backends import cuda
    if limit is None:
        return
    if not cuda.cudnn_enabled:
        print('note: Chainer has no cuDNN here, so the workspace limit '
              'changes nothing', flush=True)
    cuda.set_max_workspace_size(limit)


def sweep(args, specs: Dict[str, Dict], xp, target: str,
          kfac_options: Dict, save: Callable = None) -> List[Dict]:
    """The step timing of every model at each batch of ``--batches`` and
    each limit of ``--workspace-sizes``; with ``--peer``, the peer at each
    batch (once: our workspace limit is not its). ``save(rows)`` after
    each point (the JSON so far: a later point may not end)."""
    rows = []
    limits = args.workspace_limits
    for limit in limits:
        set_workspace_limit(limit)
        for name, spec in specs.items():
            for batch in args.batches or [spec['batch']]:
                spec = dict(spec, batch=batch)
                print('timing {} (batch {}, workspace {}, {} rounds)...'
                      .format(name, batch, _words(limit), spec['rounds']),
                      flush=True)
                result = measure(name, spec, args.variants, args.interval,
                                 spec['rounds'], spec['warmup'], xp,
                                 target=target, kfac_options=kfac_options)
                result['workspace_bytes'] = limit
                result['images_per_s'] = throughput(
                    result, result['median_s'], replayed_medians(result),
                    args.interval)
                free_device_memory(xp)
                result['device_bytes_in_use_after'] = device_bytes_in_use(xp)
                if args.peer and limit == limits[0]:
                    theirs = peer(batch, spec['size'], spec['rounds'],
                                  spec['warmup'], args.interval, xp)
                    result['peer_pytorch'] = theirs
                    if 'skipped' not in theirs:
                        result['peer_images_per_s'] = images_per_second(
                            theirs['median_s'], batch, args.interval,
                            'kfac_inverse', 'kfac_inverse_stale')
                        result['goals_vs_peer'] = goals_vs_peer(
                            replayed_medians(result), theirs['median_s'])
                rows.append(result)
                if save is not None:
                    save(rows)
    return rows


def sweep_in_processes(argv: Sequence[str], args, specs: Dict[str, Dict],
                       save: Callable = None) -> List[Dict]:
    """:func:`sweep`, each batch of ``--batches`` in a process of its own
    (this command for that batch alone): a point's device memory is
    gone with its process (in one process, eleven variants' graphs and
    K-FAC states at batch 256 outgrow an 80 GB GPU), and a point that
    fails is recorded (``failed``) while the others go on."""
    rows = []
    for batch in args.batches:
        with tempfile.TemporaryDirectory() as directory:
            out = os.path.join(directory, 'point.json')
            command = [sys.executable, '-m', 'benchmarks.step_time'] + \
                point_argv(argv, batch, out)
            print('batch {}, in a process of its own: {}'.format(
                batch, ' '.join(command[1:])), flush=True)
            code = subprocess.run(command).returncode
            got = []
            if os.path.isfile(out):
                with open(out) as f:
                    got = json.load(f).get('sweep', [])
        done = {(r['model'], r['workspace_bytes']) for r in got}
        rows += got
        rows += [{'model': name, 'batch': batch, 'workspace_bytes': limit,
                  'images_per_s': {},
                  'failed': 'its process ended with exit status {}'.format(
                      code)}
                 for name in specs for limit in args.workspace_limits
                 if (name, limit) not in done]
        if save is not None:
            save(rows)
    return rows


def point_argv(argv: Sequence[str], batch: int, out: str) -> List[str]:
    """``argv`` for one batch of a sweep: its ``--batches`` that batch,
    its ``--out`` ``out``, one process."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split('=', 1)[0]
        if name in ('--batches', '--out', '--process-per-batch'):
            skip = '=' not in arg
            continue
        kept.append(arg)
    return kept + ['--batches', str(batch), '--out', out,
                   '--process-per-batch', 'off']


def sweep_table(data: Dict) -> str:
    """Images per second at each batch and workspace limit, ours beside
    the peer's."""
    rows = []
    ours_keys = THROUGHPUT + tuple(
        k for k in GRAPH_THROUGHPUT
        if any(k in r['images_per_s'] for r in data['sweep']))
    for r in data['sweep']:
        ours, theirs = r['images_per_s'], r.get('peer_images_per_s', {})
        rows.append([r['model'], r['batch'], _words(r['workspace_bytes'])] +
                    [ours.get(k) for k in ours_keys] +
                    [theirs.get(k) for k in PEER_THROUGHPUT])
    headers = (['model', 'batch', 'workspace'] +
               ['{} img/s'.format(k) for k in ours_keys] +
               ['peer {} img/s'.format(k) for k in PEER_THROUGHPUT])
    skipped = [r['peer_pytorch']['skipped'] for r in data['sweep']
               if 'skipped' in r.get('peer_pytorch', {})]
    note = ('\nPeer (PyTorch, kfac-pytorch): skipped: {}'.format(skipped[0])
            if skipped else '')
    # a point's process that died (a message), or its failed variants
    note += ''.join('\nFAILED {} at batch {}: {}'.format(
        r['model'], r['batch'], why) for r in data['sweep']
        for why in ([r['failed']] if isinstance(r.get('failed'), str)
                    else r.get('failed', {}).values()))
    goal_rows = [(r['batch'], r['goals_vs_peer']) for r in data['sweep']
                 if r.get('goals_vs_peer')]
    if goal_rows:
        note += '\n\n' + goals_vs_peer_table(goal_rows)
    return ('Throughput, images per second from the medians ({}; '
            'autotune {}; stale amortised over {} steps)\n{}{}'.format(
                _device_words(data), 'on' if data['autotune'] else 'off',
                data['refresh_interval'],
                _common.format_table(headers, rows), note))


def _png_path(out: str) -> str:
    root, _ = os.path.splitext(out)
    return root + '.png'


def sweep_figure(data: Dict, path: str) -> None:
    """Images/s against the batch: ours (solid), the peer's (dashed), one
    panel per model; a line per workspace limit for ours."""
    from matplotlib.figure import Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    models_ = sorted({r['model'] for r in data['sweep']})
    figure = Figure(figsize=(9 * len(models_), 4.5))
    FigureCanvasAgg(figure)
    for i, model in enumerate(models_):
        axes = figure.add_subplot(1, len(models_), i + 1)
        rows = [r for r in data['sweep'] if r['model'] == model]
        for limit in sorted({r['workspace_bytes'] or 0 for r in rows}):
            mine = [r for r in rows if (r['workspace_bytes'] or 0) == limit]
            suffix = ('' if len({r['workspace_bytes'] for r in rows}) == 1
                      else ', workspace {}'.format(_words(limit or None)))
            for key in THROUGHPUT + GRAPH_THROUGHPUT:
                points = [(r['batch'], r['images_per_s'][key]) for r in mine
                          if key in r['images_per_s']]
                if points:
                    axes.plot(*zip(*points), marker='o',
                              label='chainerkfac {}{}'.format(key, suffix))
        for key in PEER_THROUGHPUT:
            points = [(r['batch'], r['peer_images_per_s'][key]) for r in rows
                      if key in r.get('peer_images_per_s', {})]
            if points:
                axes.plot(*zip(*points), marker='s', linestyle='--',
                          label='PyTorch {}'.format(key))
        axes.set_xscale('log', base=2)
        axes.set_xlabel('per-GPU batch')
        axes.set_ylabel('images / s')
        axes.set_title('{} ({})'.format(model, _device_words(data)))
        # beside the panel: inside, it hid the lines it names
        axes.legend(fontsize='x-small', loc='upper left',
                    bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)
    figure.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    figure.savefig(path + '.tmp.png', dpi=120)
    os.replace(path + '.tmp.png', path)


def _device_words(data: Dict) -> str:
    if data['gpu']:
        return 'GPU, synchronised'
    return '{} BLAS thread(s)'.format(data['blas_threads'])


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m benchmarks.step_time', description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--smoke', action='store_true',
                        help='tiny sizes, 2 rounds: seconds (for the tests)')
    parser.add_argument('--gpu', action='store_true',
                        help='run on GPU 0 with CuPy (ResNet-50 at batch 32)')
    parser.add_argument('--out', default='result/step_time.json',
                        help='JSON output (default result/step_time.json)')
    parser.add_argument('--models', default=None,
                        help='comma-separated subset of {} (default: all; '
                        'resnet50 with --inverse-only)'.format(','.join(FULL)))
    parser.add_argument('--variants', default=None,
                        help='comma-separated subset of {}, with sgd '
                        '(default: {} on CPU, all with --gpu)'.format(
                            ','.join(VARIANTS), ','.join(CPU_VARIANTS)))
    parser.add_argument('--rounds', type=_args.positive_int, default=None,
                        help='timed rounds of the small ResNet (default 21); '
                        'with --inverse-only, repeats (default 5)')
    parser.add_argument('--resnet50-rounds', type=_args.positive_int,
                        default=None,
                        help='timed rounds of ResNet-50 (default 5, 11 on '
                        'GPU)')
    parser.add_argument('--interval', type=_args.at_least(2), default=20,
                        help='refresh interval of the stale variant, >= 2 '
                        '(1 is the every-step variant; default 20)')
    parser.add_argument('--threads', type=_args.positive_int, default=1,
                        help='BLAS threads (default 1)')
    parser.add_argument('--profile', action='store_true',
                        help='also cProfile one every-step K-FAC step of '
                        'each model and print the top functions')
    parser.add_argument('--conv-a', choices=CONV_A, default='auto',
                        help="how convolutions' A is formed: the library's "
                        'choice (auto), or shifted / unfolded wherever it '
                        'applies (to calibrate the choice on a machine)')
    parser.add_argument('--inverse-only', action='store_true',
                        help='time the inverse stage alone over the real '
                        'factors of each model after one capture')
    parser.add_argument('--inverse-methods', default='cholesky',
                        help='with --inverse-only: comma-separated subset '
                        'of {} (default cholesky)'.format(','.join(
                            linalg.INVERSE_METHODS)))
    parser.add_argument('--newton-schulz-max-dim', type=_args.positive_int,
                        default=None,
                        help='largest factor the newton_schulz method '
                        'iterates on (default {})'.format(
                            newton_schulz.MAX_DIM))
    parser.add_argument('--batched-max-dims', type=_args.int_list(0),
                        default=None,
                        help='with --gpu --inverse-only: comma-separated '
                        'limits of the batched inversion of equal-size '
                        'factors to time in turn (0: none batched; '
                        'default: the library\'s, {})'.format(
                            linalg_cuda.BATCHED_MAX_DIM))
    parser.add_argument('--cholesky-inverses', type=_route_list,
                        default=None,
                        help='with --gpu --inverse-only: comma-separated '
                        'routes from a lone factor\'s Cholesky factor to its '
                        'inverse to time in turn, of {} (default: the '
                        "library's, {})".format(
                            ','.join(linalg_cuda.CHOLESKY_INVERSES),
                            linalg_cuda.CHOLESKY_INVERSE))
    parser.add_argument('--peer', action='store_true',
                        help='then time PyTorch SGD and kfac-pytorch on '
                        "torchvision's ResNet-50 in this run (needs --gpu; "
                        'skipped where they cannot be imported)')
    parser.add_argument('--batches', type=_args.int_list(1), default=None,
                        help='comma-separated per-GPU batch sizes: time '
                        'each and report images/s (a table and a PNG)')
    parser.add_argument('--process-per-batch', choices=('auto', 'on', 'off'),
                        default='auto',
                        help='time each batch of --batches in a process of '
                        'its own (its memory, and its failure, its own): '
                        'auto (default) does so on the GPU')
    parser.add_argument('--workspace-sizes', type=_byte_list, default=None,
                        help="comma-separated cuDNN workspace limits (e.g. "
                        "'8MiB,64MiB,1GiB'): time each (default: as "
                        'train_imagenet.py --gpu, 1GiB where a replayed '
                        "variant runs, else Chainer's 8MiB)")
    parser.add_argument('--autotune', nargs='?', const='on', default='auto',
                        choices=('auto', 'on', 'off'),
                        help='time cuDNN\'s convolution algorithms and take '
                        'the fastest (chainer.config.autotune): on (the '
                        'flag alone), off, or auto (default: as '
                        'train_imagenet.py --gpu, on where a replayed '
                        'variant runs)')
    args = parser.parse_args(argv)
    if (args.batches or args.workspace_sizes) and args.inverse_only:
        parser.error('--batches and --workspace-sizes time steps, not '
                     '--inverse-only')
    if args.peer and (not args.gpu or args.inverse_only):
        parser.error('--peer needs --gpu, and the step timing (not '
                     '--inverse-only)')
    args.inverse_methods = args.inverse_methods.split(',')
    unknown = [m for m in args.inverse_methods
               if m not in linalg.INVERSE_METHODS]
    if unknown:
        parser.error('--inverse-methods: choose from {} (got {})'.format(
            ', '.join(linalg.INVERSE_METHODS), ', '.join(unknown)))
    if args.batched_max_dims is not None and not (args.gpu and
                                                  args.inverse_only):
        parser.error('--batched-max-dims goes with --gpu --inverse-only '
                     '(the CPU inverts factor by factor)')
    if args.cholesky_inverses is not None and not (args.gpu and
                                                   args.inverse_only):
        parser.error('--cholesky-inverses goes with --gpu --inverse-only '
                     '(cuSOLVER\'s routes)')
    if not args.inverse_only and (args.inverse_methods != ['cholesky'] or
                                  args.newton_schulz_max_dim is not None):
        parser.error('--inverse-methods and --newton-schulz-max-dim go '
                     'with --inverse-only')
    if args.variants:
        variants = args.variants.split(',')
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown or 'sgd' not in variants or len(variants) < 2:
            parser.error('--variants: sgd and at least one of {} (got {})'
                         .format(', '.join(VARIANTS[1:]), args.variants))
        args.variants = tuple(v for v in VARIANTS if v in variants)
    elif args.gpu:
        args.variants = SWEEP_GPU_VARIANTS if args.batches else GPU_VARIANTS
    else:
        args.variants = CPU_VARIANTS
    graphed = [v for v in GRAPH_VARIANTS if v in args.variants]
    if graphed and not args.gpu:
        parser.error('the {} variant (CUDA graphs) needs --gpu'.format(
            graphed[0]))
    if args.gpu and CPU_ONLY_VARIANT in args.variants:
        parser.error('the {} variant runs on the CPU only'.format(
            CPU_ONLY_VARIANT))
    args.workspace_limits, args.timed, args.cudnn = cudnn_choice(
        args.workspace_sizes, args.autotune, args.gpu, bool(graphed))
    _args.check_paths(parser, args)
    return args


def cudnn_choice(workspace_sizes, autotune: str, gpu: bool, graphed: bool):
    """``(limits, timed, words)``: the cuDNN workspace limits to time in
    turn (None: Chainer's own), whether the algorithms are timed, and a
    line that says so. On the GPU as ``train_imagenet.py --gpu`` chooses
    (:func:`harness.tuning.cudnn_tuning`, with CUDA graphs where a
    replayed variant runs), unless ``--workspace-sizes`` / ``--autotune``
    say otherwise."""
    if not gpu:
        return (list(workspace_sizes or [None]), autotune == 'on',
                'no cuDNN on the CPU')
    limits, timed, words = [], False, []
    for size in workspace_sizes or ['auto']:
        limit, timed, line = tuning.cudnn_tuning(size, autotune, graphed)
        limits.append(limit)
        words.append(line)
    return limits, timed, '; '.join(words)


def _route_list(text: str) -> List[str]:
    routes = [r for r in text.split(',') if r]
    if not routes or any(r not in linalg_cuda.CHOLESKY_INVERSES
                         for r in routes):
        raise argparse.ArgumentTypeError(
            'expected some of {}, got {!r}'.format(
                ','.join(linalg_cuda.CHOLESKY_INVERSES), text))
    return routes


def _byte_list(text: str) -> List[int]:
    """``'8MiB,1GiB,4096'`` -> bytes."""
    try:
        return [sizes.parse(item) for item in text.split(',')]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error))


_words = sizes.words


def _specs(args) -> Dict[str, Dict]:
    table = SMOKE if args.smoke else (GPU if args.gpu else FULL)
    specs = {k: dict(v) for k, v in table.items()}
    if args.models:
        names = args.models.split(',')
    elif args.inverse_only and not args.smoke:
        names = ['resnet50']
    else:
        names = list(specs)
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise SystemExit('unknown model(s) {}; choose from {}'.format(
            ', '.join(unknown), ', '.join(specs)))
    specs = {n: specs[n] for n in names}
    if args.rounds and 'small' in specs:
        specs['small']['rounds'] = args.rounds
    if args.resnet50_rounds and 'resnet50' in specs:
        specs['resnet50']['rounds'] = args.resnet50_rounds
    return specs


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    specs = _specs(args)
    xp = _common.array_module(args.gpu)
    target = 'gpu' if args.gpu else 'cpu'
    data = _common.header('step_time', argv, gpu=args.gpu)
    data.update(smoke=args.smoke, gpu=args.gpu,
                refresh_interval=args.interval,
                threads_requested=args.threads, conv_a=args.conv_a)
    # The convolution strategy is an option of the blocks (KFAC's
    # conv_a_strategy); 'auto' leaves the library's choice.
    kfac_options = ({} if args.conv_a == 'auto' else
                    {'conv_a_strategy': args.conv_a})
    data['cudnn'], data['autotune'] = args.cudnn, args.timed
    print('cuDNN: {}'.format(args.cudnn), flush=True)
    with _common.limit_blas_threads(args.threads), \
            chainer.using_config('autotune', args.timed):
        data['blas_threads'] = _common.blas_threads()
        if args.inverse_only:
            data['inverse'] = []
            for name, spec in specs.items():
                print('inverting the factors of {} (batch {})...'.format(
                    name, spec['batch']), flush=True)
                data['inverse'] += measure_inverse(
                    name, spec, args.rounds or 5, xp, target, kfac_options,
                    args.inverse_methods, args.newton_schulz_max_dim,
                    args.batched_max_dims or (None,),
                    args.cholesky_inverses or (None,))
            if args.gpu:
                data['inverse_routes_timed'] = inverse_routes_timed()
            text = inverse_table(data)
            if data.get('inverse_routes_timed'):
                text += ('\nlone factors, the way timing chose (autotune; '
                         "the library's route 'auto'): " + ', '.join(
                             '{} {}'.format(k, v) for k, v in
                             data['inverse_routes_timed'].items()))
        elif args.batches or args.workspace_sizes:
            data['variants'] = list(args.variants)

            def save(rows):
                _common.write_json(args.out, dict(data, sweep=rows))
            if len(args.batches or ()) > 1 and (
                    args.process_per_batch == 'on' or
                    args.process_per_batch == 'auto' and args.gpu):
                data['sweep'] = sweep_in_processes(argv, args, specs, save)
            else:
                data['sweep'] = sweep(args, specs, xp, target,
                                      kfac_options, save)
            text = sweep_table(data)
            png = _png_path(args.out)
            sweep_figure(data, png)
            text += '\nwrote {}'.format(png)
        else:
            data['variants'] = list(args.variants)
            [limit] = args.workspace_limits
            data['workspace_bytes'] = limit
            set_workspace_limit(limit)
            data['results'] = []
            for name, spec in specs.items():
                print('timing {} (batch {}, {} rounds)...'.format(
                    name, spec['batch'], spec['rounds']), flush=True)
                data['results'].append(measure(
                    name, spec, args.variants, args.interval,
                    spec['rounds'], spec['warmup'], xp,
                    profile=args.profile, target=target,
                    kfac_options=kfac_options,
                    save=lambda partial: _common.write_json(
                        args.out, dict(data, results=data['results'] +
                                       [partial]))))
                _common.write_json(args.out, data)   # so far
            text = tables(data)
            if args.peer:
                text += '\n\n' + run_peer(data, specs, args.interval, xp)
    print(_common.describe_machine(data))
    print(text)
    for result in data.get('results', []):
        if 'profile' in result:
            print('cProfile, one every-step K-FAC step of {}:\n{}'.format(
                result['model'], result['profile']))
    _common.write_json(args.out, data)
    print('wrote {}'.format(args.out))
    return 0


if __name__ == '__main__':
    sys.exit(main())

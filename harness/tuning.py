"""cuDNN's algorithm choice for a run: the workspace limit and whether the
convolution algorithms are timed, from ``--cudnn-workspace`` /
``--cudnn-autotune`` and whether CUDA graphs replay the steps.

``train_imagenet.py`` and ``python -m benchmarks.step_time --gpu`` both
take it from here, so that the benchmark times the steps as a run does.
"""
import argparse

from harness import sizes


#: cuDNN's workspace limit where the steps are replayed (``--cudnn-workspace
#: auto``). Once a graph replays the step, the host's launches are gone and
#: the kernels' GPU time is the step: on an H200 (ResNet-50, batch 32,
#: timed algorithms) the replayed SGD step took 0.0419 s with 8 MiB and
#: 0.0202 s with 1 GiB, the stale K-FAC step 0.0477 and 0.0263 s. Eager
#: steps keep Chainer's 8 MiB: there the host's time per launch decides,
#: and more room lets cuDNN's heuristics pick multi-kernel algorithms.
GRAPHS_WORKSPACE = 1 << 30


def cudnn_tuning(workspace, autotune, use_graphs):
    """cuDNN's convolution algorithms for the run: ``(limit, timed,
    words)``, the workspace limit in bytes (None: Chainer's own, 8 MiB),
    whether the algorithms are timed (``chainer.config.autotune``), and the
    start-up line.

    ``workspace`` is ``--cudnn-workspace`` (bytes, or ``'auto'``:
    :data:`GRAPHS_WORKSPACE` with CUDA graphs, else Chainer's);
    ``autotune`` is ``--cudnn-autotune`` (``'auto'``: timed with CUDA
    graphs, where the fastest kernels are the whole step; ``'on'``,
    ``'off'``).
    """
    why = 'with CUDA graphs' if use_graphs else 'eager steps'
    if workspace == 'auto':
        workspace = GRAPHS_WORKSPACE if use_graphs else None
        limit_words = 'auto, {}'.format(why)
    else:
        limit_words = 'given'
    timed = use_graphs if autotune == 'auto' else autotune == 'on'
    words = 'algorithms {} ({}), workspace limit {} ({})'.format(
        'timed' if timed else "cuDNN's heuristics",
        'auto, ' + why if autotune == 'auto' else '--cudnn-autotune ' +
        autotune,
        sizes.words(workspace) if workspace is not None
        else "Chainer's 8MiB", limit_words)
    return workspace, timed, words


def workspace_size(text):
    """An ``argparse`` type: ``--cudnn-workspace`` (``auto``, or a size
    such as ``8MiB``, ``1GiB``, bytes)."""
    if text == 'auto':
        return text
    try:
        return sizes.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None

"""cuDNN's algorithm choice for a run (harness/tuning.py), shared by
``train_imagenet.py`` and ``benchmarks.step_time --gpu``."""
import pytest

from harness import tuning


@pytest.mark.parametrize('workspace, autotune, graphs, limit, timed', [
    ('auto', 'auto', True, tuning.GRAPHS_WORKSPACE, True),
    ('auto', 'auto', False, None, False),
    (8 << 20, 'auto', True, 8 << 20, True),
    ('auto', 'off', True, tuning.GRAPHS_WORKSPACE, False),
    ('auto', 'on', False, None, True),
    (64 << 20, 'off', False, 64 << 20, False),
])
def test_cudnn_tuning_follows_the_graphs(workspace, autotune, graphs, limit,
                                         timed):
    """Replayed steps time cuDNN's algorithms with a 1 GiB limit (the GPU
    time is the step there); eager steps keep Chainer's 8 MiB and the
    heuristics; either is overridden by the options; the start-up line
    says which and why."""
    got_limit, got_timed, words = tuning.cudnn_tuning(workspace, autotune,
                                                      graphs)
    assert (got_limit, got_timed) == (limit, timed)
    assert ('timed' if timed else "cuDNN's heuristics") in words
    assert ('1GiB' if limit == tuning.GRAPHS_WORKSPACE else
            "Chainer's 8MiB" if limit is None else '') in words
    if 'auto' in (workspace, autotune):
        assert ('with CUDA graphs' if graphs else 'eager steps') in words

"""``--cuda-graphs`` in the harness (harness/run.py): refused up front
where chainerkfac.graphs does not capture the steps (several processes,
accumulation), and the optimizers built so that their steps can be
replayed (one process: K-FAC's local transport, no communicator for the
baselines). The training run itself needs a GPU
(tests/gpu/test_kfac_graphs_gpu.py)."""
import types

import pytest

import config as config_module
import train_imagenet
from chainerkfac.transport import LocalTransport
from harness import run

LISTS = ['train.txt', 'val.txt', '--config', 'run.json']


def test_refused_where_steps_are_not_captured():
    run.check_cuda_graphs(1, 1)
    with pytest.raises(ValueError, match='3 processes'):
        run.check_cuda_graphs(3, 1)
    with pytest.raises(ValueError, match='4 accumulated micro-batches'):
        run.check_cuda_graphs(1, 4)


@pytest.mark.parametrize('graphs', [False, True])
def test_optimizers_built_for_replay(graphs, monkeypatch):
    args = train_imagenet.parse_args(
        LISTS + ['--gpu'] + (['--cuda-graphs'] if graphs else []))
    cfg = config_module.load('config/demo.json')
    comm = types.SimpleNamespace(rank=0, size=1)
    made = []
    monkeypatch.setattr(run.chainerkfac, 'create_multi_node_optimizer',
                        lambda optimizer, comm: made.append(comm) or
                        optimizer)
    kfac, _ = run.build_optimizer('kfac', cfg, comm, 1, args)
    assert isinstance(kfac.transport, LocalTransport)
    assert made == ([] if graphs else [comm])
    sgd, _ = run.build_optimizer('sgd', cfg, comm, 1, args)
    assert sgd.comm is (None if graphs else comm)

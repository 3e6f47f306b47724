"""``train_imagenet.py --demo --gpu``: K-FAC and SGD on the digits, one
process on device 0 (``pure_nccl``), two epochs to keep it short."""
import json

import pytest

from tests import launch
from tests.gpu import support

pytestmark = support.MARKS + [pytest.mark.slow]


def test_demo_runs_on_the_gpu(tmp_path, monkeypatch):
    out = tmp_path / 'out'
    monkeypatch.setenv('CHAINERKFAC_CACHE', str(tmp_path / 'cache'))
    proc, seconds = launch.run_mpi(
        ['train_imagenet.py', '--demo', '--gpu', '--epochs', '2',
         '--no-progress', '--out', str(out)], nproc=1, timeout=480)
    assert proc.returncode == 0, 'demo failed after {:.0f} s:\n{}\n{}'.format(
        seconds, proc.stdout[-4000:], proc.stderr[-8000:])
    with open(out / 'summary.json') as f:
        summaries = json.load(f)
    assert [s['optimizer'] for s in summaries] == ['kfac', 'sgd']
    for summary in summaries:
        assert summary['epochs'] == 2
        assert 0.0 < summary['final_top1'] <= 1.0, summary

"""experiments/curvature/overhead.py and its peer (BackPACK on PyTorch):
the JSON, table and plot with the peer beside ours, and a clear record
when PyTorch or BackPACK cannot be imported (neither is a dependency).
The peer's own figures need PyTorch and BackPACK: see docs/curvature.md
for a run."""
import json
import sys

import pytest

from experiments.curvature import overhead
from experiments.curvature import peer_backpack


@pytest.mark.parametrize('missing, package', [
    ('torch', 'PyTorch'), ('backpack', 'BackPACK')])
def test_peer_not_importable_is_a_message(monkeypatch, missing, package):
    for module in ('torch', 'backpack'):
        if module != missing:
            monkeypatch.setitem(sys.modules, module, sys)
    monkeypatch.setitem(sys.modules, missing, None)
    reason = peer_backpack.why_unavailable()
    assert reason.startswith(package)
    assert 'cannot be imported (ModuleNotFoundError' in reason
    assert peer_backpack.run(['3c3d']) == {'skipped': reason}


def test_overhead_with_peer_skipped_writes_json_png_and_reason(
        monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, 'torch', None)
    overhead.main(['--peer', '--networks', '3c3d', '--batch', '2',
                   '--repetitions', '1', '--out', str(tmp_path)])
    out = capsys.readouterr().out
    assert 'BackPACK skipped: PyTorch cannot be imported' in out
    data = json.loads((tmp_path / 'overhead.json').read_text())
    assert data['peer_backpack']['skipped'].startswith('PyTorch')
    assert set(data['networks']['3c3d']['quantities']) == set(
        overhead.CHEAP + overhead.EXACT)
    assert (tmp_path / 'overhead.png').stat().st_size > 10000


def _result(ratios, seconds):
    return {'classes': 10, 'parameters': 1,
            'gradient_seconds': {'cpu': {'median': seconds},
                                 'wall': {'median': seconds}},
            'quantities': {q: {'rounds': 1, 'goal': None,
                               'cpu': {'ratio': {'median': r, 'q1': r,
                                                 'q3': r}},
                               'wall': {'ratio': {'median': r, 'q1': r,
                                                  'q3': r}}}
                           for q, r in ratios.items()}}


def test_table_and_plot_put_backpack_beside_ours(tmp_path):
    data = {'gpu': False, 'batch': 64, 'blas_threads': 1,
            'networks': {'3c3d': _result({'kflr': 2.0, 'kfac': 1.5}, 0.3)},
            'peer_backpack': {'networks': {'3c3d': dict(
                _result({'kflr': 4.0}, 0.1),
                unsupported={'kfac': 'NotImplementedError: ...'})}}}
    text = overhead.table(data)
    row = next(line for line in text.splitlines() if '| kflr' in line)
    assert row.replace(' ', '').endswith('|4|0.5|')
    row = next(line for line in text.splitlines() if '| kfac' in line)
    assert 'not supported' in row
    assert '3c3d ours 0.3000 / PyTorch 0.1000' in text
    overhead.plot(data, str(tmp_path / 'p.png'))
    assert (tmp_path / 'p.png').stat().st_size > 10000


def test_peer_networks_have_our_shapes():
    torch = pytest.importorskip('torch', reason='the peer needs PyTorch')
    from experiments.curvature import networks
    for name, (build, classes) in overhead.NETWORKS.items():
        model = peer_backpack.build(name, classes)
        out = model(torch.zeros(2, 3, 32, 32))
        assert tuple(out.shape) == (2, classes)
        assert sum(p.numel() for p in model.parameters()) == \
            networks.parameter_count(build(classes))

"""benchmarks/peer_pytorch.py on a CPU: its arguments, its timing rounds
(fake steps, fake clock), and that a missing PyTorch, torchvision or
kfac-pytorch gives a clear message and a JSON record instead of a crash,
alone and through ``step_time --peer``. Its figures need a GPU."""
import json
import sys

import pytest

from benchmarks import peer_pytorch
from benchmarks import step_time


def test_arguments():
    args = peer_pytorch.parse_args([])
    assert (args.batch, args.size, args.rounds, args.interval) == (
        32, 224, 11, 20)
    assert args.variants == peer_pytorch.VARIANTS and not args.exact_fp32
    args = peer_pytorch.parse_args(['--variants', 'kfac_eigen,sgd'])
    assert args.variants == ('sgd', 'kfac_eigen')
    for bad in (['--variants', 'kfac_eigen'], ['--variants', 'sgd,adam'],
                ['--batch', '0'], ['--warmup', '-1']):
        with pytest.raises(SystemExit):
            peer_pytorch.parse_args(bad)


@pytest.mark.parametrize('missing, package', [
    ('torch', 'PyTorch'), ('torchvision', 'torchvision'),
    ('kfac', 'kfac-pytorch')])
def test_not_importable_is_a_message(monkeypatch, missing, package):
    for module in ('torch', 'torchvision', 'kfac'):
        if module != missing:   # the others "import"
            monkeypatch.setitem(sys.modules, module, sys)
    monkeypatch.setitem(sys.modules, missing, None)   # import fails
    reason = peer_pytorch.why_unavailable()
    assert reason.startswith('{} cannot be imported (ModuleNotFoundError'
                             .format(package))
    assert peer_pytorch.run() == {'skipped': reason}
    assert peer_pytorch.table({'skipped': reason}) == \
        'Peer (PyTorch, kfac-pytorch): skipped: ' + reason


def test_main_records_the_reason(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, 'torch', None)
    out = tmp_path / 'peer.json'
    assert peer_pytorch.main(['--out', str(out)]) == 0
    assert 'skipped: PyTorch cannot be imported' in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data['benchmark'] == 'peer_pytorch'
    assert data['peer_pytorch']['skipped'].startswith('PyTorch cannot')


class FakeClock:
    """Each step takes the seconds its variant's function says."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_time_rounds_medians_ratios_and_refresh_steps():
    clock = FakeClock()
    order = []
    counters = {'stale': 0}

    def step(name, seconds, refresh=lambda: False):
        def run():
            order.append(name)
            clock.now += seconds
            return refresh()
        return run

    def stale_refresh():
        counters['stale'] += 1
        return counters['stale'] % 3 == 1      # every third step refreshes

    steps = {'sgd': step('sgd', 0.02),
             'every': step('every', 0.06, lambda: True),
             'stale': step('stale', 0.03, stale_refresh)}
    syncs = []
    result = peer_pytorch.time_rounds(steps, rounds=6, warmup=1,
                                      synchronize=lambda: syncs.append(1),
                                      clock=clock)
    med, ratio = result['median_s'], result['ratio_to_sgd']
    assert med['sgd'] == pytest.approx(0.02)
    assert med['every'] == pytest.approx(0.06)
    assert ratio['every'] == pytest.approx(3.0)
    assert set(med) == {'sgd', 'every', 'stale', 'stale_refresh'}
    assert len(result['samples_s']['stale_refresh']) == 2
    assert len(result['samples_s']['stale']) == 4
    assert ratio['stale'] == pytest.approx(1.5) and 'stale_refresh' not in \
        ratio
    assert len(syncs) == 2 * 6 * 3          # before and after every step
    assert order[:3] == ['sgd', 'every', 'stale']            # warm-up
    assert order[3:6] == ['sgd', 'every', 'stale']           # round 0
    assert order[6:9] == ['every', 'stale', 'sgd']           # rotated


def test_table_beside_ours():
    peer = {'model': 'torchvision resnet50', 'device': 'H100', 'batch': 32,
            'input': [3, 224, 224], 'rounds': 11,
            'settings': {'cudnn.allow_tf32': True},
            'variants': ['sgd', 'kfac_inverse', 'kfac_inverse_stale'],
            'median_s': {'sgd': 0.02, 'kfac_inverse': 0.36,
                         'kfac_inverse_stale': 0.04,
                         'kfac_inverse_stale_refresh': 0.4},
            'ratio_to_sgd': {'kfac_inverse': 18.0, 'kfac_inverse_stale': 2.0}}
    ours = {'model': 'resnet50', 'batch': 32,
            'median_s': {'sgd': 0.05, 'kfac_every': 0.18, 'kfac_stale': 0.06}}
    text = peer_pytorch.table(peer, ours)
    assert 'kfac_inverse_stale_refresh' in text
    assert 'Ours beside the peer (resnet50 batch 32)' in text
    assert '0.5' in text          # ours / theirs for K-FAC every step
    assert 'replayed' not in text     # those variants did not run
    ours['median_s'].update(sgd_graph=0.019, kfac_stale_graph=0.03)
    text = peer_pytorch.table(peer, ours)
    assert 'SGD step, replayed' in text and '0.95' in text
    assert 'K-FAC stale step, replayed' in text and '0.75' in text


def test_step_time_peer_option(monkeypatch):
    with pytest.raises(SystemExit):
        step_time.parse_args(['--peer'])                    # needs --gpu
    with pytest.raises(SystemExit):
        step_time.parse_args(['--gpu', '--peer', '--inverse-only'])
    assert step_time.parse_args(['--gpu', '--peer']).peer
    # the wiring into the same JSON, with the peer missing
    monkeypatch.setattr(peer_pytorch, 'why_unavailable',
                        lambda: 'PyTorch cannot be imported (test)')
    data = {'results': [{'model': 'resnet50', 'batch': 32,
                         'median_s': {'sgd': 0.05}}]}
    text = step_time.run_peer(data, dict(step_time.GPU), 20)
    assert data['peer_pytorch'] == {
        'skipped': 'PyTorch cannot be imported (test)'}
    assert 'skipped: PyTorch cannot be imported (test)' in text


def _torchvision_like_resnet50():
    """torchvision's ResNet-50 as far as strides go (its Bottleneck: the
    stride on ``conv2``, the 3×3, and on the ``downsample`` projection;
    layer2-4 start with stride 2)."""
    import types

    def conv(stride):
        return types.SimpleNamespace(stride=(stride, stride))

    def stage(blocks, stride):
        return [types.SimpleNamespace(
            conv1=conv(1), conv2=conv(stride if k == 0 else 1), conv3=conv(1),
            downsample=conv(stride) if k == 0 else None)
            for k in range(blocks)]
    return types.SimpleNamespace(
        layer1=stage(3, 1), layer2=stage(4, 2), layer3=stage(6, 2),
        layer4=stage(3, 2))


def _strides(block):
    return tuple(tuple(c.stride) for c in (block.conv1, block.conv2,
                                           block.conv3))


@pytest.mark.parametrize('arch', ['v1', 'v1.5'])
def test_the_peer_is_our_network(monkeypatch, arch):
    """--arch v1 (the default) moves each strided bottleneck's stride to
    its first 1×1 convolution: then every block's (conv1, conv2, conv3)
    strides are those of models/resnet50.py, block for block; v1.5 keeps
    torchvision's."""
    import types
    from models.resnet50 import ResNet50
    fake = types.SimpleNamespace(models=types.SimpleNamespace(
        resnet50=lambda weights: _torchvision_like_resnet50()))
    monkeypatch.setitem(sys.modules, 'torchvision', fake)
    assert peer_pytorch.parse_args([]).arch == 'v1'
    assert peer_pytorch.parse_args(['--arch', 'v1.5']).arch == 'v1.5'
    peer = peer_pytorch.resnet50(arch)
    ours = ResNet50(n_class=10)
    stages = [list(getattr(ours, 'res{}'.format(i)).children())
              for i in range(2, 6)]
    theirs = [peer.layer1, peer.layer2, peer.layer3, peer.layer4]
    differ = 0
    for our_stage, their_stage in zip(stages, theirs):
        assert len(our_stage) == len(their_stage)
        for mine, other in zip(our_stage, their_stage):
            differ += _strides(mine) != _strides(other)
            assert tuple(other.downsample.stride if other.downsample else
                         (1, 1)) == (tuple(mine.conv_shortcut.stride)
                                     if hasattr(mine, 'conv_shortcut')
                                     else (1, 1))
    assert differ == (0 if arch == 'v1' else 3)
    with pytest.raises(ValueError, match='arch must be one of'):
        peer_pytorch.resnet50('v2')

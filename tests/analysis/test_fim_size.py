"""Figure 4: FIM sizes from the model's Fisher blocks."""
import chainerkfac  # NOQA  (before chainer)
import chainer
import chainer.links as L
import pytest

from analysis import _models, fim_size
from tests.analysis.helpers import assert_picture, no_outputs, read_json

MIB = 2.0 ** 20


@pytest.fixture(scope='module')
def resnet50_sizes():
    return fim_size.fim_sizes(_models.build_model('resnet50'), packed=True)


def test_resnet50_reproduces_the_paper(resnet50_sizes):
    result = resnet50_sizes
    assert result['layers'] == {fim_size.CONV: 53, fim_size.FC: 1,
                                fim_size.BN: 53, 'total': 107}
    full = result['variants']['no approx']
    diag = result['variants']['diagonal FIM BN']
    assert round(full['total']) == 1017      # the paper's 1017 MiB
    assert round(diag['total']) == 587       # and 587 MiB
    assert full[fim_size.CONV] == diag[fim_size.CONV]
    # FC: A of (2048 + bias)^2 and G of 1000^2, fp32.
    assert full[fim_size.FC] == pytest.approx(
        (2049 ** 2 + 1000 ** 2) * 4 / MIB)
    # BN diag: 2C per layer; sum of C over ResNet-50's 53 BN layers.
    channels = 64 + sum(
        n * (mid + mid + out) + out
        for mid, out, n in ((64, 256, 3), (128, 512, 4), (256, 1024, 6),
                            (512, 2048, 3)))
    assert diag[fim_size.BN] == pytest.approx(2 * channels * 4 / MIB)
    packed = result['variants']['no approx (packed)']
    assert 0.49 < packed['total'] / full['total'] < 0.51


class Tiny(chainer.Chain):
    """conv 3->4 (3x3, bias), BN(4), linear 4->5 (no bias)."""

    def __init__(self):
        super().__init__()
        with self.init_scope():
            self.conv = L.Convolution2D(3, 4, 3)
            self.bn = L.BatchNormalization(4)
            self.fc = L.Linear(4, 5, nobias=True)


def test_tiny_model_by_hand():
    result = fim_size.fim_sizes(Tiny(), packed=True)
    assert result['layers'] == {fim_size.CONV: 1, fim_size.FC: 1,
                                fim_size.BN: 1, 'total': 3}
    full = result['variants']['no approx']
    # conv: A (3*3*3 + 1 bias)^2 = 784, G 4^2 = 16 -> 800 elements.
    assert full[fim_size.CONV] * MIB == 800 * 4
    # fc without bias: A 4^2 + G 5^2 = 41 elements.
    assert full[fim_size.FC] * MIB == 41 * 4
    # BN full (2*4)^2 = 64; diagonal 2*4 = 8.
    assert full[fim_size.BN] * MIB == 64 * 4
    assert result['variants']['diagonal FIM BN'][fim_size.BN] * MIB == 8 * 4
    assert full['total'] * MIB == (800 + 41 + 64) * 4
    # Packed triangles: 28*29/2 + 4*5/2 = 416; 4*5/2 + 5*6/2 = 25; 8*9/2.
    packed = result['variants']['no approx (packed)']
    assert packed['total'] * MIB == (416 + 25 + 36) * 4
    assert result['variants']['diagonal FIM BN (packed)'][fim_size.BN] \
        * MIB == 8 * 4


def test_cli_resnet50(tmp_path, capsys):
    out = tmp_path / 'fig4.png'
    assert fim_size.main(['--model', 'resnet50', '--out', str(out)]) == 0
    printed = capsys.readouterr().out
    assert 'K-FAC layers: 107' in printed
    assert '1017.33' in printed and '587.10' in printed
    assert_picture(str(out))
    data = read_json(str(tmp_path / 'fig4.json'))
    assert round(data['variants']['no approx']['total']) == 1017
    assert round(data['variants']['diagonal FIM BN']['total']) == 587


def test_cli_small_resnet_with_packed(tmp_path, capsys):
    out = tmp_path / 'small.png'
    assert fim_size.main(['--model', 'small', '--depth', '8', '--width',
                          '4', '--packed', '--out', str(out)]) == 0
    assert 'no approx (packed)' in capsys.readouterr().out
    assert_picture(str(out))
    data = read_json(str(tmp_path / 'small.json'))
    # depth 8: stem + 3 blocks x 2 convs + 2 shortcuts = 9 convs, 9 BN, 1 FC
    assert data['layers']['total'] == 19


@pytest.mark.parametrize('argv, message', [
    (['--model', 'vgg16'], "unknown model 'vgg16'"),
    (['--model', 'small', '--depth', '9'], 'depth must be 6n+2'),
])
def test_bad_model_is_a_clear_error(tmp_path, capsys, argv, message):
    code = fim_size.main(argv + ['--out', str(tmp_path / 'x.png')])
    assert code == 2
    assert message in capsys.readouterr().err
    assert no_outputs(tmp_path)

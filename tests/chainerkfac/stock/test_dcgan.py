"""DCGAN with its updater: the discriminator on the real and the fake
batch, then ``update(loss_dis, y_fake, y_real)`` and ``update(loss_gen,
y_fake)`` — the forward passes happen before ``update``, and the
generator's loss backpropagates through the updated discriminator. The
example's sizes (ch = 512, 32²): the generator's first BN has 8192
channels (a 16384² full Fisher) and its Linear's G is 8192², the
discriminator's last Linear has 8193 inputs; the cost guard keeps them
diagonal."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

from tests.chainerkfac.stock import common
from tests.chainerkfac.stock import nets


def test_dcgan_updater(caplog):
    limit = common.MAX_FACTOR_DIM
    trainee = nets.dcgan(batch=4)().setup(
        lambda: common.kfac(max_factor_dim=limit))
    before, reports, warnings = common.train(trainee, caplog)
    dis_table, gen_table = common.check_trained(
        trainee, before, reports, warnings, max_factor_dim=limit)
    gen = common.rows_of(gen_table)
    assert 'BN (diagonal Fisher)' in gen['/bn0']
    assert 'diagonal Fisher (2C=16384 > max_factor_dim={})'.format(
        limit) in gen['/bn0']
    assert 'G 8192 (diag)' in gen['/l0']
    for name in ('/dc1', '/dc2', '/dc3', '/dc4'):
        assert 'no Fisher block for Deconvolution2D' in gen[name]
    dis = common.rows_of(dis_table)
    assert 'A 8193 (diag), G 1x1' in dis['/l4']
    for name in ('/c0_0', '/c0_1', '/c1_0', '/c1_1', '/c2_0', '/c2_1',
                 '/c3_0'):
        assert 'Conv2D (K-FAC)' in dis[name]
    for name in ('/bn0_1', '/bn1_0', '/bn3_0'):
        assert 'without gamma' in dis[name]

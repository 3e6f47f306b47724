"""Chainer's VAE: encoder and decoder Linears, the loss (Bernoulli
reconstruction + Gaussian KL, per sample) as the updater's
``loss_func``."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

from tests.chainerkfac.stock import common
from tests.chainerkfac.stock import nets


def test_vae_elbo(caplog):
    trainee = nets.vae(batch=32)().setup(common.kfac)
    before, reports, warnings = common.train(trainee, caplog)
    [table] = common.check_trained(trainee, before, reports, warnings)
    rows = common.rows_of(table)
    assert len(rows) == 5
    assert all('Linear (K-FAC)' in row for row in rows.values())

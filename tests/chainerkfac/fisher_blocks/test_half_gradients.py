"""A float16 model's gradients are preconditioned in float32 (stage 5):
the product of a damped inverse (1/γ_G of thousands) with a gradient left
float16's range where the whole direction stays inside it, and the step
was skipped as non-finite (an auditor: 5 of 20 steps skipped; a dynamic
loss scale halved down to 2.5 for overflows that were not in the
gradients; momentum SGD skipped none)."""
import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import chainerkfac


@pytest.mark.parametrize('options', [
    {},                                       # low-rank (Woodbury) inverses
    {'low_rank': False},                      # dense inverses
    {'low_rank': False, 'max_factor_dim': 4},  # factors kept diagonal
], ids=['low-rank', 'dense', 'diagonal'])
def test_a_float16_model_takes_every_step(options):
    with chainer.using_config('dtype', numpy.float16):
        numpy.random.seed(0)
        model = L.Classifier(chainer.Sequential(L.Linear(6, 16), F.tanh,
                                                L.Linear(16, 4)))
    rng = numpy.random.RandomState(1)
    x = (100 * rng.randn(80, 6)).astype(numpy.float16)
    t = rng.randint(0, 4, 80).astype(numpy.int32)
    optimizer = chainerkfac.optimizers.KFAC(lr=0.001, verbose=False,
                                            **options)
    optimizer.setup(model)
    optimizer.use_fp32_update()
    for step in range(20):
        chunk = slice(8 * (step % 10), 8 * (step % 10) + 8)
        with chainer.using_config('dtype', numpy.float16):
            optimizer.update(model, x[chunk], t[chunk])
    assert optimizer.guard.skipped_steps == 0
    for param in model.params():
        assert param.array.dtype == numpy.float16
        assert numpy.isfinite(param.array).all()

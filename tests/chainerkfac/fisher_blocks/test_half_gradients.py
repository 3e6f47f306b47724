"""A float16 model's gradients are preconditioned in float32 (stage 5),
and the bounded step's sums over them taken in float32:
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


@pytest.mark.parametrize('options, width, scale', [
    ({}, 16, 100),                             # low-rank (Woodbury)
    ({'low_rank': False}, 16, 100),            # dense inverses
    ({'low_rank': False, 'max_factor_dim': 4}, 16, 100),   # diagonal
    # the bounded step's ⟨d, ∇E⟩ (70,238 in a reviewer's run) was summed
    # in float16: inf, and the step skipped
    ({'low_rank': False}, 256, 1000),
], ids=['low-rank', 'dense', 'diagonal', 'bounded-step-sum'])
def test_a_float16_model_takes_every_step(options, width, scale):
    with chainer.using_config('dtype', numpy.float16):
        numpy.random.seed(0)
        model = L.Classifier(chainer.Sequential(L.Linear(6, width), F.tanh,
                                                L.Linear(width, 4)))
    rng = numpy.random.RandomState(1)
    x = (scale * rng.randn(80, 6)).astype(numpy.float16)
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

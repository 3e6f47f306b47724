"""PTB's language model with its BPTT updater: the loss summed over the
time steps (``loss += model(x_t, t_t)``), then ``cleargrads();
loss.backward(); loss.unchain_backward(); update()``, gradient clipping as
the example, an evaluation on a copy of the model between iterations (the
example's Evaluator). The LSTMs' Linears are called at every time step:
each call contributes (``lateral`` from the second step on)."""
import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import chainer

from tests.chainerkfac.stock import common
from tests.chainerkfac.stock import nets


def test_ptb_bptt_loop(caplog):
    build = nets.ptb(n_vocab=200, n_units=64, batch=5, bprop_len=6)
    trainee = build()
    clipped = []

    class Clipping(chainer.optimizer_hooks.GradientClipping):
        def __call__(self, optimizer):
            clipped.append(optimizer.t)
            super().__call__(optimizer)

    trainee.hooks = [lambda: Clipping(5.0)]      # the example's hook
    trainee.setup(common.kfac)
    model = trainee.targets[0]
    corpus = nets.PTBCorpus(200, batch=5, seed=1)
    before = [{n: p.array.copy() for n, p in model.namedparams()}]
    reporter = common.RecordingReporter()
    reporter.add_observer('main', model)
    with caplog.at_level('WARNING', logger='chainerkfac'):
        for _ in range(common.STEPS):
            with reporter.scope({}):
                trainee.step()
            # The example's evaluator: a copy, reset, no backward.
            evaluator = model.copy()
            evaluator.predictor.reset_state()
            with chainer.using_config('train', False), \
                    chainer.no_backprop_mode():
                for _ in range(3):
                    evaluator(*corpus.next())
    warnings = [r.getMessage() for r in caplog.records
                if r.name.startswith('chainerkfac')]
    [table] = common.check_trained(trainee, before, reporter.calls, warnings)
    rows = common.rows_of(table)
    assert 'no Fisher block for EmbedID' in rows['/predictor/embed']
    for name in ('/predictor/l1/upward', '/predictor/l1/lateral',
                 '/predictor/l2/upward', '/predictor/l2/lateral',
                 '/predictor/l3'):
        assert 'Linear (K-FAC)' in rows[name]
    # The example's gradient clipping ran at every step (on the
    # preconditioned direction: chainerkfac.optimizers.hooks).
    assert clipped == [0, 1, 2]

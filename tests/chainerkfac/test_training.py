import logging
import types

import chainer
import chainer.links as L
import numpy as np
import pytest
from chainer import training

from chainerkfac.training import (LinearWarmupLR, PolynomialLRDecay,
                                    TimeToAccuracy, polynomial_decay,
                                    step_decay)

# bs32k of Table 3 (published magnitudes).
LR0, P, E_START, E_END, M0 = 0.03, 3.5, 1.5, 49.5, 0.97


def eq17(e):
    """η(e), written out independently of chainerkfac.equations."""
    if e <= E_START:
        return LR0
    if e >= E_END:
        return 0.0
    return LR0 * (1 - (e - E_START) / (E_END - E_START)) ** P


def make_optimizer():
    optimizer = chainer.optimizers.MomentumSGD(lr=123.0, momentum=0.5)
    optimizer.setup(L.Linear(2, 2))
    return optimizer


def fake_trainer(optimizer, epoch):
    updater = types.SimpleNamespace(epoch_detail=epoch,
                                    get_optimizer=lambda name: optimizer)
    return types.SimpleNamespace(updater=updater)


EPS = 1e-6
POINTS = [0.0, 0.5, E_START, (E_START + E_END) / 2, 10.25, E_END - EPS,
          E_END, E_END + 3]


def test_extension_protocol():
    extension = PolynomialLRDecay(LR0, P, E_START, E_END, M0)
    assert extension.trigger == (1, 'iteration')
    assert callable(extension.initialize) and callable(extension.serialize)


@pytest.mark.parametrize('epoch', POINTS)
def test_polynomial_lr_and_coupled_momentum(epoch):
    optimizer = make_optimizer()
    extension = PolynomialLRDecay(LR0, P, E_START, E_END, momentum_init=M0)
    extension(fake_trainer(optimizer, epoch))
    lr = eq17(epoch)
    assert optimizer.lr == pytest.approx(lr, rel=1e-12, abs=1e-300)
    assert optimizer.momentum == pytest.approx(M0 / LR0 * lr, rel=1e-12,
                                               abs=1e-300)
    assert extension.last_values == {'lr': optimizer.lr,
                                     'momentum': optimizer.momentum}


def test_listed_values():
    optimizer = make_optimizer()
    extension = PolynomialLRDecay(LR0, P, E_START, E_END, momentum_init=M0)
    expected = {0.0: (LR0, M0), E_START: (LR0, M0),
                (E_START + E_END) / 2: (LR0 * 0.5 ** P, M0 * 0.5 ** P),
                E_END: (0.0, 0.0)}
    for epoch, (lr, momentum) in expected.items():
        extension(fake_trainer(optimizer, epoch))
        assert optimizer.lr == pytest.approx(lr, rel=1e-12)
        assert optimizer.momentum == pytest.approx(momentum, rel=1e-12)
    extension(fake_trainer(optimizer, E_END - EPS))
    assert 0 < optimizer.lr < 1e-20 and 0 < optimizer.momentum < 1e-18


def test_momentum_untouched_without_momentum_init():
    optimizer = make_optimizer()
    extension = PolynomialLRDecay(LR0, P, E_START, E_END)
    extension.initialize(fake_trainer(optimizer, 20.0))
    assert optimizer.lr == pytest.approx(eq17(20.0), rel=1e-12)
    assert optimizer.momentum == 0.5


def test_bad_arguments():
    with pytest.raises(ValueError, match='e_end'):
        PolynomialLRDecay(LR0, P, 5, 5)
    with pytest.raises(ValueError, match='lr_init'):
        PolynomialLRDecay(0.0, P, 1, 5)
    with pytest.raises(ValueError, match='warmup_epochs'):
        LinearWarmupLR(0.1, 0.01, warmup_epochs=-1)


@pytest.mark.parametrize('make, match', [
    # a momentum of 5e6 went onto the optimizer, whose constructor refuses
    # anything >= 1
    (lambda: PolynomialLRDecay(0.1, -2, 0, 10, momentum_init=5),
     r'PolynomialLRDecay: p_decay=-2 must be a finite number > 0'),
    (lambda: PolynomialLRDecay(0.1, 2, 0, 10, momentum_init=5),
     r'momentum_init=5 must be a finite number in \[0, 1\)'),
    (lambda: PolynomialLRDecay('0.1', 2, 0, 10), r"lr_init='0.1'"),
    (lambda: LinearWarmupLR(None, 0.01), r'LinearWarmupLR: lr=None'),
    # NaN skipped the warm-up silently
    (lambda: LinearWarmupLR(0.1, 0.01, warmup_epochs=float('nan')),
     r'warmup_epochs=nan'),
    (lambda: step_decay(0.1, milestones=30), r'milestones=30 must be a '
     r'sequence'),
    (lambda: step_decay(0.1, milestones=('30',)), r"milestones='30'"),
    (lambda: polynomial_decay(0.1, 2.0, 18.0, 10.0), r'e_end \(10.0\) '
     r'must be larger than e_start \(18.0\)'),
    (lambda: polynomial_decay(0.1, 2.0, -1, 10.0), r'e_start=-1'),
    (lambda: LinearWarmupLR(10 ** 400, 0.01), r'lr=1000'),
])
def test_schedule_arguments_are_named_when_wrong(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_linear_warmup_then_step_decay():
    optimizer = make_optimizer()
    k = 32
    lr = 0.1 * k
    extension = LinearWarmupLR(lr, lr / k, warmup_epochs=5,
                               decay=step_decay(lr, (30, 60, 80), 0.1))
    expected = {0: lr / k, 2.5: lr / k + (lr - lr / k) / 2,
                5 - EPS: lr - (lr - lr / k) * EPS / 5, 5: lr, 29.9: lr,
                30: lr * 0.1, 59.99: lr * 0.1, 60: lr * 0.01, 80: lr * 1e-3,
                89: lr * 1e-3}
    for epoch, value in expected.items():
        extension(fake_trainer(optimizer, epoch))
        assert optimizer.lr == pytest.approx(value, rel=1e-12)
        assert optimizer.momentum == 0.5


def test_linear_warmup_then_polynomial_decay():
    optimizer = make_optimizer()
    extension = LinearWarmupLR(LR0, LR0 / 10, warmup_epochs=1,
                               decay=polynomial_decay(LR0, P, E_START, E_END))
    for epoch, value in {0.5: LR0 / 10 + 0.9 * LR0 / 2, 1.2: LR0,
                         20.0: eq17(20.0), E_END: 0.0}.items():
        extension(fake_trainer(optimizer, epoch))
        assert optimizer.lr == pytest.approx(value, rel=1e-12)
    no_warmup = LinearWarmupLR(0.2, 0.0, warmup_epochs=0)
    no_warmup(fake_trainer(optimizer, 0.0))
    assert optimizer.lr == 0.2


class LrRecorder(training.Extension):
    """Records the lr used by the update that just ran (runs first)."""
    trigger = 1, 'iteration'
    priority = training.PRIORITY_WRITER + 100

    def __init__(self):
        self.lrs = []

    def __call__(self, trainer):
        self.lrs.append(trainer.updater.get_optimizer('main').lr)


def make_trainer(tmp_path, stop_epoch):
    model = L.Classifier(L.Linear(3, 2))
    optimizer = chainer.optimizers.MomentumSGD()
    optimizer.setup(model)
    rng = np.random.RandomState(0)
    data = chainer.datasets.TupleDataset(
        rng.randn(10, 3).astype(np.float32),
        rng.randint(0, 2, 10).astype(np.int32))
    iterator = chainer.iterators.SerialIterator(data, 4)  # 2.5 it / epoch
    updater = training.updaters.StandardUpdater(iterator, optimizer)
    trainer = training.Trainer(updater, (stop_epoch, 'epoch'),
                               out=str(tmp_path))
    recorder = LrRecorder()
    trainer.extend(recorder)
    trainer.extend(PolynomialLRDecay(0.1, 2.0, 0.5, 3.0, momentum_init=0.9),
                   name='lr_decay')
    return trainer, recorder, optimizer


def test_in_a_real_trainer_each_step_uses_the_lr_of_its_start_epoch(
        tmp_path):
    trainer, recorder, optimizer = make_trainer(tmp_path, 4)
    trainer.run()

    def eq17_small(e):
        if e <= 0.5:
            return 0.1
        return 0.1 * max(1 - (e - 0.5) / 2.5, 0) ** 2.0
    expected = [eq17_small(t * 0.4) for t in range(len(recorder.lrs))]
    assert len(expected) == 10
    np.testing.assert_allclose(recorder.lrs, expected, rtol=1e-12)
    assert optimizer.lr == 0.0 and optimizer.momentum == 0.0


def test_resume_continues_the_schedule(tmp_path):
    trainer, _, _ = make_trainer(tmp_path / 'a', 1)
    trainer.run()
    path = str(tmp_path / 'snapshot.npz')
    chainer.serializers.save_npz(path, trainer)

    resumed, recorder, optimizer = make_trainer(tmp_path / 'b', 2)
    chainer.serializers.load_npz(path, resumed)
    assert resumed.get_extension('lr_decay').last_values['lr'] == \
        pytest.approx(0.1 * (1 - (1.2 - 0.5) / 2.5) ** 2)
    resumed.run()
    # Iterations 4 and 5 start at epochs 1.2 and 1.6.
    np.testing.assert_allclose(
        recorder.lrs, [0.1 * (1 - (e - 0.5) / 2.5) ** 2 for e in (1.2, 1.6)],
        rtol=1e-12)


def test_resume_by_a_snapshots_autoload_continues_the_schedule(tmp_path):
    """Chainer's ``snapshot(autoload=True)`` loads the trainer in its own
    ``initialize``, at its priority (-100). The schedules' ``initialize``
    ran before it (the default priority, 100), at epoch 0: the first
    resumed step took the peak lr and momentum (an auditor's killed K-FAC
    run ended 0.04 off the uninterrupted one). They now run after it."""
    from chainer.training import extensions
    for stop in (1, 2):
        trainer, recorder, optimizer = make_trainer(tmp_path, stop)
        trainer.extend(extensions.snapshot(autoload=True),
                       trigger=(1, 'iteration'))
        trainer.run()
    # the second run resumed at iteration 3 (epoch 1.2)
    np.testing.assert_allclose(
        recorder.lrs, [0.1 * (1 - (e - 0.5) / 2.5) ** 2 for e in (1.2, 1.6)],
        rtol=1e-12)
    assert optimizer.momentum == pytest.approx(
        0.9 / 0.1 * optimizer.lr, rel=1e-12)


def test_time_to_accuracy_reported_by_the_writing_process_only(tmp_path,
                                                                 caplog):
    """Under mpiexec every rank keeps the record (for its snapshot); only
    the one writing the run's files (rank 0) reports it."""
    updater = types.SimpleNamespace(epoch_detail=2.0, iteration=20)
    trainer = types.SimpleNamespace(
        observation={'validation/main/accuracy': 0.95}, updater=updater,
        elapsed_time=3.0, out=str(tmp_path))
    caplog.set_level(logging.INFO, logger='chainerkfac')
    for write in (True, False):
        extension = TimeToAccuracy(0.9, write=write)
        extension(trainer)
        assert extension.reached['epoch'] == 2.0
    reports = [r.getMessage() for r in caplog.records
               if 'reached' in r.getMessage()]
    assert reports == ['target top-1 0.900 reached at epoch 2.00 '
                       '(iteration 20, 3.0 s)']
    assert (tmp_path / 'time_to_accuracy.json').exists()


def test_time_to_accuracy_names_a_wrong_target():
    """``TimeToAccuracy('0.75')`` raised ``TypeError: '<' not supported``
    naming nothing."""
    with pytest.raises(ValueError, match=r"TimeToAccuracy: target='0.75' "
                       r"must be an accuracy in \(0, 1\]"):
        TimeToAccuracy('0.75')
    with pytest.raises(ValueError, match='target=75'):
        TimeToAccuracy(75)

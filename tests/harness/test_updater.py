"""The updater drives every optimizer through one path (K-FAC, and the
first-order baselines as GuardedOptimizer): a non-finite step leaves the
weights and BatchNormalization's running statistics as they were, its
mixup partners are not kept, K-FAC's Monte-Carlo labels come from the data
stream; the batch converter normalises uint8 batches and refuses
unreadable images."""
import logging
import types

import chainer
import chainer.links as L

import numpy as np
import pytest

import augment
import chainerkfac
import models
from augment.stream import MC_LABELS, stream_rng
from harness.evaluation import EmptyBatch
from harness.updater import AugmentedUpdater, BatchConverter
from tests.harness import OneProcess


class Batches(chainer.dataset.Iterator):
    """An iterator of fixed batches with the GlobalBatchIterator surface."""

    batch_size = 4

    def __init__(self, batches, n_examples):
        self.batches, self.position, self.n = batches, 0, n_examples
        self.n_examples = n_examples

    def next(self):
        batch = self.batches[self.position % len(self.batches)]
        self.position += 1
        return batch

    @property
    def chunks(self):
        return self.position

    @property
    def epoch_detail(self):
        return self.position * 4 / self.n

    @property
    def is_new_epoch(self):
        return False

    def finalize(self):
        pass

    def serialize(self, serializer):
        pass


def batch(value, labels=(0, 1, 2, 1)):
    rng = np.random.RandomState(value)
    return [(rng.randint(0, 256, (3, 8, 8)).astype(np.uint8), np.int32(t), '')
            for t in labels]


def reporting(model, observation):
    """A reporter scope collecting what the updater and model report, as
    the Trainer's."""
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    return reporter.scope(observation)


def statistics(model):
    return {name: np.array(getattr(link, name))
            for path, link in model.namedlinks()
            if isinstance(link, L.BatchNormalization)
            for name in ('avg_mean', 'avg_var')}


def make_updater(batches, acc_iters=2, stop_epoch=100):
    np.random.seed(0)
    model = models.SoftLabelClassifier(models.SmallResNet(8, 4, 3))
    optimizer = chainerkfac.optimizers.GuardedOptimizer(
        chainer.optimizers.MomentumSGD(lr=0.1), acc_iters, OneProcess())
    optimizer.setup(model)
    updater = AugmentedUpdater(
        Batches(batches, 16), optimizer, OneProcess(), acc_iters, stop_epoch,
        BatchConverter(None, labels_on_host=True), seed=0, alpha_mixup=0.4,
        n_class=3, erasing=True, device=chainer.get_device('@numpy'))
    return updater, model


def plain_updater(optimizer, batches, acc_iters=1):
    """The updater of ``optimizer`` without mixup or erasing, on the host."""
    return AugmentedUpdater(
        batches, optimizer, OneProcess(), acc_iters, 100,
        BatchConverter(None, labels_on_host=True), seed=0, alpha_mixup=0.0,
        n_class=3, erasing=False, device=chainer.get_device('@numpy'))


def test_non_finite_step_keeps_weights_and_bn_statistics(capsys):
    updater, model = make_updater([batch(1), batch(2)])
    with reporting(model, {}):
        for _ in range(2):
            updater.update()
    weights = {n: p.array.copy() for n, p in model.namedparams()}
    before = statistics(model)
    original = updater.converter

    class Poisoned(BatchConverter):
        def __call__(self, b, device):
            x, t = original(b, device)
            x[0, 0, 0, 0] = np.nan
            return x, t
    updater.converter = Poisoned(None, labels_on_host=True)
    with reporting(model, {}):
        for _ in range(2):                    # one step of 2 micro-batches
            updater.update()
    assert 'non-finite gradient, update skipped' in capsys.readouterr().err
    for name, param in model.namedparams():
        np.testing.assert_array_equal(param.array, weights[name])
    after = statistics(model)
    for name in before:
        assert np.isfinite(after[name]).all()
        np.testing.assert_array_equal(after[name], before[name])
    updater.converter = original
    with reporting(model, {}):
        for _ in range(2):
            updater.update()
    assert any(not np.array_equal(p.array, weights[n])
               for n, p in model.namedparams())


def test_last_partial_step_is_completed(capsys):
    # 4 samples per micro-batch, 16 per epoch: 1 epoch = 4 micro-batches,
    # 1.33 steps of 3.
    updater, model = make_updater([batch(1), batch(2)], acc_iters=3,
                                  stop_epoch=1)
    observation = {}
    with reporting(model, observation):
        for _ in range(4):
            updater.update()
    assert updater.finished
    assert observation['trailing_micro_batches'] == 1
    assert updater.get_optimizer('main').t == 2
    assert 'ends 1 micro-batch into a step of 3: it makes a final step ' \
        'of its own' in capsys.readouterr().out


def test_converter_normalises_and_refuses_unreadable_images():
    mean = np.full((3, 8, 8), 100, np.float32)
    good = batch(3)
    x, t = BatchConverter(mean)(good, chainer.get_device('@numpy'))
    expected = np.stack([augment.normalize(image, mean)
                         for image, _, _ in good])
    np.testing.assert_array_equal(x, expected)
    assert x.dtype == np.float32 and t.dtype == np.int32
    bad = good[:2] + [(good[2][0], good[2][1], 'cannot read x.JPEG (listed '
                       'in l.txt, line 3)')] + good[3:]
    with pytest.raises(OSError, match='x.JPEG .*line 3.*--skip-bad-images'):
        BatchConverter(mean)(bad, chainer.get_device('@numpy'))
    dropping = BatchConverter(mean, skip_bad=True, drop_bad=True)
    x, t = dropping(bad, chainer.get_device('@numpy'))
    assert len(x) == 3 and dropping.skipped == 1
    # a batch of unreadable images only: the evaluator's to skip
    with pytest.raises(EmptyBatch, match='x.JPEG .*line 3'):
        dropping(bad[2:3], chainer.get_device('@numpy'))


def test_the_evaluator_skips_a_batch_with_no_readable_image():
    """``--skip-bad-images``, the last validation batch of a process
    holding one unreadable image: the epoch's evaluation is the mean over
    the readable ones (it crashed with "batch is empty" after an epoch's
    training, its snapshot not written)."""
    from harness.evaluation import GlobalMeanEvaluator
    good = batch(4)
    bad = [(good[0][0], good[0][1], 'cannot read x.JPEG (listed in '
            'l.txt, line 9)')]
    seen = []

    class Model(chainer.Link):
        def __call__(self, x, t):
            seen.append(len(x))
            chainer.report({'loss': float(len(x))}, self)

    model = Model()
    comm = types.SimpleNamespace(mpi_comm=types.SimpleNamespace(
        allgather=lambda value: [value],
        allreduce=lambda value: value))
    iterator = chainer.iterators.SerialIterator(
        [good[:3], good[3:], bad], 1, repeat=False, shuffle=False)
    evaluator = GlobalMeanEvaluator(
        {'main': _Unwrap(iterator)}, model, comm,
        BatchConverter(None, skip_bad=True, drop_bad=True),
        device=chainer.get_device('@numpy'))
    reporter = chainer.Reporter()
    reporter.add_observer('main', model)
    with reporter:
        result = evaluator.evaluate()
    assert seen == [3, 1]
    assert result['main/loss'] == pytest.approx((3 * 3 + 1 * 1) / 4)


class _Unwrap:
    """An iterator of batches made of the examples that one wraps."""

    def __init__(self, iterator):
        self.iterator = iterator

    def reset(self):
        self.iterator.reset()

    def __iter__(self):
        return (examples[0] for examples in self.iterator)


def test_converter_reports_each_skipped_image_once(capsys):
    """--skip-bad-images: a bad file is skipped every epoch, counted every
    time, reported the first time only (also inside a sample's message
    joining several skipped images)."""
    good = batch(2)
    x_bad = 'cannot read x.JPEG (listed in l.txt, line 3)'
    y_bad = 'cannot read y.JPEG (listed in l.txt, line 4)'
    converter = BatchConverter(None, skip_bad=True)
    for message in (x_bad, x_bad, y_bad + '; ' + x_bad, y_bad):
        converter([good[0], (good[1][0], good[1][1], message)],
                  chainer.get_device('@numpy'))
    assert converter.skipped == 5
    assert capsys.readouterr().err.splitlines() == [
        'skipping unreadable image: ' + x_bad,
        'skipping unreadable image: ' + y_bad]


def test_warnings_of_one_kfac_step_number_it_alike(caplog):
    """A NaN micro-batch: its factors cannot be inverted and the step is
    skipped; every warning of that step names the same step (issue 20,
    item 9: the skip warning numbered it one higher; fixed in
    chainerkfac/optimizers/kfac.py on main, 9722644)."""
    import re
    np.random.seed(0)
    model = models.SoftLabelClassifier(models.SmallResNet(8, 4, 3))
    # Every step refreshed: the poisoned step's factors are inverted.
    optimizer = chainerkfac.optimizers.KFAC(
        refresh_interval_a=1, refresh_interval_g=1, refresh_interval_f=1,
        verbose=False)
    optimizer.setup(model)
    updater = plain_updater(optimizer, Batches([batch(1), batch(2)], 16))
    with reporting(model, {}):
        updater.update()
    original = updater.converter

    class Poisoned(BatchConverter):
        def __call__(self, b, device):
            x, t = original(b, device)
            x[:] = np.nan
            return x, t
    updater.converter = Poisoned(None, labels_on_host=True)
    with caplog.at_level(logging.WARNING, logger='chainerkfac'), \
            reporting(model, {}):
        updater.update()
    messages = [r.getMessage() for r in caplog.records
                if 'K-FAC step' in r.getMessage()]
    assert any('could not be inverted' in m for m in messages)
    assert any('update skipped' in m for m in messages)
    assert len({re.search(r'K-FAC step (\d+)', m).group(1)
                for m in messages}) == 1, messages


def test_the_run_and_the_optimizer_must_agree_on_acc_iters():
    model = models.SoftLabelClassifier(models.SmallResNet(8, 4, 3))
    optimizer = chainerkfac.optimizers.KFAC(acc_iters=2, verbose=False)
    optimizer.setup(model)
    with pytest.raises(ValueError, match='accumulates 2 .* run 3'):
        AugmentedUpdater(
            Batches([batch(1)], 16), optimizer, OneProcess(), 3, 100,
            BatchConverter(None, labels_on_host=True), seed=0,
            alpha_mixup=0.0, n_class=3, erasing=False,
            device=chainer.get_device('@numpy'))


def test_monte_carlo_labels_come_from_the_data_stream(monkeypatch):
    """K-FAC's MC Fisher draws chunk j's labels from (seed, MC_LABELS, j),
    as the augmentation does: any number of processes draws alike."""
    np.random.seed(0)
    model = models.SoftLabelClassifier(models.SmallResNet(8, 4, 3))
    # Every step refreshed: every step draws labels.
    optimizer = chainerkfac.optimizers.KFAC(
        fisher='mc', refresh_interval_a=1, refresh_interval_g=1,
        refresh_interval_f=1, verbose=False, seed=123)
    optimizer.setup(model)
    updater = AugmentedUpdater(
        Batches([batch(1), batch(2)], 16), optimizer, OneProcess(), 1, 100,
        BatchConverter(None, labels_on_host=True), seed=7, alpha_mixup=0.0,
        n_class=3, erasing=False, device=chainer.get_device('@numpy'))
    drawn = []
    sample = optimizer.label_sampler.sample

    def recording(logits):
        labels = sample(logits)
        drawn.append((np.array(logits), labels))
        return labels
    monkeypatch.setattr(optimizer.label_sampler, 'sample', recording)
    own = optimizer.label_sampler.rng.get_state()[2]
    with reporting(model, {}):
        for _ in range(3):
            updater.update()
    assert len(drawn) == 3
    # The sampler's own generator was not used ...
    assert optimizer.label_sampler.rng.get_state()[2] == own
    # ... but chunk j's generator of the stream.
    for j, (logits, labels) in enumerate(drawn):
        again = chainerkfac.estimator.LabelSampler(seed=123)
        again.source = stream_rng(7, MC_LABELS, j)
        np.testing.assert_array_equal(again.sample(logits), labels)
        other = chainerkfac.estimator.LabelSampler(seed=123)
        other.source = stream_rng(7, MC_LABELS, j + 10)
        assert not np.array_equal(other.sample(
            np.zeros((200, 3))), again.sample(np.zeros((200, 3))))


def test_skip_flag_read_after_the_next_batch_is_ready(capsys, monkeypatch):
    """On the GPU the skip flag is on the device and reading it waits for
    the step. Without running mixup it is read before the next step, once
    the next batch has been converted (the host's work overlapping the
    device's); the message still names the skipped step."""
    np.random.seed(0)
    model = models.SoftLabelClassifier(models.SmallResNet(8, 4, 3))
    optimizer = chainerkfac.optimizers.GuardedOptimizer(
        chainer.optimizers.MomentumSGD(lr=0.1), 1, OneProcess())
    optimizer.setup(model)
    events = []

    class Recording(BatchConverter):
        poison = False

        def __call__(self, b, device):
            events.append('convert')
            x, t = super().__call__(b, device)
            if self.poison:
                x[:] = np.nan
            return x, t
    converter = Recording(None, labels_on_host=True)
    updater = AugmentedUpdater(
        Batches([batch(1), batch(2)], 16), optimizer, OneProcess(), 1, 100,
        converter, seed=0, alpha_mixup=0.0, n_class=3, erasing=False,
        device=chainer.get_device('@numpy'))
    flag = type(optimizer).last_step_skipped
    monkeypatch.setattr(type(optimizer), 'last_step_skipped', property(
        lambda self: events.append('read') or flag.fget(self)))
    update = type(optimizer).update
    monkeypatch.setattr(type(optimizer), 'update', lambda self, *a: (
        events.append('update'), update(self, *a))[1])
    converter.poison = True
    with reporting(model, {}):
        updater.update()                       # iteration 1: skipped
    assert events == ['convert', 'update']     # its flag not read yet
    assert 'update skipped' not in capsys.readouterr().err
    converter.poison = False
    with reporting(model, {}):
        updater.update()
    assert events == ['convert', 'update', 'convert', 'read', 'update']
    assert 'step at iteration 1: non-finite gradient, update skipped' in \
        capsys.readouterr().err


class EpochBatches(Batches):
    """Batches whose epochs end at every ``n / 4``-th batch, as the
    harness's iterator says (``is_new_epoch`` after the batch that ends
    one)."""

    @property
    def is_new_epoch(self):
        return self.position > 0 and self.position * 4 % self.n == 0


@pytest.mark.parametrize('acc_iters', [1, 2])
def test_a_step_decides_its_refreshes_at_the_epoch_it_starts_in(acc_iters):
    """eq. (23)-like intervals (every step in epoch 0, then rarely): the
    step whose micro-batches end epoch 0 refreshes, as its learning rate
    is that of the epoch it starts in. The updater called ``new_epoch``
    before that micro-batch's update, so without accumulation the step
    took epoch 1's interval and with it that of its last micro-batch: the
    stale schedule depended on how the global batch was split (1 process
    × 3 micro-batches refreshed at the boundary, 3 processes × 1 did
    not). Chainer's StandardUpdater calls it after the update."""
    np.random.seed(0)
    model = models.SoftLabelClassifier(models.SmallResNet(8, 4, 3))

    def interval(iteration, epoch):
        return 1 if epoch < 1 else 1000
    optimizer = chainerkfac.optimizers.KFAC(
        lr=0.01, acc_iters=acc_iters, verbose=False, kl_clip=None,
        refresh_interval_a=interval, refresh_interval_g=interval,
        refresh_interval_f=interval)
    optimizer.setup(model)
    # 16 samples an epoch: 4 micro-batches, 4 / acc_iters steps
    updater = plain_updater(optimizer, EpochBatches([batch(1), batch(2)], 16),
                            acc_iters)
    due, update = [], optimizer.update

    def recording(*args, **kwargs):
        if optimizer.pending_micro_batches == 0:
            due.append((optimizer.epoch, bool(optimizer.estimator.due)))
        return update(*args, **kwargs)
    optimizer.update = recording
    with reporting(model, {}):
        for _ in range(8):                       # two epochs
            updater.update()
    per_epoch = 4 // acc_iters
    assert due == [(0, True)] * per_epoch + [(1, False)] * per_epoch


def test_the_log_has_the_damping_and_intervals_a_step_took():
    """The harness's ``damping`` and ``refresh_interval_*`` observers read
    the optimizer after the step, where eq. (16) has moved the damping on
    and eqs. (22-23) are the next step's: the log's ``damping`` was the
    next step's (15 % above ``kfac/damping``, the one used, in a run of
    the 131K row)."""
    from harness import run
    np.random.seed(0)
    model = models.SoftLabelClassifier(models.SmallResNet(8, 4, 3))

    def interval(iteration, epoch):
        return 1 if iteration < 1 else 3
    optimizer = chainerkfac.optimizers.KFAC(
        lr=0.01, verbose=False, kl_clip=None, damping=0.1,
        damping_target=0.001, damping_warmup_steps=20,
        refresh_interval_a=interval, refresh_interval_g=interval,
        refresh_interval_f=interval)
    optimizer.setup(model)
    updater = plain_updater(optimizer, Batches([batch(1), batch(2)], 16))
    observers = [ext for ext, _ in run.observers(optimizer, 'kfac', 4)]
    trainer = types.SimpleNamespace(updater=updater, elapsed_time=1.0)
    for step in range(2):
        observation = {}
        with reporting(model, observation):
            updater.update()
            trainer.observation = {}
            for observer in observers:
                observer(trainer)
        assert trainer.observation['damping'] == observation['kfac/damping']
        assert optimizer.damping < trainer.observation['damping']
        assert trainer.observation['refresh_interval_A'] == interval(step, 0)

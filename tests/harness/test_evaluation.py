"""The harness's report extensions across a resume."""
import io

import numpy

import chainer
import chainer.links as L
from chainer import training

from harness import evaluation


def _trainer(out, stream, epochs):
    numpy.random.seed(0)
    x = numpy.random.RandomState(0).randn(8, 3).astype(numpy.float32)
    t = (numpy.arange(8) % 2).astype(numpy.int32)
    model = L.Classifier(L.Linear(3, 2))
    optimizer = chainer.optimizers.SGD(0.1).setup(model)
    data = chainer.datasets.TupleDataset(x, t)
    iterator = chainer.iterators.SerialIterator(data, 4, shuffle=False)
    updater = training.StandardUpdater(iterator, optimizer)
    trainer = training.Trainer(updater, (epochs, 'epoch'), out=str(out))
    trainer.extend(training.extensions.LogReport())
    report = evaluation.print_report(['epoch', 'main/loss'], False)
    report._out = evaluation.PlainText(stream)
    trainer.extend(report)
    return trainer


def _rows(text):
    return [line.split()[0] for line in text.splitlines()[1:] if line]


def test_a_resumed_run_prints_only_its_new_epochs(tmp_path):
    """Resumed at epoch 3 of 5, the run printed epochs 1-5 (Chainer's
    PrintReport does not keep what it printed); now 4 and 5, below the
    header. A snapshot without the count prints everything, as before."""
    first = io.StringIO()
    trainer = _trainer(tmp_path, first, 3)
    trainer.run()
    assert _rows(first.getvalue()) == ['1', '2', '3']
    path = str(tmp_path / 'snapshot.npz')
    chainer.serializers.save_npz(path, trainer)

    resumed = io.StringIO()
    trainer = _trainer(tmp_path, resumed, 5)
    chainer.serializers.load_npz(path, trainer, strict=False)
    trainer.run()
    assert resumed.getvalue().splitlines()[0].split() == ['epoch',
                                                          'main/loss']
    assert _rows(resumed.getvalue()) == ['4', '5']

    # an earlier version's snapshot: no count in it
    with numpy.load(path) as data:
        kept = {k: data[k] for k in data.files if not k.endswith('_log_len')}
    old = str(tmp_path / 'old.npz')
    numpy.savez(old, **kept)
    again = io.StringIO()
    trainer = _trainer(tmp_path, again, 5)
    chainer.serializers.load_npz(old, trainer, strict=False)
    trainer.run()
    assert _rows(again.getvalue()) == ['1', '2', '3', '4', '5']


def test_plain_progress_says_where_the_run_is_every_interval():
    """``--no-progress`` (the job scripts'): a ``progress:`` line at most
    every interval, with the pace measured since the run (or its resume)
    began; before, nothing came between the log's epoch rows."""
    import types
    clock = [100.0]
    out = io.StringIO()
    updater = types.SimpleNamespace(epoch_detail=0.5, iteration=10,
                                    steps=5)
    trainer = types.SimpleNamespace(updater=updater)
    progress = evaluation.PlainProgress(2, 64, interval=60.0, out=out,
                                        clock=lambda: clock[0])
    progress(trainer)                      # the first call starts the clock
    for seconds, epoch, iteration in ((30.0, 0.6, 20), (61.0, 0.8, 40)):
        clock[0] = 100.0 + seconds
        updater.epoch_detail, updater.iteration = epoch, iteration
        updater.steps = iteration // 2
        progress(trainer)
    # 0.3 epochs in 61 s: 1.2 epochs left take 244 s; 30 micro-batches of
    # 64 images in 61 s
    assert out.getvalue() == (
        'progress: epoch 0.800 of 2, step 20, micro-batch 40, '
        '{:.1f} images/s, 0:04:04 to go\n'.format(30 * 64 / 61.0))
    clock[0] = 150.0 + 61.0                # under a minute since the line
    progress(trainer)
    assert out.getvalue().count('\n') == 1
    assert evaluation._duration(float('inf')) == '?'
    assert evaluation._duration(3723.4) == '1:02:03'

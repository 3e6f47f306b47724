"""Background snapshots: a consistent copy taken at the call, written
whole or not at all, one write at a time, the last K kept; finding the
files of a snapshot written by any number of processes."""
import os
import time

import chainer
import chainer.links as L
import numpy as np
import pytest

from harness import snapshots


def test_writer_saves_the_arrays_as_they_were_at_the_call(tmp_path):
    live = np.arange(1000000, dtype=np.float32)
    writer = snapshots.AtomicThreadWriter()
    writer('snap', str(tmp_path), {'w': live})
    live += 1          # the training loop goes on updating in place
    writer.finalize()
    with np.load(str(tmp_path / 'snap')) as data:
        np.testing.assert_array_equal(data['w'], np.arange(1000000))
    assert writer.last_blocked_seconds < 5


def test_failed_write_leaves_no_file_and_is_raised(tmp_path):
    def failing(f, target):
        f.write(b'PK partial')
        raise OSError('disk full')
    writer = snapshots.AtomicThreadWriter(savefun=failing)
    writer('snap', str(tmp_path), {'w': np.zeros(3)})
    with pytest.raises(RuntimeError, match='disk full'):
        writer.finalize()
    assert os.listdir(str(tmp_path)) == []


def test_writes_never_overlap_and_never_show_half_a_file(tmp_path):
    spans, seen_partial = [], []

    def slow(f, target):
        start = time.perf_counter()
        f.write(b'x' * 10)
        time.sleep(0.3)
        seen_partial.append(os.path.exists(str(tmp_path / target['name'])))
        f.write(b'y')
        spans.append((start, time.perf_counter()))
    writer = snapshots.AtomicThreadWriter(savefun=slow)
    for name in ('a', 'b', 'c'):
        writer(name, str(tmp_path), {'name': name})
    writer.finalize()
    spans.sort()
    assert all(end <= next_start for (_, end), (next_start, _)
               in zip(spans, spans[1:]))
    assert seen_partial == [False, False, False]
    assert sorted(os.listdir(str(tmp_path))) == ['a', 'b', 'c']
    assert (tmp_path / 'c').read_bytes() == b'x' * 10 + b'y'


def test_extension_keeps_the_last_snapshots(tmp_path):
    model = L.Classifier(L.Linear(2, 2))
    optimizer = chainer.optimizers.SGD()
    optimizer.setup(model)
    data = [(np.ones(2, np.float32), np.int32(1))]
    updater = chainer.training.updaters.StandardUpdater(
        chainer.iterators.SerialIterator(data, 1), optimizer)
    trainer = chainer.training.Trainer(updater, (5, 'epoch'),
                                       out=str(tmp_path))
    trainer.extend(snapshots.snapshot_extension(rank=3, keep=2),
                   trigger=(1, 'epoch'))
    trainer.run()
    assert sorted(os.listdir(str(tmp_path))) == [
        'snapshot_epoch_4.rank3', 'snapshot_epoch_5.rank3']


def _fake_snapshot(path, n_processes):
    np.savez(path, **{snapshots.N_PROCESSES_KEY: np.asarray(n_processes)})
    os.rename(path + '.npz', path)


def test_snapshot_files_of_any_number_of_processes(tmp_path):
    for rank in range(3):
        _fake_snapshot(str(tmp_path / 'snapshot_epoch_4.rank{}'.format(
            rank)), 3)
    for rank in (0, 2):     # rank 1 was killed before its file was whole
        _fake_snapshot(str(tmp_path / 'snapshot_epoch_5.rank{}'.format(
            rank)), 3)
    prefix = str(tmp_path / 'snapshot_epoch_4')
    assert snapshots.snapshot_files(prefix) == [
        prefix + '.rank{}'.format(r) for r in range(3)]
    with pytest.raises(FileNotFoundError, match='rank.s. 1 are missing'):
        snapshots.snapshot_files(str(tmp_path / 'snapshot_epoch_5'))
    with pytest.raises(FileNotFoundError, match='no snapshot'):
        snapshots.snapshot_files(str(tmp_path / 'snapshot_epoch_9'))
    assert snapshots.latest_snapshot(str(tmp_path)) == prefix

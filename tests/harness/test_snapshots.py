"""Background snapshots: a consistent copy taken at the call, written
whole or not at all, one write at a time, the last K kept."""
import errno
import os
import shutil
import threading
import time
import types

import chainer
import chainer.links as L
import numpy as np
import pytest

from harness import snapshots
from tests.harness import OneProcess


def test_writer_saves_the_arrays_as_they_were_at_the_call(tmp_path):
    """The call returns while the file is being written (how long it
    blocks the loop is ``blocked_s`` of ``python -m benchmarks.snapshot``),
    and the file holds the arrays of the call, not the updated ones."""
    live = np.arange(1000000, dtype=np.float32)
    release = threading.Event()

    def held(f, target):
        release.wait(60)
        np.savez(f, **target)
    writer = snapshots.AtomicThreadWriter(savefun=held)
    writer('snap', str(tmp_path), {'w': live})
    assert writer.busy and not os.path.exists(str(tmp_path / 'snap'))
    live += 1          # the training loop goes on updating in place
    release.set()
    writer.finalize()
    assert writer.take_failure() is None
    with np.load(str(tmp_path / 'snap')) as data:
        np.testing.assert_array_equal(data['w'], np.arange(1000000))
    assert writer.last_blocked_seconds > 0


def test_failed_write_leaves_no_file_and_names_path_and_bytes(tmp_path):
    def failing(f, target):
        f.write(b'PK partial')
        raise OSError(errno.ENOSPC, 'No space left on device')
    writer = snapshots.AtomicThreadWriter(savefun=failing)
    writer('snap', str(tmp_path), {'w': np.zeros(1000)})
    writer.finalize()
    assert os.listdir(str(tmp_path)) == []
    failure = writer.take_failure()
    assert isinstance(failure, snapshots.SnapshotWriteError)
    message = str(failure)
    assert str(tmp_path / 'snap') in message
    assert 'No space left on device' in message
    assert 'needed 8,' in message and ' bytes' in message
    assert writer.take_failure() is None       # reported once


class HookedUpdater(chainer.training.updaters.StandardUpdater):
    """A StandardUpdater that calls ``before(iteration)`` (the number of
    iterations done) before each update: the tests decide when the writer
    thread's work happens, instead of relying on its timing."""

    def __init__(self, *args, before=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.before = before

    def update_core(self):
        if self.before is not None:
            self.before(self.iteration)
        super().update_core()


def trainer_with_snapshots(out, writer, epochs=6, before=None):
    """SGD on 40 one-sample iterations per epoch, a snapshot per epoch."""
    model = L.Classifier(L.Linear(2, 2))
    optimizer = chainer.optimizers.SGD()
    optimizer.setup(model)
    data = [(np.ones(2, np.float32), np.int32(1))] * 40
    updater = HookedUpdater(chainer.iterators.SerialIterator(data, 1),
                            optimizer, before=before)
    trainer = chainer.training.Trainer(updater, (epochs, 'epoch'), out=out)
    snapshots.extend_trainer(trainer, OneProcess, writer, rank=0, keep=2,
                             trigger=(1, 'epoch'))
    return trainer


def test_failed_background_write_stops_the_run_before_the_next_snapshot(
        tmp_path):
    """Not at the next snapshot, an epoch later (iteration 80, where the
    failure used to surface), but in the iteration in which the failed
    write is over, with the file and the bytes. The write of the epoch-1
    snapshot (iteration 40) is held until the 45th iteration, which waits
    for it to fail: the run must stop at that iteration's end, whatever
    the threads' timing."""
    release = threading.Event()

    def failing(f, target):
        assert release.wait(60)
        raise OSError(errno.ENOSPC, 'No space left on device')

    def before(done):
        if done == 44:
            release.set()
            writer.join()      # the write has failed before this update

    writer = snapshots.AtomicThreadWriter(savefun=failing)
    trainer = trainer_with_snapshots(str(tmp_path), writer, before=before)
    with pytest.raises(snapshots.SnapshotWriteError) as info:
        trainer.run()
    assert trainer.updater.iteration == 45
    assert 'snapshot_epoch_1.rank0' in str(info.value)
    assert 'No space left on device' in str(info.value)
    assert 'bytes' in str(info.value)
    assert [n for n in os.listdir(str(tmp_path)) if 'snapshot' in n] == []


def test_a_write_in_progress_does_not_stop_the_run(tmp_path):
    """While the write is held the run goes on (iterations 41-44 above);
    a write that then succeeds leaves the run to its end."""
    release = threading.Event()
    seen_busy = []

    def held(f, target):
        assert release.wait(60)
        np.savez(f, **target)

    def before(done):
        if 40 < done < 45:
            seen_busy.append(writer.busy)
        if done == 44:
            release.set()

    writer = snapshots.AtomicThreadWriter(savefun=held)
    trainer = trainer_with_snapshots(str(tmp_path), writer, epochs=2,
                                     before=before)
    trainer.run()
    snapshots.finish(OneProcess, writer)
    assert seen_busy == [True] * 4
    assert trainer.updater.iteration == 80
    assert sorted(n for n in os.listdir(str(tmp_path))
                  if 'snapshot' in n) == ['snapshot_epoch_1.rank0',
                                          'snapshot_epoch_2.rank0']


def test_snapshot_larger_than_the_free_space_stops_the_run_at_once(
        tmp_path, monkeypatch):
    """Known before writing: the run stops in the iteration of the
    snapshot, and nothing is written."""
    writer = snapshots.AtomicThreadWriter()
    trainer = trainer_with_snapshots(str(tmp_path), writer)
    free = shutil.disk_usage(str(tmp_path))._replace(free=1000)
    monkeypatch.setattr(snapshots.shutil, 'disk_usage', lambda path: free)
    with pytest.raises(snapshots.SnapshotWriteError) as info:
        trainer.run()
    assert trainer.updater.iteration == 40
    message = str(info.value)
    assert 'snapshot_epoch_1.rank0' in message
    assert '1,000 bytes are free' in message and 'it needs' in message
    assert os.listdir(str(tmp_path)) == []


def test_needed_bytes_are_the_file_size(tmp_path):
    target = {'updater/model:main/w': np.zeros((300, 70), np.float32),
              'updater/iteration': np.asarray(12),
              'updater/none': np.asarray(None)}
    path = str(tmp_path / 'snap')
    with open(path, 'wb') as f:
        np.savez(f, **target)
    size = os.path.getsize(path)
    assert size <= snapshots.npz_bytes(target) <= size * 1.05 + 1024


def test_the_last_write_is_waited_for_and_its_failure_raised(tmp_path):
    def failing(f, target):
        time.sleep(0.2)
        raise OSError(errno.EFBIG, 'File too large')
    writer = snapshots.AtomicThreadWriter(savefun=failing)
    writer('snapshot_epoch_3.rank0', str(tmp_path), {'w': np.zeros(3)})
    with pytest.raises(snapshots.SnapshotWriteError, match='File too large'):
        snapshots.finish(OneProcess, writer)
    snapshots.finish(OneProcess, writer)      # reported once


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
    writer = snapshots.AtomicThreadWriter()
    snapshots.extend_trainer(trainer, OneProcess, writer, rank=3, keep=2,
                             trigger=(1, 'epoch'))
    trainer.run()
    snapshots.finish(OneProcess, writer)
    assert sorted(os.listdir(str(tmp_path))) == [
        'snapshot_epoch_4.rank3', 'snapshot_epoch_5.rank3']


class TwoProcesses:
    """Rank 0 of two, the other's write state set by the test."""
    rank, size = 0, 2
    other = (False, False, 0)       # (busy, failed, files written whole)

    class mpi_comm:
        @staticmethod
        def allgather(value):
            if isinstance(value, tuple) and len(value) == 3:    # agree's
                return [value, TwoProcesses.other]
            return [value, (OSError, 'disk full') if TwoProcesses.other[1]
                    else None]                          # raise_together's


@pytest.mark.parametrize('keep', [1, 2])
def test_older_snapshots_go_only_once_every_process_wrote_the_new(
        tmp_path, keep):
    """Each process removed its older snapshots as soon as its own new
    file was whole: with another process's write of the same step slow,
    then failed (disk full) or killed, no step was whole on every process
    (an auditor's run: rank 0 held steps 3 and 4, rank 1 steps 1 and 2,
    and --resume latest found nothing). Now the newest ``keep`` that every
    process has written stay, with any newer one still being confirmed —
    also when a new write is always in progress (a snapshot every step:
    the first version of this fix removed nothing then, 22 files where 2
    were kept)."""
    out = str(tmp_path)
    for step in (1, 2):
        path = tmp_path / 'snapshot_step_{}.rank0'.format(step)
        path.write_bytes(b'x')
        os.utime(str(path), (step, step))          # a resumed run's, older
    writer = snapshots.AtomicThreadWriter()
    extension = snapshots.snapshot_extension(0, keep, writer,
                                             snapshots.SNAPSHOT_PREFIX.format(
                                                 step='{.step}'))
    extension.initialize(types.SimpleNamespace(out=out, updater=None))
    extension._target = L.Linear(2, 2)

    def snapshot(step, other):
        extension._make_snapshot(types.SimpleNamespace(out=out, step=step,
                                                       updater=None))
        writer.join()                       # this process's write is whole
        TwoProcesses.other = other
        snapshots.agree(TwoProcesses, writer)
        return sorted(int(n.split('_')[2].split('.')[0])
                      for n in os.listdir(out))

    # the other's step 3 still being written: nothing goes
    assert snapshot(3, (True, False, 0)) == [1, 2, 3]
    assert writer.unconfirmed
    # step 4 begun everywhere, the other's step 3 whole: 3 is confirmed
    assert snapshot(4, (True, False, 1)) == ([3, 4] if keep == 1
                                             else [2, 3, 4])
    # and step 4 whole everywhere
    TwoProcesses.other = (False, False, 2)
    snapshots.agree(TwoProcesses, writer)
    assert not writer.unconfirmed
    assert sorted(os.listdir(out)) == [
        'snapshot_step_{}.rank0'.format(s) for s in ([4] if keep == 1
                                                     else [3, 4])]
    # the other's write of step 5 fails: nothing older goes
    extension._make_snapshot(types.SimpleNamespace(out=out, step=5,
                                                   updater=None))
    writer.join()
    before = sorted(os.listdir(out))
    TwoProcesses.other = (False, True, 2)
    with pytest.raises(OSError, match='rank 1: disk full'):
        snapshots.agree(TwoProcesses, writer)
    assert sorted(os.listdir(out)) == before

"""Finding the snapshot to resume from: the files of a snapshot written by
any number of processes, each read whole before it is trusted; ``latest``
skips an incomplete or damaged snapshot naming the file and the cause."""
import os
import shutil

import numpy as np
import pytest

from harness import resume, snapshot_integrity, snapshots
from tests.harness.damage import flip, truncate


def write_snapshot(path, n_processes, seed=0):
    """A snapshot-like npz: the number of processes and some arrays."""
    rng = np.random.RandomState(seed)
    arrays = {snapshots.N_PROCESSES_KEY: np.asarray(n_processes),
              'updater/model:main/predictor/fc/W':
                  rng.rand(64, 256).astype(np.float32),
              'updater/model:main/predictor/fc/b': np.zeros(64, np.float32)}
    with open(path, 'wb') as f:
        np.savez(f, **arrays)


def snapshot_set(directory, step, n_processes, ranks=None):
    prefix = os.path.join(str(directory), 'snapshot_step_{}'.format(step))
    for rank in range(n_processes) if ranks is None else ranks:
        write_snapshot('{}.rank{}'.format(prefix, rank), n_processes, rank)
    return prefix


def test_snapshot_files_of_any_number_of_processes(tmp_path):
    prefix = snapshot_set(tmp_path, 4, 3)
    # Rank 1 was killed before its file of step 5 was whole.
    snapshot_set(tmp_path, 5, 3, ranks=(0, 2))
    assert resume.snapshot_files(prefix) == [
        prefix + '.rank{}'.format(r) for r in range(3)]
    with pytest.raises(FileNotFoundError, match='rank.s. 1 are missing'):
        resume.snapshot_files(str(tmp_path / 'snapshot_step_5'))
    with pytest.raises(FileNotFoundError, match='no snapshot'):
        resume.snapshot_files(str(tmp_path / 'snapshot_step_9'))
    warnings = []
    assert resume.latest_snapshot(str(tmp_path), say=warnings.append) == (
        prefix, resume.snapshot_files(prefix))
    [warning] = warnings
    assert 'skipping snapshot_step_5' in warning
    assert 'rank(s) 1 are missing' in warning


@pytest.mark.parametrize('damage, cause', [
    (truncate, 'not a zip file'), (flip, 'Bad CRC-32 for file')])
def test_damaged_file_named_with_its_cause(tmp_path, damage, cause):
    path = str(tmp_path / 'snapshot_step_1.rank0')
    write_snapshot(path, 1)
    snapshot_integrity.verify_file(path)
    damage(path)
    with pytest.raises(snapshot_integrity.DamagedSnapshotError) as info:
        snapshot_integrity.verify_file(path)
    assert info.value.path == path
    assert cause in info.value.cause
    assert path in str(info.value) and cause in str(info.value)


def test_member_shorter_than_its_header_is_damage(tmp_path):
    """An .npy member whose data does not match its header (CRC intact:
    written so) is refused too."""
    import zipfile
    path = str(tmp_path / 'snapshot_step_1.rank0')
    header = tmp_path / 'x.npy'
    np.save(str(header), np.zeros(100, np.float32))
    with zipfile.ZipFile(path, 'w') as archive:
        archive.writestr('x.npy', header.read_bytes()[:-40])
    with pytest.raises(snapshot_integrity.DamagedSnapshotError,
                       match='header says'):
        snapshot_integrity.verify_file(path)


@pytest.mark.parametrize('damage', [truncate, flip])
@pytest.mark.parametrize('rank', [0, 1])
def test_latest_skips_a_damaged_snapshot_naming_the_file(tmp_path, damage,
                                                         rank):
    """Any rank's file: the lowest one (read for the number of processes)
    or another."""
    older = snapshot_set(tmp_path, 2, 2)
    newer = snapshot_set(tmp_path, 3, 2)
    damage('{}.rank{}'.format(newer, rank))
    warnings = []
    prefix, files = resume.latest_snapshot(str(tmp_path),
                                           say=warnings.append)
    assert prefix == older and files == resume.snapshot_files(older)
    [warning] = warnings
    assert 'snapshot_step_3.rank{}'.format(rank) in warning
    assert 'damaged' in warning


def test_a_non_finite_weight_or_state_is_damage_and_latest_skips_it(
        tmp_path):
    """A whole file (CRC intact) whose model or optimizer holds inf or
    NaN: the harness never writes one (a non-finite step is skipped), and
    loaded it gave one rank NaN weights, every later step skipped, and an
    exit status of 0. Elsewhere in a snapshot (an extension's own value)
    it is not looked at."""
    older = snapshot_set(tmp_path, 2, 2)
    newer = snapshot_set(tmp_path, 3, 2)
    path = newer + '.rank1'
    with np.load(path) as saved:
        arrays = {k: saved[k] for k in saved.files}
    arrays['extensions/best/value'] = np.array(np.inf)
    with open(path, 'wb') as f:
        np.savez(f, **arrays)
    snapshot_integrity.verify_file(path)
    velocity = np.ones((64, 256), np.float32)
    velocity[3, 5] = np.inf
    arrays['updater/optimizer:main/predictor/fc/W/v'] = velocity
    with open(path, 'wb') as f:
        np.savez(f, **arrays)
    with pytest.raises(snapshot_integrity.DamagedSnapshotError,
                       match=r'updater/optimizer:main/predictor/fc/W/v holds '
                       r'1 non-finite values of 16384'):
        snapshot_integrity.verify_file(path)
    warnings = []
    assert resume.latest_snapshot(str(tmp_path), say=warnings.append) == (
        older, resume.snapshot_files(older))
    assert 'snapshot_step_3.rank1' in warnings[0]


def test_no_whole_snapshot_is_none(tmp_path):
    prefix = snapshot_set(tmp_path, 1, 1)
    flip(prefix + '.rank0')
    assert resume.latest_snapshot(str(tmp_path), say=None) is None
    shutil.rmtree(str(tmp_path))
    assert resume.latest_snapshot(str(tmp_path), say=None) is None


def test_damage_error_survives_pickling():
    """Errors travel between processes (mpi4py pickles them)."""
    import pickle
    error = snapshot_integrity.DamagedSnapshotError(
        '/x/snapshot_step_1.rank0', 'why')
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.path, copy.cause, str(copy)) == (error.path, error.cause,
                                                  str(error))


@pytest.mark.parametrize('chunks, epochs, refused', [
    # 48 images, chunks of 16, 2 chunks a step: 0.667 epoch a step
    (10, 3, False),     # 5 steps, 3.333: the run's own end past epoch 3
    (10, 1, True),      # the run had ended at 1.333 (2 steps)
    (8, 3, False),      # 4 steps, 2.667: mid-run
    (8, 2, True),       # the step before (2.0) had reached 2
    (6, 2, False),      # its end at 2.0 exactly
])
def test_a_resume_past_the_runs_end_is_refused(chunks, epochs, refused):
    """A run ends at the first step boundary at or past its epochs (its
    last step may straddle them: a snapshot there resumes and finishes);
    one further on is refused naming both."""
    import types
    import augment
    from config import ConfigError
    from harness import run
    iterator = types.SimpleNamespace(
        chunks=chunks, chunks_per_step=2, batch_size=16, n_examples=48,
        epoch_detail=augment.epochs_at(chunks, 16, 48))
    if not refused:
        run.check_resumed_epochs(iterator, epochs)
        return
    with pytest.raises(ConfigError, match=r"key 'epochs': the snapshot "
                       r"resumed is at epoch {:.4f}, past the run's end at "
                       r'epoch {}'.format(chunks / 3, epochs)):
        run.check_resumed_epochs(iterator, epochs)


def test_a_file_that_does_not_fit_the_optimizer_is_named(tmp_path):
    """A K-FAC file with one factor removed (loaded leniently, as a
    snapshot's files are): ``AttributeError: 'NoneType' object has no
    attribute 'ndim'`` from inside K-FAC, naming neither file nor key."""
    import chainer
    from tests.chainerkfac import helpers
    model = helpers.MLP()
    optimizer = helpers.kfac().setup(model)
    x, t = helpers.data(n=8, shape=(5,), n_class=3)
    optimizer.update(helpers.loss_of(model), x, t)
    path = str(tmp_path / 'snapshot_step_1.rank0')
    chainer.serializers.save_npz(path, optimizer)
    with np.load(path) as saved:
        arrays = {k: saved[k] for k in saved.files if k != 'kfac/l1/G'}
    with open(path, 'wb') as f:
        np.savez(f, **arrays)
    again = helpers.kfac().setup(helpers.MLP())
    again.update(helpers.loss_of(again.target), x, t)
    with pytest.raises(ValueError, match=r"snapshot file .*snapshot_step_1"
                       r"\.rank0 does not fit this run's model and "
                       r"optimizer: AttributeError"):
        resume._load(path, again)


def test_the_files_of_a_snapshot_must_be_one_runs(tmp_path):
    """Another run's file under rank 1's name, or two ranks' files
    swapped, were loaded silently (final weights 0.90 and 0.85 from the
    uninterrupted run's). Each file now records its run and rank; files
    of an earlier version, which record neither, pass."""
    from tests.harness import OneProcess

    def write(path, ident, rank):
        arrays = {snapshots.N_PROCESSES_KEY: np.asarray(2)}
        if ident is not None:
            arrays[resume.RUN_ID_KEY] = np.asarray(ident)
            arrays[resume.RANK_KEY] = np.asarray(rank)
        with open(path, 'wb') as f:
            np.savez(f, **arrays)

    prefix = str(tmp_path / 'snapshot_step_4')
    files = [prefix + '.rank0', prefix + '.rank1']
    for ident in (None, 'a' * 32):
        for rank, path in enumerate(files):
            write(path, ident, rank)
        resume.check_one_run(OneProcess, prefix, files)
    # one file of the earlier version, one of this (a run upgraded while
    # its ranks wrote one snapshot): unknown is not another run
    write(files[0], None, 0)
    resume.check_one_run(OneProcess, prefix, files)
    write(files[0], 'a' * 32, 0)
    write(files[1], 'b' * 32, 1)
    with pytest.raises(ValueError, match=r"not one run's snapshot: its files "
                       r"come from 2 runs \(snapshot_step_4\.rank0 of run "
                       r"a{32}; snapshot_step_4\.rank1 of run b{32}\)"):
        resume.check_one_run(OneProcess, prefix, files)
    write(files[0], 'a' * 32, 1)
    write(files[1], 'a' * 32, 0)
    with pytest.raises(ValueError, match=r'snapshot_step_4\.rank0 was '
                       r'written by rank 1, but its name says rank 0'):
        resume.check_one_run(OneProcess, prefix, files)


def test_a_resumed_run_keeps_its_id(tmp_path, monkeypatch):
    """A resume writes its snapshots under the resumed snapshot's id; a
    new run (or a snapshot of an earlier version) gets a new one."""
    from tests.harness import OneProcess
    monkeypatch.setattr(OneProcess.mpi_comm, 'bcast',
                        staticmethod(lambda value, root=0: value),
                        raising=False)
    first = resume.run_id(OneProcess)
    assert len(first) == 32 and resume.run_id(OneProcess) != first
    path = str(tmp_path / 'snapshot_step_1.rank0')
    with open(path, 'wb') as f:
        np.savez(f, **{resume.RUN_ID_KEY: np.asarray(first)})
    assert resume.run_id(OneProcess, ('snapshot_step_1', [path])) == first
    write_snapshot(path, 1)                  # no id: an earlier version's
    assert resume.run_id(OneProcess, ('snapshot_step_1', [path])) != first

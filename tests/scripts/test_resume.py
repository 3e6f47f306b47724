"""Resume: SIGKILL a run, ``--resume latest``, and the run continues the
uninterrupted one bit for bit (1 and 2 processes, augmentation on, epochs
ending inside optimizer steps); resume on another number of processes and
it continues to the tolerance of the distributed-equivalence tests."""
import json
import os
import re
import shutil
import time

import numpy
import pytest

from tests.harness.damage import flip
from tests.scripts import imagenet_like
from tests.scripts.conftest import (command, kill, read_log,
                                    reference_command, reference_config, run,
                                    start, weights)

#: Values of the log that depend on the machine's speed.
TIMING = ('elapsed_time', 'images_per_sec')
#: Log values every number of processes must agree on: the validation
#: values depend on BatchNormalization's running statistics, which are
#: per-process averages over each process's micro-batches (averaged over
#: processes at each epoch's end, as in ChainerMN).
GLOBAL_KEYS = ('epoch', 'main/loss', 'main/accuracy', 'lr', 'momentum',
               'damping', 'refresh_interval_A')
#: Float32 wire tolerance of tests/chainerkfac/multi_node/test_equivalence.
TOLERANCE = 1e-4


def snapshot_complete(out, step, nproc):
    return all(os.path.exists(os.path.join(
        str(out), 'snapshot_step_{}.rank{}'.format(step, r)))
        for r in range(nproc))


def max_relative_diff(a, b, skip_statistics=False):
    worst = 0.0
    assert set(a) == set(b)
    for name in a:
        if skip_statistics and name.rsplit('/', 1)[-1] in (
                'avg_mean', 'avg_var', 'N'):
            continue
        scale = max(float(numpy.abs(b[name]).max()), 1e-30)
        worst = max(worst, float(numpy.abs(a[name] - b[name]).max()) / scale)
    return worst


@pytest.mark.slow
@pytest.mark.parametrize('nproc', [1, 2])
def test_killed_run_resumes_bit_for_bit(dataset, references, tmp_path,
                                        nproc):
    process = start(reference_command(dataset, tmp_path), nproc)
    deadline = time.time() + 240
    while not snapshot_complete(tmp_path, 2, nproc):   # epoch 1
        assert process.poll() is None, 'the run ended before its snapshot'
        assert time.time() < deadline, 'no snapshot after 240 s'
        time.sleep(0.05)
    time.sleep(numpy.random.RandomState(nproc).uniform(0, 0.5))
    kill(process)
    locked = os.path.exists(str(tmp_path / 'run.lock'))
    result = run(reference_command(dataset, tmp_path, '--resume', 'latest'),
                 nproc)
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'resumed from' in result.stdout
    # The killed run's lock (unless it had ended) is taken over.
    assert ('taking over the stale lock' in result.stdout) == locked
    reference = references[nproc]
    expected, got = read_log(reference), read_log(tmp_path)
    assert len(got) == len(expected) == 3
    for want, have in zip(expected, got):
        for key in set(want) | set(have):
            if key not in TIMING:
                assert have.get(key) == want.get(key), (key, want, have)
    assert max_relative_diff(
        weights(os.path.join(str(tmp_path), 'model_final.npz')),
        weights(os.path.join(reference, 'model_final.npz'))) == 0
    with open(os.path.join(reference, 'fisher_diff.jsonl')) as f:
        want_diff = f.read()
    with open(os.path.join(str(tmp_path), 'fisher_diff.jsonl')) as f:
        assert f.read() == want_diff


@pytest.mark.slow
def test_one_and_two_processes_train_alike(references):
    """The global stream makes the two reference runs the same run."""
    one, two = read_log(references[1]), read_log(references[2])
    for a, b in zip(one, two):
        for key in GLOBAL_KEYS:
            assert a[key] == pytest.approx(b[key], rel=TOLERANCE), key
    assert max_relative_diff(
        weights(os.path.join(references[1], 'model_final.npz')),
        weights(os.path.join(references[2], 'model_final.npz')),
        skip_statistics=True) < TOLERANCE


def runs_on_44_images(dataset, tmp_path, processes, *extra, **config):
    """``{nproc: out}``: the run of the first 44 images of the data set
    (chunks of 4) with ``config``, on each number of ``processes``."""
    with open(dataset['train']) as f:
        lines = f.readlines()[:44]
    train = os.path.join(dataset['root'], 'train44.txt')
    with open(train, 'w') as f:
        f.writelines(lines)
    config = imagenet_like.write_config(
        dataset['root'], 'bs{global_batch_size}.json'.format(**config),
        batch_size_per_process=4, **config)
    runs = {}
    for nproc in processes:
        out = tmp_path / str(nproc)
        result = run(command(dataset, out, *extra, train=train,
                             config=config), nproc)
        assert result.returncode == 0, result.stdout[-3000:]
        runs[nproc] = out
    return runs


@pytest.mark.parametrize('optimizer', ['kfac', 'sgd'])
def test_a_run_ending_inside_a_micro_iteration_ends_as_on_one_process(
        dataset, tmp_path, optimizer):
    """44 images in chunks of 4: 11 chunks, so on 2 processes the last
    micro-iteration holds chunk 10 and, past the end, 11. Rank 1 takes no
    micro-batch there (it took chunk 11, the next epoch's first, and the
    K-FAC run's final weights differed from one process's by up to 0.57
    of an array's largest value): the last step averages rank 0's alone,
    as one process does (its step of 1 micro-batch of 2)."""
    runs = runs_on_44_images(dataset, tmp_path, (1, 2), '--optimizer',
                             optimizer, global_batch_size=8, epochs=1)
    # the training loss and accuracy over the same 11 micro-batches (each
    # process's mean weighed by its micro-batches), and the optimizer's
    # values of the same steps (the final partial one included)
    keys = GLOBAL_KEYS if optimizer == 'kfac' else ('epoch', 'main/loss',
                                                    'main/accuracy', 'lr')
    for want, have in zip(read_log(runs[1]), read_log(runs[2])):
        for key in keys:
            assert have[key] == pytest.approx(want[key], rel=TOLERANCE), key
    assert max_relative_diff(
        weights(str(runs[2] / 'model_final.npz')),
        weights(str(runs[1] / 'model_final.npz')),
        skip_statistics=True) < TOLERANCE


@pytest.mark.slow
def test_an_epoch_ending_inside_a_micro_iteration_is_logged_as_on_one_process(
        dataset, tmp_path):
    """44 images in chunks of 4, 6 chunks a step: epoch 1 ends at chunk
    11, inside step 2. On 3 processes the micro-iteration holding chunk 11
    also takes chunk 12 and ends step 2; on one it does not. The epoch's
    entry (and evaluation) came at that micro-iteration: step 2's learning
    rate, damping and the loss of chunk 12 were in epoch 1's entry on 3
    processes and in epoch 2's on one (lr 0.0192 against 0.02). Both now
    log at the end of the step in which the epoch ended."""
    runs = runs_on_44_images(dataset, tmp_path, (1, 3),
                             global_batch_size=24, epochs=2)
    logs = {nproc: read_log(out) for nproc, out in runs.items()}
    assert [e['epoch'] for e in logs[1]] == [1, 2]
    for want, have in zip(logs[1], logs[3]):
        for key in GLOBAL_KEYS:
            assert have[key] == pytest.approx(want[key], rel=TOLERANCE), key


@pytest.mark.slow
@pytest.mark.parametrize('before, after', [(2, 1), (1, 2)])
def test_resume_on_another_number_of_processes(dataset, references,
                                               tmp_path, before, after):
    """Epoch 2's snapshot (after step 3) lies on a step boundary after
    which the input factor A is stale (refreshed every 2nd step): the
    continued run needs the restored factors, re-sharded for the new
    processes."""
    prefix = os.path.join(references[before], 'snapshot_step_3')
    result = run(reference_command(dataset, tmp_path, '--resume', prefix),
                 after)
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'on {} process(es)'.format(after) in result.stdout
    expected, got = read_log(references[before]), read_log(tmp_path)
    assert [e['epoch'] for e in got] == [1, 2, 3]
    for want, have in zip(expected, got):
        for key in GLOBAL_KEYS:
            assert have[key] == pytest.approx(want[key], rel=TOLERANCE), key
    assert max_relative_diff(
        weights(os.path.join(str(tmp_path), 'model_final.npz')),
        weights(os.path.join(references[before], 'model_final.npz')),
        skip_statistics=True) < TOLERANCE


@pytest.mark.slow
def test_resume_from_three_processes_on_two(dataset, tmp_path):
    """Global batch 48: 3 processes x 2 accumulated, then 2 x 3. Epoch 1's
    snapshot follows step 0; step 1 reuses the stale A factors, which the
    two processes own under another assignment than the three did."""
    config = imagenet_like.write_config(
        dataset['root'], 'bs48.json', global_batch_size=48, epochs=3)
    three = tmp_path / 'three'
    result = run(command(dataset, three, '--keep-snapshots', '0',
                         config=config), 3)
    assert result.returncode == 0, result.stdout[-3000:]
    two = tmp_path / 'two'
    result = run(command(dataset, two, '--resume',
                         str(three / 'snapshot_step_1'), config=config), 2)
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'resumed from' in result.stdout and 'on 2 process(es)' in \
        result.stdout
    for want, have in zip(read_log(three), read_log(two)):
        for key in GLOBAL_KEYS:
            assert have[key] == pytest.approx(want[key], rel=TOLERANCE), key
    assert max_relative_diff(
        weights(str(two / 'model_final.npz')),
        weights(str(three / 'model_final.npz')),
        skip_statistics=True) < TOLERANCE


@pytest.mark.slow
def test_elastic_resume_with_the_monte_carlo_fisher(dataset, tmp_path):
    """fisher 'mc': the labels of chunk j are drawn from (seed, j) of the
    data stream, so 2 processes resumed on 1 continue the uninterrupted
    run (the sampler was seeded with seed + rank: 0.14 apart after one
    epoch, issue 20 item 4)."""
    config = imagenet_like.write_config(
        dataset['root'], 'mc.json', fisher='mc', global_batch_size=32,
        epochs=3)
    two = tmp_path / 'two'
    result = run(command(dataset, two, '--keep-snapshots', '0',
                         config=config), 2)
    assert result.returncode == 0, result.stdout[-3000:]
    one = tmp_path / 'one'
    result = run(command(dataset, one, '--resume',
                         str(two / 'snapshot_step_3'), config=config), 1)
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'on 1 process(es)' in result.stdout
    assert max_relative_diff(
        weights(str(one / 'model_final.npz')),
        weights(str(two / 'model_final.npz')),
        skip_statistics=True) < TOLERANCE


@pytest.mark.slow
def test_damaged_newest_snapshot_falls_back_to_the_one_before(
        dataset, references, tmp_path):
    """Rank 1's file of the newest snapshot has 64 flipped bytes: named
    with the cause when asked for explicitly (and nothing is written);
    ``latest`` says so and continues from the snapshot before, as the
    uninterrupted run did, bit for bit."""
    reference = references[2]
    for name in os.listdir(reference):
        if name.startswith('snapshot_step_'):
            shutil.copy(os.path.join(reference, name), str(tmp_path))
    before = sorted(os.listdir(str(tmp_path)))
    damaged = str(tmp_path / 'snapshot_step_5.rank1')
    flip(damaged)
    result = run(reference_command(dataset, tmp_path, '--resume',
                                   str(tmp_path / 'snapshot_step_5')), 2)
    assert result.returncode != 0
    assert damaged in result.stdout and 'Bad CRC-32' in result.stdout
    assert sorted(os.listdir(str(tmp_path))) == before

    result = run(reference_command(dataset, tmp_path, '--resume', 'latest'),
                 2)
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'skipping snapshot_step_5' in result.stdout
    assert damaged in result.stdout
    assert 'resumed from {}'.format(tmp_path / 'snapshot_step_3') in \
        result.stdout
    assert max_relative_diff(
        weights(os.path.join(str(tmp_path), 'model_final.npz')),
        weights(os.path.join(reference, 'model_final.npz'))) == 0
    # The continued run wrote epoch 3 again, whole.
    from harness import snapshot_integrity
    snapshot_integrity.verify_file(damaged)


def copy_run(source, destination):
    """The run directory ``source`` as a killed run would leave it."""
    for name in os.listdir(source):
        if name != 'model_final.npz':
            shutil.copy(os.path.join(source, name), str(destination))
    return {name: open(os.path.join(str(destination), name), 'rb').read()
            for name in sorted(os.listdir(str(destination)))}


@pytest.mark.slow
@pytest.mark.parametrize('change, named', [
    (('--width', '4'), ('predictor/conv1/W', 'snapshot (8, 3, 3, 3)',
                        'this run (4, 3, 3, 3)')),
    (('--n-class', '5'), ('predictor/fc/W', 'snapshot (4, 32)',
                          'this run (5, 32)')),
    (('--optimizer', 'sgd'), ('K-FAC optimizer (--optimizer kfac)',
                              'this run is --optimizer sgd',
                              '--init-weights-from')),
    # past the run's end: it "finished" at once, the final weights those
    # of the snapshot, the run's log trimmed and config.json rewritten
    (('--epochs', '1'), ("key 'epochs'", 'the snapshot resumed is at '
                         'epoch 3.3333', "past the run's end at epoch 1",
                         '--epochs on the command line')),
])
def test_snapshot_of_another_model_or_optimizer_refused_untouched(
        dataset, references, tmp_path, change, named):
    """Refused before anything of the run directory is written (its
    config.json, log, mean.npy, ... are those of the run it holds)."""
    before = copy_run(references[1], tmp_path)
    result = run(reference_command(dataset, tmp_path, '--resume', 'latest',
                                   *change))
    assert result.returncode != 0
    if change[0] != '--epochs':     # refused before the snapshot is read
        assert 'snapshot_step_5.rank0' in result.stdout
    for text in named:
        assert text in result.stdout
    after = {name: open(os.path.join(str(tmp_path), name), 'rb').read()
             for name in sorted(os.listdir(str(tmp_path)))}
    assert after == before


@pytest.mark.slow
def test_a_relabelled_list_is_refused_untouched(dataset, references,
                                               tmp_path):
    """A list of the same length with one label changed would resume the
    stream's position on other data: refused, the run directory as it
    was."""
    before = copy_run(references[1], tmp_path)
    lines = open(dataset['train']).read().splitlines()
    path, label = lines[3].split()
    lines[3] = '{} {}'.format(path,
                              (int(label) + 1) % imagenet_like.N_CLASS)
    relabelled = os.path.join(dataset['root'], 'train_relabelled.txt')
    with open(relabelled, 'w') as f:
        f.write('\n'.join(lines) + '\n')
    result = run(command(dataset, tmp_path, '--keep-snapshots', '0',
                         '--fisher-diff', '--resume', 'latest',
                         train=relabelled, config=reference_config(dataset)))
    assert result.returncode != 0
    assert "has the snapshot's {} images, but the labels differ".format(
        len(lines)) in result.stdout, result.stdout[-3000:]
    assert 'train_relabelled.txt' in result.stdout
    after = {name: open(os.path.join(str(tmp_path), name), 'rb').read()
             for name in sorted(os.listdir(str(tmp_path)))}
    assert after == before


@pytest.mark.slow
def test_resuming_an_older_snapshot_sets_the_later_run_aside(
        dataset, references, tmp_path):
    """A finished run (snapshots of steps 2, 3 and 5, model_final.npz)
    resumed on purpose from step 3: what it left past step 3 is moved
    aside, so that the next --resume latest continues this run (it went
    back to step 5 of the old one, and a requeued job ended at once)."""
    for name in os.listdir(references[1]):
        shutil.copy(os.path.join(references[1], name), str(tmp_path))
    result = run(reference_command(dataset, tmp_path, '--resume',
                                   str(tmp_path / 'snapshot_step_3')))
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'held files of a run that went past the snapshot resumed (step ' \
        '3): model_final.npz, snapshot_step_5.rank0 moved to {}'.format(
            tmp_path / 'superseded_') in result.stdout
    [aside] = [n for n in os.listdir(str(tmp_path))
               if n.startswith('superseded_')]
    assert sorted(os.listdir(str(tmp_path / aside))) == [
        'config.json', 'fisher_diff.jsonl', 'log', 'model_final.npz',
        'snapshot_step_5.rank0']
    # the replaced run's record, whole (the continued run trimmed its own)
    assert read_log(str(tmp_path / aside)) == read_log(references[1])
    # the continued run wrote its own, the same run (seeded) as the first
    assert max_relative_diff(
        weights(os.path.join(str(tmp_path), 'model_final.npz')),
        weights(os.path.join(references[1], 'model_final.npz'))) == 0


@pytest.mark.slow
def test_a_resume_says_what_it_changes(dataset, references, tmp_path):
    """A longer run resumed from a snapshot: the change printed, then
    recorded in config.json."""
    copy_run(references[1], tmp_path)
    result = run(reference_command(dataset, tmp_path, '--resume', 'latest',
                                   '--epochs', '4'))
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'resuming with settings other than those of {}:\n  epochs: 3 → 4'\
        .format(tmp_path / 'config.json') in result.stdout
    with open(str(tmp_path / 'config.json')) as f:
        assert json.load(f)['epochs'] == 4
    assert [e['epoch'] for e in read_log(tmp_path)] == [1, 2, 3, 4]
    # into another --out: against the run's own record, beside its snapshot
    other = tmp_path / 'other'
    result = run(reference_command(
        dataset, other, '--resume',
        os.path.join(references[1], 'snapshot_step_3'), '--epochs', '4',
        '--seed', '5'))
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'resuming with settings other than those of {}:\n  epochs: ' \
        '3 → 4'.format(os.path.join(references[1], 'config.json')) in \
        result.stdout
    # the data stream's seed, recorded since 2026-11-27 (fifth session)
    assert re.search(r'\n  run\.stream\.seed: \d+ → 5\n', result.stdout), \
        result.stdout[-3000:]


@pytest.mark.slow
def test_new_optimizer_from_a_snapshots_weights(dataset, references,
                                                tmp_path):
    """--init-weights-from: SGD from K-FAC's epoch-2 weights, a new run
    (epoch 1 on, no K-FAC state); at a negligible learning rate its final
    weights are the snapshot's."""
    prefix = os.path.join(references[1], 'snapshot_step_3')
    result = run(command(dataset, tmp_path, '--optimizer', 'sgd',
                         '--epochs', '1', '--baseline-lr', '1e-12',
                         '--weight-decay', '0', '--warmup-epochs', '0',
                         '--init-weights-from',
                         prefix))
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'initial weights from {}.rank0'.format(prefix) in result.stdout
    assert [e['epoch'] for e in read_log(tmp_path)] == [1]
    final = weights(os.path.join(str(tmp_path), 'model_final.npz'))
    with numpy.load(prefix + '.rank0') as snapshot:
        for name, value in final.items():
            if name.rsplit('/', 1)[-1] in ('avg_mean', 'avg_var', 'N'):
                continue
            numpy.testing.assert_allclose(
                value, snapshot['updater/model:main/predictor/' + name],
                rtol=1e-6, atol=1e-9, err_msg=name)
    with numpy.load(os.path.join(str(tmp_path),
                                 'snapshot_step_3.rank0')) as snapshot:
        assert str(snapshot['run/optimizer']) == 'sgd'
        assert not [k for k in snapshot.files if '/kfac/' in k]

"""End-to-end runs of train_imagenet.py on a tiny generated list data set:
one process and two (mpiexec), kill-and-resume, and bad input."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy
import pytest

from tests import launch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, 'train_imagenet.py')

TINY_CONFIG = {
    'global_batch_size': 16, 'epochs': 2, 'alpha_mixup': 0.4,
    'damping': 0.025, 'damping_target': 0.00025, 'rho_bn': 16.0,
    'damping_warmup_steps': 5, 'p_decay': 3.0, 'e_start': 0.5,
    'e_end': 3.0, 'lr': 0.02, 'momentum': 0.9, 'batch_size_per_process': 8,
    'refresh_interval_a': 2,
}


@pytest.fixture(scope='module')
def dataset(tmp_path_factory):
    from PIL import Image
    root = tmp_path_factory.mktemp('images')
    rng = numpy.random.RandomState(0)
    for split, n in (('train', 48), ('val', 16)):
        lines = []
        for i in range(n):
            label = i % 4
            pixels = (rng.rand(20, 20, 3) * 60 + label * 50).astype(
                numpy.uint8)
            rel = '{}/{}.png'.format(split, i)
            os.makedirs(os.path.join(root, split), exist_ok=True)
            Image.fromarray(pixels).save(os.path.join(root, rel))
            lines.append('{} {}\n'.format(rel, label))
        with open(os.path.join(root, split + '.txt'), 'w') as f:
            f.writelines(lines)
    config = os.path.join(root, 'tiny.json')
    with open(config, 'w') as f:
        json.dump(TINY_CONFIG, f)
    return str(root), config


def command(dataset, out, *extra, train='train.txt', val='val.txt'):
    root, config = dataset
    return [sys.executable, SCRIPT, os.path.join(root, train),
            os.path.join(root, val), '--root', root, '--config', config,
            '--arch', 'small', '--crop-size', '16', '--resize', '18',
            '--out', str(out), '--no-progress', '--fisher-diff',
            '--target-acc', '0.3'] + list(extra)


def run(cmd, nproc=1, timeout=240):
    if nproc > 1:
        cmd = [launch.MPIEXEC, '-n', str(nproc)] + cmd
    return subprocess.run(cmd, env=launch.mpi_env(), cwd=ROOT, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          universal_newlines=True)


def read_log(out):
    with open(os.path.join(out, 'log')) as f:
        return json.load(f)


@pytest.mark.slow
@pytest.mark.parametrize('nproc', [1, 2])
def test_trains_logs_and_snapshots(dataset, tmp_path, nproc):
    result = run(command(dataset, tmp_path), nproc)
    assert result.returncode == 0, result.stdout[-3000:]
    log = read_log(tmp_path)
    assert [e['epoch'] for e in log] == [1, 2]
    for key in ('main/loss', 'validation/main/accuracy', 'lr', 'momentum',
                'damping', 'refresh_interval_A', 'images_per_sec',
                'elapsed_time'):
        assert all(numpy.isfinite(e[key]) for e in log), key
    # 48 images / (nproc × 8) micro-batches per epoch.
    assert log[-1]['iteration'] == 2 * 48 // (8 * nproc)
    with open(os.path.join(tmp_path, 'config.json')) as f:
        config = json.load(f)
    assert config['run']['n_processes'] == nproc
    assert config['run']['acc_iters'] == 16 // (8 * nproc)
    assert config['global_batch_size'] == 16
    for rank in range(nproc):
        assert os.path.exists(os.path.join(
            tmp_path, 'snapshot_epoch_2.rank{}'.format(rank)))
    with open(os.path.join(tmp_path, 'fisher_diff.jsonl')) as f:
        lines = [json.loads(line) for line in f]
    assert lines and {'A', 'G', 'F'} <= set().union(*lines)
    assert 'K-FAC registration' in result.stdout


@pytest.mark.slow
def test_killed_run_resumes_from_its_snapshot(dataset, tmp_path):
    cmd = command(dataset, tmp_path, '--epochs', '30')
    process = subprocess.Popen(cmd, env=launch.mpi_env(), cwd=ROOT,
                               stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    snapshot = os.path.join(tmp_path, 'snapshot_epoch_1.rank0')
    deadline = time.time() + 120
    while not os.path.exists(snapshot) and time.time() < deadline:
        time.sleep(0.2)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert os.path.exists(snapshot)
    resumed = tmp_path / 'resumed'
    result = run(command(dataset, resumed, '--epochs', '3', '--resume',
                         snapshot[:-len('.rank0')]))
    assert result.returncode == 0, result.stdout[-3000:]
    log = read_log(resumed)
    # The snapshot carries the log of epoch 1; the resumed trainer runs
    # epochs 2-3 only.
    assert [e['epoch'] for e in log] == [1, 2, 3]
    assert log[0] == read_log(tmp_path)[0]
    assert log[-1]['iteration'] == 3 * 48 // 8


def test_bad_list_line_names_file_and_line(dataset, tmp_path):
    root, _ = dataset
    bad = os.path.join(root, 'bad.txt')
    with open(bad, 'w') as f:
        f.write('train/0.png 0\ntrain/1.png not-a-label\n')
    result = run(command(dataset, tmp_path, train='bad.txt'))
    assert result.returncode != 0
    assert 'bad.txt' in result.stdout and 'line 2' in result.stdout
    assert not os.path.exists(os.path.join(tmp_path, 'log'))


def test_missing_image_names_file_and_line(dataset, tmp_path):
    root, _ = dataset
    bad = os.path.join(root, 'missing.txt')
    with open(bad, 'w') as f:
        f.write('train/0.png 0\ntrain/nope.png 1\n')
    result = run(command(dataset, tmp_path, train='missing.txt'))
    assert result.returncode != 0
    assert 'nope.png' in result.stdout and 'line 2' in result.stdout


def test_batch_that_does_not_divide_gives_the_numbers(dataset, tmp_path):
    root, _ = dataset
    config = os.path.join(root, 'odd.json')
    with open(config, 'w') as f:
        json.dump(dict(TINY_CONFIG, global_batch_size=24), f)
    cmd = command(dataset, tmp_path)
    cmd[cmd.index('--config') + 1] = config
    result = run(cmd, nproc=2)
    assert result.returncode != 0
    assert '24' in result.stdout and '2' in result.stdout
    assert 'global' in result.stdout.lower()


def test_snapshot_trigger_waits_for_the_end_of_the_kfac_step():
    sys.path.insert(0, ROOT)
    from train_imagenet import EpochAtStepBoundary

    class Updater:
        iteration, is_new_epoch = 0, False

    class Trainer:
        updater = Updater()

    trigger, trainer, fired = EpochAtStepBoundary(1, 4), Trainer(), []
    for iteration in range(1, 25):       # epochs of 5 micro-batches
        trainer.updater.iteration = iteration
        trainer.updater.is_new_epoch = iteration % 5 == 0
        if trigger(trainer):
            fired.append(iteration)
    # Epoch ends at 5, 10, 15, 20; steps end at multiples of 4.
    assert fired == [8, 12, 16, 20]

"""End-to-end runs of train_imagenet.py on a tiny ImageNet-like data set
(JPEGs, class folders, list files): what a run leaves, the end of a run
that stops inside a step, and bad input refused before training."""
import json
import os

import chainer
import numpy
import pytest

from tests.scripts import imagenet_like
from tests.scripts.conftest import command, read_log, run, weights


@pytest.mark.slow
@pytest.mark.parametrize('nproc', [1, 2])
def test_run_leaves_log_snapshots_and_final_model(dataset, references,
                                                  nproc):
    out = references[nproc]
    log = read_log(out)
    assert [e['epoch'] for e in log] == [1, 2, 3]
    for key in ('main/loss', 'validation/main/accuracy', 'lr', 'momentum',
                'damping', 'refresh_interval_A', 'images_per_sec',
                'elapsed_time'):
        assert all(numpy.isfinite(e[key]) for e in log), key
    # 48 images per epoch, nproc x 8 per iteration; 144 / 32 = 4.5 steps:
    # the run ends inside its fifth step.
    assert log[-1]['iteration'] == 3 * 48 // (8 * nproc)
    with open(os.path.join(out, 'config.json')) as f:
        facts = json.load(f)['run']
    assert facts['n_processes'] == nproc
    assert facts['acc_iters'] == 32 // (8 * nproc)
    assert facts['n_class'] == imagenet_like.N_CLASS
    # Epochs end in steps 2 and 3 (at its end) and in the flushed fifth.
    for step in (2, 3, 5):
        for rank in range(nproc):
            assert os.path.exists(os.path.join(
                out, 'snapshot_step_{}.rank{}'.format(step, rank)))
    # model_final.npz is the bare network, and the final snapshot's.
    import models
    bare = models.SmallResNet(depth=8, width=8, n_class=imagenet_like.N_CLASS)
    chainer.serializers.load_npz(os.path.join(out, 'model_final.npz'), bare)
    final = weights(os.path.join(out, 'model_final.npz'))
    with numpy.load(os.path.join(out, 'snapshot_step_5.rank0')) as snap:
        for name, value in final.items():
            numpy.testing.assert_array_equal(
                snap['updater/model:main/predictor/' + name], value)
        assert int(snap['updater/n_processes']) == nproc
    # The K-FAC state in the snapshots: factors, no inverses, each block's
    # on one process only.
    holders = {}
    for rank in range(nproc):
        with numpy.load(os.path.join(out, 'snapshot_step_5.rank{}'.format(
                rank))) as snap:
            kfac = [k for k in snap.files if '/kfac/' in k]
            assert kfac and not [k for k in kfac if k.endswith('_inv')]
            for key in kfac:
                if key.rsplit('/', 1)[-1] in ('A', 'G', 'F'):
                    holders.setdefault(key, []).append(rank)
    assert holders and all(len(r) == 1 for r in holders.values())
    assert {r for ranks in holders.values() for r in ranks} == \
        set(range(nproc))
    # The mean image computed by all processes equals the serial mean.
    import augment
    serial = augment.compute_mean(augment.ImageListDataset(
        dataset['train'], dataset['root'], resize=18), 16)
    numpy.testing.assert_array_equal(
        numpy.load(os.path.join(out, 'mean.npy')), serial)
    # Every output has the mode of a new file (the test runs under the
    # umask it was started with).
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(out):
        assert os.stat(os.path.join(out, name)).st_mode & 0o777 == \
            0o666 & ~umask, name


@pytest.mark.slow
def test_two_snapshots_kept_by_default(dataset, tmp_path):
    result = run(command(dataset, tmp_path, '--epochs', '3'))
    assert result.returncode == 0, result.stdout[-3000:]
    names = sorted(n for n in os.listdir(str(tmp_path))
                   if n.startswith('snapshot'))
    # 3 steps per epoch: the snapshots of epochs 2 and 3.
    assert names == ['snapshot_step_6.rank0', 'snapshot_step_9.rank0']
    assert not [n for n in os.listdir(str(tmp_path)) if '.tmp' in n]


@pytest.mark.slow
def test_run_ending_inside_a_step_completes_it_and_saves_it(dataset,
                                                            tmp_path):
    """SGD, 1 process: 48 images, 4 x 8 per step: epoch 1 ends 2
    micro-batches into the second step, which is completed from them."""
    config = imagenet_like.write_config(dataset['root'], 'bs32.json',
                                        global_batch_size=32)
    result = run(command(dataset, tmp_path, '--optimizer', 'sgd',
                         '--epochs', '1', '--fisher-diff', config=config))
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'ends 2 micro-batches into a step of 4' in result.stdout
    # one command line for several optimizers: Diff(t) is K-FAC's alone
    assert result.stdout.count("--fisher-diff: Diff(t) of eq. (21) is "
                               "K-FAC's; this --optimizer sgd run writes "
                               'no fisher_diff.jsonl') == 1
    assert not os.path.exists(os.path.join(str(tmp_path),
                                           'fisher_diff.jsonl'))
    # --no-progress: plain lines for a log file, no terminal escape codes.
    assert '\x1b' not in result.stdout
    [entry] = read_log(tmp_path)
    assert entry['trailing_micro_batches'] == 2
    assert os.path.exists(os.path.join(str(tmp_path),
                                       'snapshot_step_2.rank0'))
    final = weights(os.path.join(str(tmp_path), 'model_final.npz'))
    with numpy.load(os.path.join(str(tmp_path),
                                 'snapshot_step_2.rank0')) as snap:
        # Two steps were taken: the full one and the completed one.
        assert int(snap['updater/optimizer:main/t']) == 2
        for name, value in final.items():
            numpy.testing.assert_array_equal(
                snap['updater/model:main/predictor/' + name], value)


@pytest.mark.slow
def test_kfac_run_ending_inside_a_step_flushes_it(references):
    entry = read_log(references[1])[-1]
    assert entry['trailing_micro_batches'] == 2
    with numpy.load(os.path.join(references[1],
                                 'snapshot_step_5.rank0')) as snap:
        assert int(snap['updater/optimizer:main/t']) == 5

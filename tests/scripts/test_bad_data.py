"""Bad input is refused before compute is spent, with the file and line:
labels out of range, unreadable JPEGs (at start-up, with --check-images,
in training; fatal or skipped), epochs past the learning rate's end, and
errors under mpiexec end with the real message (not Open MPI's "Sorry!")."""
import json
import os

import pytest

from tests import launch
from tests.scripts import imagenet_like
from tests.scripts.conftest import command, read_log, run


def no_training(out):
    return not os.path.exists(os.path.join(str(out), 'log'))


def test_label_out_of_range_names_file_and_line(dataset, tmp_path):
    result = run(command(dataset, tmp_path, train=dataset['bad_label']),
                 nproc=2)
    assert result.returncode != 0
    out = result.stdout
    assert 'bad_label.txt, line 8: label 9 is out of range for 4 classes' \
        in out
    # Said once (by rank 0, whatever the number of processes), followed only
    # by Open MPI's abort notice: no missing help file in the way.
    assert out.count('Traceback') == 1
    assert 'Sorry!' not in out and 'help-mpi-api.txt' not in out
    assert no_training(tmp_path)


def test_n_class_option_overrides_the_config(dataset, tmp_path):
    result = run(command(dataset, tmp_path, '--n-class', '3'))
    assert result.returncode != 0
    assert 'train.txt, line 4: label 3 is out of range for 3 classes' in \
        result.stdout


def test_corrupt_jpeg_found_by_the_mean_pass(dataset, tmp_path):
    result = run(command(dataset, tmp_path, train=dataset['train_corrupt']))
    assert result.returncode != 0
    assert 'corrupt.JPEG' in result.stdout
    assert 'train_corrupt.txt, line 6' in result.stdout
    assert no_training(tmp_path)
    assert not os.path.exists(os.path.join(str(tmp_path), 'mean.npy'))


@pytest.fixture(scope='module')
def mean(dataset, tmp_path_factory):
    """A mean image, so that runs meet the corrupt image in training."""
    out = tmp_path_factory.mktemp('mean')
    result = run(command(dataset, out, '--epochs', '1', '--optimizer', 'sgd'))
    assert result.returncode == 0, result.stdout[-3000:]
    return os.path.join(str(out), 'mean.npy')


@pytest.mark.slow
@pytest.mark.parametrize('loaderjob', ['0', '1'])
def test_corrupt_jpeg_in_training_is_fatal_with_file_and_line(
        dataset, mean, tmp_path, loaderjob):
    result = run(command(dataset, tmp_path, '--mean', mean, '--loaderjob',
                         loaderjob, train=dataset['train_corrupt']),
                 timeout=120)
    assert result.returncode != 0
    assert 'unreadable image' in result.stdout
    assert 'corrupt.JPEG' in result.stdout
    assert 'train_corrupt.txt, line 6' in result.stdout


@pytest.mark.slow
def test_corrupt_jpeg_skipped_and_counted(dataset, mean, tmp_path):
    result = run(command(dataset, tmp_path, '--mean', mean, '--epochs', '1',
                         '--skip-bad-images', '--optimizer', 'sgd',
                         train=dataset['train_corrupt']))
    assert result.returncode == 0, result.stdout[-3000:]
    [entry] = read_log(tmp_path)
    # 49 listed images, 64 taken (4 steps of 16): every image of the first
    # epoch's order, the corrupt one included, is met.
    assert entry['bad_images_skipped'] >= 1
    assert 'skipping unreadable image' in result.stdout
    assert 'corrupt.JPEG' in result.stdout


def _val_with_a_corrupt_image(dataset):
    with open(dataset['val']) as f:
        lines = f.readlines()
    val = os.path.join(dataset['root'], 'val_corrupt.txt')
    with open(val, 'w') as f:
        f.writelines(lines[:2] + ['train/n00000001/corrupt.JPEG 1\n'] +
                     lines[2:])
    return val


def _both_lists_refused(result, out):
    """The run refused the bad image of each list, naming its line, and
    listed both in bad_images.txt, before training."""
    assert result.returncode != 0
    assert 'train_corrupt.txt, line 6' in result.stdout
    assert 'val_corrupt.txt, line 3' in result.stdout
    with open(os.path.join(str(out), 'bad_images.txt')) as f:
        assert len(f.readlines()) == 2
    assert no_training(out)


def test_check_images_reports_every_bad_file(dataset, tmp_path):
    val = _val_with_a_corrupt_image(dataset)
    mean = os.path.join(str(tmp_path), 'given_mean.npy')
    import numpy
    numpy.save(mean, numpy.zeros((3, 16, 16), numpy.float32))
    result = run(command(dataset, tmp_path, '--check-images', '--mean', mean,
                         train=dataset['train_corrupt'], val=val))
    _both_lists_refused(result, tmp_path)
    # the advice works as given: the same --out, with --overwrite
    assert 'run again with --overwrite' in result.stdout
    fixed = run(command(dataset, tmp_path, '--check-images', '--mean', mean,
                        '--skip-bad-images', '--overwrite', '--epochs', '1',
                        '--optimizer', 'sgd', train=dataset['train_corrupt'],
                        val=val))
    assert fixed.returncode == 0, fixed.stdout[-3000:]

    skipped = tmp_path / 'skipped'
    result = run(command(dataset, skipped, '--check-images', '--mean', mean,
                         '--skip-bad-images', '--epochs', '1', '--optimizer',
                         'sgd', train=dataset['train_corrupt'], val=val))
    assert result.returncode == 0, result.stdout[-3000:]
    assert 'left out' in result.stdout
    with open(os.path.join(str(skipped), 'config.json')) as f:
        facts = json.load(f)['run']
    assert (facts['n_train'], facts['n_val']) == (48, 16)


def test_an_unreadable_validation_image_is_refused_at_start(dataset,
                                                            tmp_path):
    """Without --check-images: it stopped the run after the first epoch
    of training, before that epoch's snapshot; now found at start-up,
    and with --skip-bad-images left out."""
    val = _val_with_a_corrupt_image(dataset)
    result = run(command(dataset, tmp_path, val=val))
    assert result.returncode != 0
    assert 'val_corrupt.txt, line 3' in result.stdout
    assert 'corrupt.JPEG' in result.stdout
    assert no_training(tmp_path)
    skipped = tmp_path / 'skipped'
    result = run(command(dataset, skipped, '--skip-bad-images', '--epochs',
                         '1', '--optimizer', 'sgd', val=val))
    assert result.returncode == 0, result.stdout[-3000:]
    with open(os.path.join(str(skipped), 'config.json')) as f:
        assert json.load(f)['run']['n_val'] == 16


def test_check_images_with_the_mean_pass_reports_both_lists(dataset,
                                                            tmp_path):
    """--check-images where the mean is computed: the training list's bad
    files (found by the mean pass) and the validation list's at once (the
    validation list was not scanned), and no mean saved."""
    val = _val_with_a_corrupt_image(dataset)
    result = run(command(dataset, tmp_path, '--check-images',
                         train=dataset['train_corrupt'], val=val))
    _both_lists_refused(result, tmp_path)
    assert not os.path.exists(os.path.join(str(tmp_path), 'mean.npy'))


def test_epochs_past_the_end_of_the_learning_rate_refused(dataset, tmp_path):
    result = run(command(dataset, tmp_path, '--epochs', '6'))
    assert result.returncode != 0
    assert "key 'epochs'" in result.stdout
    assert '6 epochs (from --epochs on the command line, not the config) ' \
        'exceed e_end = 4' in result.stdout
    assert no_training(tmp_path)


def test_bad_list_line_names_file_and_line(dataset, tmp_path):
    bad = os.path.join(dataset['root'], 'bad.txt')
    with open(bad, 'w') as f:
        f.write('train/n00000000/train_0.JPEG 0\ntrain/1.png not-a-label\n')
    result = run(command(dataset, tmp_path, train=bad))
    assert result.returncode != 0
    assert 'bad.txt, line 2' in result.stdout
    assert no_training(tmp_path)


@pytest.mark.parametrize('which,keep,message', [
    ('val', 0, 'the validation list {} has 0 images, fewer than the 2'),
    ('val', 1, 'the validation list {} has 1 image, fewer than the 2'),
    ('train', 0, 'the training list {} is empty'),
])
def test_a_list_too_short_to_share_is_refused_at_once(dataset, tmp_path,
                                                     which, keep, message):
    """Two processes, each evaluating a share of the validation list: a
    list with fewer images than processes failed at the first evaluation,
    after an epoch of training; now refused with the lists, once, and
    nothing of the run is left to refuse the corrected one."""
    short = os.path.join(dataset['root'], 'short_{}.txt'.format(which))
    with open(dataset[which]) as f:
        lines = f.readlines()[:keep]
    with open(short, 'w') as f:
        f.writelines(lines)
    out = tmp_path / 'run'
    result = run(command(dataset, out, **{which: short}), nproc=2)
    assert result.returncode != 0
    assert message.format(short) in result.stdout, result.stdout[-3000:]
    assert result.stdout.count('Traceback') == 1
    assert no_training(out)
    assert not os.path.exists(str(out)) or not os.listdir(str(out))


def test_missing_image_names_file_and_line(dataset, tmp_path):
    """Two processes, each checking its share of the files."""
    missing = os.path.join(dataset['root'], 'missing.txt')
    with open(dataset['train']) as f:
        lines = f.readlines()
    with open(missing, 'w') as f:
        f.writelines(lines[:1] + ['train/nope.JPEG 1\n'] + lines[1:40] +
                     ['train/gone.JPEG 2\n'])
    result = run(command(dataset, tmp_path, train=missing), nproc=2)
    assert result.returncode != 0
    assert 'nope.JPEG' in result.stdout and 'line 2' in result.stdout
    assert '2 of 42 listed images are missing' in result.stdout


def test_batch_that_does_not_divide_gives_the_numbers(dataset, tmp_path):
    config = imagenet_like.write_config(dataset['root'], 'odd.json',
                                        global_batch_size=24)
    result = run(command(dataset, tmp_path, config=config), nproc=2)
    assert result.returncode != 0
    assert 'global batch 24 is not divisible by 2 processes x 8' in \
        result.stdout


def test_open_mpi_help_found_without_mpiexec(dataset, tmp_path):
    """One process started without mpiexec: the abort notice is Open MPI's
    own text, not "Sorry! You were supposed to get help about: mpi-abort",
    and the real error is above it."""
    env = launch.mpi_env()
    env.pop('OPAL_PREFIX', None)
    import subprocess
    result = subprocess.run(
        command(dataset, tmp_path, '--epochs', '9'), env=env,
        cwd=launch.REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        universal_newlines=True, timeout=120)
    assert result.returncode != 0
    assert '9 epochs (from --epochs' in result.stdout
    assert 'Sorry!' not in result.stdout
    assert 'MPI_ABORT was invoked' in result.stdout


def test_check_images_reports_a_mode_without_white_level(dataset, tmp_path):
    """A 16-bit PNG is read (scaled, tests/augment/test_image_modes.py); a
    float TIFF is reported by --check-images with its line and mode."""
    import numpy
    from PIL import Image
    root = dataset['root']
    grey = (numpy.arange(24 * 20, dtype=numpy.uint16).reshape(20, 24) * 130)
    Image.fromarray(grey).save(os.path.join(root, 'train', 'grey16.png'))
    Image.fromarray(grey.astype(numpy.float32)).save(
        os.path.join(root, 'train', 'float.tif'))
    with open(dataset['train']) as f:
        lines = f.readlines()
    listed = os.path.join(root, 'train_modes.txt')
    with open(listed, 'w') as f:
        f.writelines(lines[:3] + ['train/grey16.png 1\n',
                                  'train/float.tif 2\n'] + lines[3:])
    mean = os.path.join(str(tmp_path), 'given_mean.npy')
    numpy.save(mean, numpy.zeros((3, 16, 16), numpy.float32))
    result = run(command(dataset, tmp_path / 'out', '--check-images',
                         '--mean', mean, train=listed))
    assert result.returncode != 0
    assert "1 unreadable image(s) in {}".format(listed) in result.stdout
    assert "train_modes.txt, line 5" in result.stdout
    assert "mode 'F'" in result.stdout
    assert 'grey16.png' not in result.stdout

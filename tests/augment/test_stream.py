"""The global sample stream: the same global batches on any number of
processes, epochs counted in samples, positions that resume on any number
of processes, per-sample crops that equal the float path, loaders that
report unreadable images instead of raising."""
import chainer
import numpy as np
import pytest
from PIL import Image

import augment
from augment.stream import CROP_FLIP, GlobalBatchIterator, TrainStream


@pytest.fixture(scope='module')
def images(tmp_path_factory):
    """22 PNGs: image i is filled with i (so batches can be decoded)."""
    root = tmp_path_factory.mktemp('stream')
    lines = []
    for i in range(22):
        pixels = np.full((12, 14, 3), i, np.uint8)
        pixels[0, 0] = (i, 255 - i, 7)
        Image.fromarray(pixels).save(root / '{}.png'.format(i))
        lines.append('{}.png {}\n'.format(i, i % 3))
    (root / 'list.txt').write_text(''.join(lines))
    return augment.read_image_list(str(root / 'list.txt'), str(root))


def ids(batch):
    """Which images a batch holds (pixel (1, 1) of an uncropped image)."""
    return [int(image[0].max()) for image, _, _ in batch]


def global_steps(images, n_processes, chunks_per_step, n_steps, b=3):
    """The sets of image ids of each global step on ``n_processes``."""
    iterators = [GlobalBatchIterator(
        TrainStream(images, None, 10, 5, n_processes, r, b),
        chunks_per_step) for r in range(n_processes)]
    acc = chunks_per_step // n_processes
    steps, epochs = [], []
    for _ in range(n_steps):
        step = []
        for _ in range(acc):
            for it in iterators:
                step += ids(it.next())
            epochs.append(tuple((it.epoch, it.epoch_detail, it.is_new_epoch)
                                for it in iterators))
        steps.append(sorted(step))
    for per_rank in epochs:
        assert len(set(per_rank)) == 1, 'processes disagree on the epoch'
    return steps, iterators[0]


def test_global_batches_do_not_depend_on_the_number_of_processes(images):
    one, it1 = global_steps(images, 1, 4, 6)
    two, it2 = global_steps(images, 2, 4, 6)
    four, it4 = global_steps(images, 4, 4, 6)
    assert one == two == four
    # 6 steps x 4 chunks x 3 samples = 72 samples of 22: epochs 0-3, and
    # every epoch is a permutation of the list.
    flat = sum(one, [])
    stream = it1.stream
    order = np.concatenate([stream.permutation(e) for e in range(4)])
    assert sorted(flat) == sorted(order[:72])
    for epoch in range(3):
        assert sorted(stream.permutation(epoch)) == list(range(22))
    assert it1.epoch == it2.epoch == it4.epoch == 72 // 22
    assert it1.epoch_detail == it2.epoch_detail == pytest.approx(72 / 22)


def test_position_resumes_on_another_number_of_processes(images):
    _, it2 = global_steps(images, 2, 4, 3)          # 12 chunks taken
    state = chainer.serializers.DictionarySerializer()
    it2.serialize(state)
    assert int(state.target['chunks']) == 12
    rest_two, _ = global_steps(images, 2, 4, 6)
    resumed = GlobalBatchIterator(TrainStream(images, None, 10, 5, 1, 0, 3),
                                  4)
    resumed.serialize(chainer.serializers.NpzDeserializer(state.target))
    assert resumed.position == 12 and resumed.epoch_detail == 36 / 22
    steps = [sorted(sum((ids(resumed.next()) for _ in range(4)), []))
             for _ in range(3)]
    assert steps == rest_two[3:]
    # A position inside a step (after a flushed last step) is rounded up.
    state.target['chunks'] = np.asarray(13)
    resumed.serialize(chainer.serializers.NpzDeserializer(state.target))
    assert resumed.position == 16 and resumed.skipped_chunks == 3
    state.target['batch_size'] = np.asarray(4)
    # the config's keys named, with the global batch (it spoke of samples
    # and chunks only)
    with pytest.raises(ValueError, match=r'4 samples per process per '
                       r'micro-batch, 4 chunks per step \(global_batch_size '
                       r'16\).*this run has 3, 4 \(global_batch_size 12\).*'
                       r'same config \(its global_batch_size and '
                       r'batch_size_per_process\)'):
        resumed.serialize(chainer.serializers.NpzDeserializer(state.target))


@pytest.mark.parametrize('change, named', [
    ('relabel', 'the labels'),
    ('reorder', 'the paths or their order'),
    ('both', 'the paths or their order and the labels'),
])
def test_a_changed_list_of_the_same_length_is_refused(images, change,
                                                      named):
    """A resumed position is a place in the list's permutation: a list
    relabelled or reordered (same length) would resume on other images."""
    _, it = global_steps(images, 1, 4, 2)
    state = chainer.serializers.DictionarySerializer()
    it.serialize(state)
    order = np.arange(len(images))
    if change in ('reorder', 'both'):
        order[[0, 1]] = [1, 0]
    changed = images.without([])
    changed._paths = images._paths[order]
    changed.labels = images.labels.copy()
    if change in ('relabel', 'both'):
        changed.labels[5] = (changed.labels[5] + 1) % 3
    resumed = GlobalBatchIterator(TrainStream(changed, None, 10, 5, 1, 0, 3),
                                  4)
    with pytest.raises(ValueError, match='has the snapshot\'s 22 images, '
                       'but {} differ'.format(named)):
        resumed.serialize(chainer.serializers.NpzDeserializer(state.target))
    # The same list resumes, and so does a snapshot of an earlier version
    # (no digests: strict=False leaves this run's own).
    same = GlobalBatchIterator(TrainStream(images, None, 10, 5, 1, 0, 3), 4)
    same.serialize(chainer.serializers.NpzDeserializer(state.target))
    assert same.position == 8
    for key in ('list_paths_sha256', 'list_labels_sha256'):
        del state.target[key]
    resumed.serialize(chainer.serializers.NpzDeserializer(state.target,
                                                          strict=False))
    assert resumed.position == 8


def test_crop_and_flip_of_a_sample_come_from_its_stream_position(images):
    """uint8 crops normalised as a batch (on the training device) equal the
    float path (crop a float32 image and normalise it on the host, as
    ImageTransform does) given the same draws, and loader processes draw
    the same crops as the training process."""
    mean = np.random.RandomState(0).uniform(0, 255, (3, 10, 10)).astype(
        np.float32)
    stream = TrainStream(images, None, 10, 5, 1, 0, 4)
    serial = [stream[k] for k in range(8)]
    loader = chainer.iterators.MultiprocessIterator(
        TrainStream(images, None, 10, 5, 1, 0, 4), 8, shuffle=False,
        n_processes=2)
    try:
        parallel = loader.next()
    finally:
        loader.finalize()
    for (a, la, _), (b, lb, _) in zip(serial, parallel):
        np.testing.assert_array_equal(a, b)
        assert la == lb
    batch = np.stack([image for image, _, _ in serial])
    assert batch.dtype == np.uint8
    normalised = augment.normalize(batch, mean)
    for k in range(8):
        q = stream.stream_position(k)
        epoch, pos = divmod(q, len(images))
        index = stream.permutation(epoch)[pos]
        whole = augment.load_image(images.path(index)).astype(np.float32)
        rng = augment.stream_rng(5, CROP_FLIP, q)
        expected = augment.normalize(augment.crop_flip(whole, 10, rng), mean)
        np.testing.assert_array_equal(normalised[k], expected)


def test_unreadable_image_reported_or_replaced(images, tmp_path):
    (tmp_path / 'bad.png').write_bytes(b'\x89PNG broken')
    lines = ''.join('{} 0\n'.format(images.path(i)) for i in range(4))
    (tmp_path / 'l.txt').write_text(lines + 'bad.png 1\n')
    listed = augment.read_image_list(str(tmp_path / 'l.txt'), str(tmp_path))
    fatal = TrainStream(listed, None, 4, 0, 1, 0, 5)
    batch = [fatal[k] for k in range(5)]
    [message] = [m for _, _, m in batch if m]
    assert 'bad.png' in message and 'line 5' in message
    skipping = TrainStream(listed, None, 4, 0, 1, 0, 5, skip_bad=True)
    batch = [skipping[k] for k in range(5)]
    assert all(image.shape == (3, 4, 4) for image, _, _ in batch)
    assert sum('bad.png' in m for _, _, m in batch) == 1
    # Another image of the epoch's order takes the bad one's place.
    assert len({int(image[0].max()) for image, _, _ in batch}) == 4

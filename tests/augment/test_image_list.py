import chainer
import numpy as np
import pytest
from PIL import Image

from augment import (ImageListDataset, compute_mean, imagenet_dataset,
                     load_mean, read_image_list, save_mean)


@pytest.fixture
def image_dir(tmp_path):
    rng = np.random.RandomState(0)
    (tmp_path / 'cls a').mkdir()
    for i, size in enumerate([(40, 30), (20, 50), (36, 36)]):
        pixels = rng.randint(0, 256, size + (3,)).astype(np.uint8)
        Image.fromarray(pixels).save(tmp_path / 'cls a' / '{}.png'.format(i))
    Image.fromarray(rng.randint(0, 256, (36, 36)).astype(np.uint8)).save(
        tmp_path / 'gray.png')
    (tmp_path / 'train.txt').write_text(
        'cls a/0.png 0\ncls a/1.png 1\n\ncls a/2.png 2\ngray.png 1\n')
    return tmp_path


def test_reads_resizes_and_converts_to_rgb(image_dir):
    dataset = ImageListDataset(str(image_dir / 'train.txt'), str(image_dir),
                               resize=36)
    assert len(dataset) == 4
    np.testing.assert_array_equal(dataset.labels, [0, 1, 2, 1])
    for i in range(4):
        image, label = dataset[i]
        assert image.shape == (3, 36, 36) and image.dtype == np.uint8
        assert label.dtype == np.int32
        assert 0 <= image.min() and image.max() <= 255
    # Already 36x36: resizing is the identity.
    original = np.asarray(Image.open(image_dir / 'cls a' / '2.png'))
    np.testing.assert_array_equal(dataset[2][0], original.transpose(2, 0, 1))
    gray, _ = dataset[3]
    np.testing.assert_array_equal(gray[0], gray[1])


def test_transform_dataset_and_mean(image_dir, tmp_path):
    base = ImageListDataset(str(image_dir / 'train.txt'), str(image_dir),
                            resize=36)
    mean = compute_mean(base, crop_size=32)
    expected = np.mean([base[i][0][:, :32, :32] for i in range(4)], axis=0)
    np.testing.assert_allclose(mean, expected, rtol=1e-5)
    path = str(tmp_path / 'mean.npy')
    save_mean(path, mean)
    np.testing.assert_array_equal(load_mean(path, crop_size=32), mean)
    with pytest.raises(ValueError, match='mean.npy'):
        load_mean(path, crop_size=224)

    val = imagenet_dataset(str(image_dir / 'train.txt'), str(image_dir), mean,
                           crop_size=32, resize=36, train=False)
    assert isinstance(val, chainer.datasets.TransformDataset)
    x, t = val[0]
    np.testing.assert_allclose(x, (base[0][0][:, 2:34, 2:34] - mean) / 255,
                               atol=1e-6)
    batch = chainer.dataset.concat_examples([val[i] for i in range(4)])
    assert batch[0].shape == (4, 3, 32, 32)


@pytest.mark.parametrize('line', ['cls a/0.png', 'x.png zero', 'x.png -1'])
def test_bad_line_names_file_and_line(image_dir, line):
    path = image_dir / 'bad.txt'
    path.write_text('cls a/0.png 0\n{}\n'.format(line))
    with pytest.raises(ValueError) as info:
        ImageListDataset(str(path), str(image_dir))
    assert str(path) in str(info.value) and 'line 2' in str(info.value)


def test_missing_image_names_file_and_line(image_dir):
    path = image_dir / 'missing.txt'
    path.write_text('cls a/0.png 0\nnope.png 1\ngone.png 2\n')
    with pytest.raises(FileNotFoundError) as info:
        ImageListDataset(str(path), str(image_dir))
    message = str(info.value)
    assert 'nope.png' in message and str(path) in message
    assert 'line 2' in message and '2 of 3' in message


def test_unreadable_image_names_file(image_dir):
    (image_dir / 'broken.png').write_bytes(b'not an image')
    path = image_dir / 'broken.txt'
    path.write_text('cls a/0.png 0\nbroken.png 1\n')
    dataset = ImageListDataset(str(path), str(image_dir))
    dataset[0]
    with pytest.raises(OSError) as info:
        dataset[1]
    assert 'broken.png' in str(info.value) and 'line 2' in str(info.value)


def test_label_out_of_range_names_file_and_line(image_dir):
    with pytest.raises(ValueError) as info:
        read_image_list(str(image_dir / 'train.txt'), str(image_dir),
                        n_class=2)
    message = str(info.value)
    assert 'train.txt, line 4' in message
    assert 'label 2 is out of range for 2 classes' in message
    assert len(read_image_list(str(image_dir / 'train.txt'),
                               str(image_dir), n_class=3)) == 4


def test_truncated_jpeg_is_an_error_naming_file_and_line(image_dir):
    pixels = np.random.RandomState(1).randint(0, 256, (375, 500, 3))
    Image.fromarray(pixels.astype(np.uint8)).save(image_dir / 'whole.JPEG')
    whole = (image_dir / 'whole.JPEG').read_bytes()
    (image_dir / 'cut.JPEG').write_bytes(whole[:len(whole) // 2])
    path = image_dir / 'jpegs.txt'
    path.write_text('whole.JPEG 0\ncut.JPEG 1\n')
    dataset = ImageListDataset(str(path), str(image_dir), resize=256)
    assert dataset[0][0].shape == (3, 256, 256)
    with pytest.raises(OSError) as info:
        dataset[1]
    assert 'cut.JPEG' in str(info.value) and 'line 2' in str(info.value)


def test_a_byte_order_mark_and_crlf_are_read_as_the_list(image_dir):
    """A list saved by Windows' Notepad: a UTF-8 byte-order mark (which
    became part of the first path, "image not found" on a file that is
    there) and CRLF line ends."""
    path = image_dir / 'bom.txt'
    path.write_bytes(b'\xef\xbb\xbfcls a/0.png 0\r\ncls a/1.png 1\r\n')
    images = read_image_list(str(path), str(image_dir), n_class=2)
    assert images.path(0) == str(image_dir / 'cls a' / '0.png')
    assert list(images.labels) == [0, 1]


def test_a_list_not_in_utf8_names_file_and_line(image_dir):
    path = image_dir / 'latin1.txt'
    path.write_bytes('cls a/0.png 0\ncaf\xe9.png 1\n'.encode('latin-1'))
    with pytest.raises(ValueError, match=r'latin1.txt, line 2: not UTF-8'):
        read_image_list(str(path), str(image_dir))


@pytest.mark.parametrize('label', ['0_1', '+3', '\u0662', '1.0', '²'])
def test_a_label_of_anything_but_ascii_digits_is_refused(image_dir, label):
    """``int()`` reads '0_1' as 1, '+3' as 3 and '٢' as 2."""
    path = image_dir / 'odd.txt'
    path.write_text('cls a/0.png 0\ncls a/1.png {}\n'.format(label),
                    encoding='utf-8')
    with pytest.raises(ValueError, match=r'odd.txt, line 2'):
        read_image_list(str(path), str(image_dir), check_files=False)


@pytest.mark.parametrize('orientation', [1, 3, 6, 8])
def test_a_photo_is_read_upright_as_its_exif_orientation_says(
        tmp_path, orientation):
    """A camera's photo stored on its side with an EXIF orientation is read
    as a viewer shows it (it trained rotated)."""
    from augment.image_list import load_image
    shown = np.zeros((40, 30, 3), np.uint8)
    shown[:8] = 255                              # a white band on top
    stored = Image.fromarray(shown)
    undo = {1: None, 3: Image.Transpose.ROTATE_180,
            6: Image.Transpose.ROTATE_90, 8: Image.Transpose.ROTATE_270}
    if undo[orientation] is not None:
        stored = stored.transpose(undo[orientation])
    exif = Image.Exif()
    exif[0x0112] = orientation
    path = tmp_path / 'photo.jpg'
    stored.save(path, quality=95, exif=exif)
    image = load_image(str(path))
    assert image.shape == (3, 40, 30)
    assert image[:, :6].min() > 200 and image[:, 10:].max() < 55

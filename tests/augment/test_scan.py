"""One decoding pass over shares of a list: the sums of the shares give
the serial mean image bit for bit, and every unreadable file is found."""
import numpy as np
from PIL import Image

import augment


def test_shares_sum_to_the_serial_mean_and_find_every_bad_file(tmp_path):
    rng = np.random.RandomState(0)
    lines = []
    for i in range(11):
        size = (500, 375) if i % 4 == 0 else (30, 26)
        pixels = rng.randint(0, 256, size[::-1] + (3,)).astype(np.uint8)
        Image.fromarray(pixels).save(tmp_path / '{}.JPEG'.format(i))
        lines.append('{}.JPEG {}\n'.format(i, i % 2))
    whole = (tmp_path / '0.JPEG').read_bytes()
    (tmp_path / 'cut.JPEG').write_bytes(whole[:len(whole) // 4])
    (tmp_path / 'list.txt').write_text(''.join(lines))
    (tmp_path / 'bad.txt').write_text(''.join(
        lines[:3] + ['cut.JPEG 0\n'] + lines[3:] + ['cut.JPEG 1\n']))
    images = augment.read_image_list(str(tmp_path / 'list.txt'),
                                     str(tmp_path))
    serial = augment.compute_mean(augment.ImageListDataset(images,
                                                           resize=32), 28)
    for n_processes, loaderjob in ((1, 0), (3, 0), (2, 2)):
        parts = [augment.scan_images(images, augment.share(
            len(images), n_processes, r), 32, 28, loaderjob)
            for r in range(n_processes)]
        assert sum(len(augment.share(11, n_processes, r))
                   for r in range(n_processes)) == 11
        total = sum(p.total for p in parts)
        count = sum(p.count for p in parts)
        np.testing.assert_array_equal(
            (total / count).astype(np.float32), serial)
        assert not any(p.bad for p in parts)
    bad = augment.read_image_list(str(tmp_path / 'bad.txt'), str(tmp_path))
    parts = [augment.scan_images(bad, augment.share(len(bad), 2, r), 32, 28,
                                 loaderjob=1) for r in range(2)]
    found = sorted(sum((p.bad for p in parts), []))
    assert [index for index, _ in found] == [3, 12]
    assert 'cut.JPEG' in found[0][1] and 'line 4' in found[0][1]
    assert 'line 13' in found[1][1]
    assert sum(p.count for p in parts) == 11

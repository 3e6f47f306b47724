"""A tiny data set laid out as a user's ImageNet copy: JPEG files written
with Pillow in class folders (every fifth one 500x375, the others small),
``train.txt`` / ``val.txt`` lists, and the broken inputs users meet: a
truncated JPEG, a list with a label out of range."""
import json
import os

import numpy

N_TRAIN, N_VAL, N_CLASS = 48, 16, 4
#: Global batch 16 = 8 per process x 2 (1 process) or x 1 (2 processes).
TINY_CONFIG = {
    'global_batch_size': 16, 'epochs': 2, 'alpha_mixup': 0.4,
    'damping': 0.025, 'damping_target': 0.00025, 'rho_bn': 16.0,
    'damping_warmup_steps': 5, 'p_decay': 3.0, 'e_start': 0.5,
    'e_end': 4.0, 'lr': 0.02, 'momentum': 0.9, 'batch_size_per_process': 8,
    'refresh_interval_a': 2, 'n_class': N_CLASS,
}


def _image(rng, label, size):
    """A noisy image whose brightness and a stripe depend on the label."""
    width, height = size
    pixels = rng.rand(height, width, 3) * 60 + label * 45
    pixels[:, label * width // N_CLASS:(label + 1) * width // N_CLASS] += 40
    return numpy.clip(pixels, 0, 255).astype(numpy.uint8)


def build(root):
    """Write the data set under ``root``; return a dict of paths."""
    from PIL import Image
    rng = numpy.random.RandomState(0)
    paths = {'root': str(root)}
    for split, n in (('train', N_TRAIN), ('val', N_VAL)):
        lines = []
        for i in range(n):
            label = i % N_CLASS
            size = (500, 375) if i % 5 == 0 else (24, 20)
            rel = '{}/n{:08d}/{}_{}.JPEG'.format(split, label, split, i)
            os.makedirs(os.path.join(root, os.path.dirname(rel)),
                        exist_ok=True)
            Image.fromarray(_image(rng, label, size)).save(
                os.path.join(root, rel), quality=90)
            lines.append('{} {}\n'.format(rel, label))
        paths[split] = os.path.join(root, split + '.txt')
        with open(paths[split], 'w') as f:
            f.writelines(lines)
    # A JPEG cut short, as a failed copy leaves it.
    with open(os.path.join(root, 'train/n00000000/train_0.JPEG'), 'rb') as f:
        whole = f.read()
    corrupt = 'train/n00000001/corrupt.JPEG'
    with open(os.path.join(root, corrupt), 'wb') as f:
        f.write(whole[:len(whole) // 3])
    with open(paths['train']) as f:
        train_lines = f.readlines()
    paths['train_corrupt'] = os.path.join(root, 'train_corrupt.txt')
    with open(paths['train_corrupt'], 'w') as f:
        f.writelines(train_lines[:5] + [corrupt + ' 1\n'] + train_lines[5:])
    paths['corrupt_line'] = 6
    paths['bad_label'] = os.path.join(root, 'bad_label.txt')
    with open(paths['bad_label'], 'w') as f:
        f.writelines(train_lines[:7] + ['train/n00000003/train_3.JPEG 9\n'] +
                     train_lines[7:])
    paths['config'] = os.path.join(root, 'tiny.json')
    with open(paths['config'], 'w') as f:
        json.dump(TINY_CONFIG, f)
    return paths


def write_config(root, name, **changes):
    """A variant of the tiny config; returns its path."""
    path = os.path.join(root, name)
    with open(path, 'w') as f:
        json.dump(dict(TINY_CONFIG, **changes), f)
    return path

"""Checks shared by the analysis tests."""
import json
import os

import numpy


def assert_picture(path, min_bytes=10000):
    """The PNG exists, is of some size and is not blank."""
    from PIL import Image
    assert os.path.isfile(path), path
    assert os.path.getsize(path) > min_bytes
    with Image.open(path) as image:
        assert image.size[0] > 300 and image.size[1] > 200
        pixels = numpy.asarray(image.convert('L'), dtype=numpy.float64)
    assert pixels.std() > 10          # not a blank canvas
    assert (pixels < 128).mean() > 0.005   # some ink: lines, text


def read_json(path):
    with open(path) as f:
        return json.load(f)


def no_outputs(directory):
    """No PNG (nor temporary file) was written into ``directory``."""
    return [n for n in os.listdir(str(directory))
            if n.endswith('.png') or '.tmp' in n] == []

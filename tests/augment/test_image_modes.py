"""Every PIL mode a data set may hold becomes the RGB image it shows, or is
refused naming the file and the mode: 16-bit grey scaled to 8 bits (not
clipped to white), transparency composited over black (not the colour
hidden under it), CMYK / YCbCr / LAB converted; samples with no defined
white level (32-bit integers, floats) refused, so ``--check-images``
reports them and the data path never trains on a guessed image."""
import numpy as np
import pytest
from PIL import Image

from augment import ImageList, scan_images
from augment.image_list import load_image

#: 16-bit samples and the 8-bit values they show (v · 255 / 65535,
#: rounded); PIL's own convert('RGB') clips all but 0 to 255.
GREY16 = np.array([[0, 1000, 25700, 32768], [40000, 65279, 65534, 65535]],
                  np.uint16)
GREY8 = np.array([[0, 4, 100, 128], [156, 254, 255, 255]], np.uint8)


def rgb(grey):
    return np.stack([grey] * 3)


def save(image, path, **kwargs):
    image.save(str(path), **kwargs)
    return str(path)


def alpha_over_black(colour, alpha):
    return np.round(np.asarray(colour, np.float64) * alpha / 255.0)


def cases(tmp):
    """``{name: (path, expected (3, 2, 4) uint8, PIL mode when opened)}``.
    """
    out = {}
    pixels = np.arange(24, dtype=np.uint8).reshape(2, 4, 3) * 10
    out['RGB'] = (save(Image.fromarray(pixels), tmp / 'rgb.png'),
                  pixels.transpose(2, 0, 1), 'RGB')
    grey = np.array([[0, 50, 100, 150], [200, 250, 255, 1]], np.uint8)
    out['L'] = (save(Image.fromarray(grey), tmp / 'l.png'), rgb(grey), 'L')
    bits = np.array([[0, 1, 1, 0], [1, 0, 0, 1]], bool)
    out['1'] = (save(Image.fromarray(bits), tmp / 'one.png'),
                rgb(bits.astype(np.uint8) * 255), '1')
    palette = Image.fromarray(np.array([[0, 1, 2, 3], [3, 2, 1, 0]],
                                       np.uint8), 'P')
    colours = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (90, 80, 70)]
    palette.putpalette([c for colour in colours for c in colour] * 64)
    index = np.array([[0, 1, 2, 3], [3, 2, 1, 0]])
    expected = np.array(colours, np.uint8)[index].transpose(2, 0, 1)
    out['P'] = (save(palette, tmp / 'p.png'), expected, 'P')
    # Index 3 transparent: shown as black, whatever colour it holds.
    hidden = expected.copy()
    hidden[:, index == 3] = 0
    out['P transparency'] = (save(palette, tmp / 'pt.png', transparency=3),
                             hidden, 'P')
    out['P transparency GIF'] = (save(palette, tmp / 'pt.gif',
                                      transparency=3), hidden, 'P')
    alpha = np.array([[255, 128, 0, 64], [255, 255, 10, 200]], np.uint8)
    la = np.stack([grey, alpha], axis=-1)
    out['LA'] = (save(Image.fromarray(la, 'LA'), tmp / 'la.png'),
                 rgb(alpha_over_black(grey, alpha)), 'LA')
    rgba = np.concatenate([pixels, alpha[..., None]], axis=-1)
    out['RGBA'] = (save(Image.fromarray(rgba, 'RGBA'), tmp / 'rgba.png'),
                   alpha_over_black(pixels, alpha[..., None])
                   .transpose(2, 0, 1), 'RGBA')
    cmyk = Image.new('CMYK', (4, 2), (0, 255, 255, 0))      # red
    cmyk.putpixel((1, 0), (0, 0, 0, 255))                   # black
    cmyk.putpixel((2, 0), (0, 0, 0, 0))                     # white
    expected = np.zeros((3, 2, 4), np.uint8)
    expected[0] = 255
    expected[:, 0, 1] = 0
    expected[:, 0, 2] = 255
    out['CMYK'] = (save(cmyk, tmp / 'cmyk.tif'), expected, 'CMYK')
    out['CMYK JPEG'] = (save(cmyk, tmp / 'cmyk.jpg', quality=100), expected,
                        'CMYK')
    ycbcr = Image.new('YCbCr', (4, 2), (255, 128, 128))     # white
    out['YCbCr'] = (save(ycbcr, tmp / 'ycbcr.tif'),
                    np.full((3, 2, 4), 255, np.uint8), 'YCbCr')
    lab = Image.new('LAB', (4, 2), (255, 128, 128))         # white
    out['LAB'] = (save(lab, tmp / 'lab.tif'),
                  np.full((3, 2, 4), 255, np.uint8), 'LAB')
    out['I;16 PNG'] = (save(Image.fromarray(GREY16), tmp / 'i16.png'),
                       rgb(GREY8), 'I;16')
    out['I;16 TIFF'] = (save(Image.fromarray(GREY16), tmp / 'i16.tif'),
                        rgb(GREY8), 'I;16')
    big_endian = Image.frombytes('I;16B', (4, 2),
                                 GREY16.astype('>u2').tobytes())
    out['I;16B'] = (save(big_endian, tmp / 'i16b.tif'), rgb(GREY8),
                    'I;16B')
    # A 16-bit PGM: PIL opens it as 'I' scaled to 0..65535 (any maxval).
    path = tmp / 'grey16.pgm'
    path.write_bytes(b'P5 4 2 65535\n' + GREY16.astype('>u2').tobytes())
    out['I PGM'] = (str(path), rgb(GREY8), 'I')
    path = tmp / 'grey12.pgm'
    path.write_bytes(b'P5 4 2 4095\n' +
                     (GREY16 // 16).astype('>u2').tobytes())
    out['I PGM 12 bit'] = (str(path), rgb(GREY8), 'I')
    return out


@pytest.fixture(scope='module')
def images(tmp_path_factory):
    return cases(tmp_path_factory.mktemp('modes'))


MODES = ['RGB', 'L', '1', 'P', 'P transparency', 'P transparency GIF', 'LA',
         'RGBA', 'CMYK', 'CMYK JPEG', 'YCbCr', 'LAB', 'I;16 PNG',
         'I;16 TIFF', 'I;16B', 'I PGM', 'I PGM 12 bit']
#: Off by this much at most: JPEG is lossy, LAB -> RGB and PIL's alpha
#: compositing round once more.
TOLERANCE = {'CMYK JPEG': 2, 'LAB': 1, 'LA': 1, 'RGBA': 1}


@pytest.mark.parametrize('name', MODES)
def test_mode_becomes_the_rgb_image_it_shows(images, name):
    path, expected, mode = images[name]
    with Image.open(path) as image:
        assert image.mode == mode       # the case tests what it says
    got = load_image(path)
    assert got.dtype == np.uint8 and got.shape == (3, 2, 4)
    np.testing.assert_allclose(got.astype(int), expected.astype(int),
                               atol=TOLERANCE.get(name, 0))


@pytest.mark.parametrize('name, mode, image', [
    ('i32.tif', 'I', Image.fromarray(np.array([[0, 70000]], np.int32))),
    ('f32.tif', 'F', Image.fromarray(np.array([[0.0, 0.5]], np.float32))),
])
def test_mode_without_a_white_level_refused_naming_file_and_mode(
        tmp_path, name, mode, image):
    path = save(image, tmp_path / name)
    with Image.open(path) as opened:
        assert opened.mode == mode
    with pytest.raises(OSError) as info:
        load_image(path)
    assert path in str(info.value)
    assert "mode '{}'".format(mode) in str(info.value)
    # --check-images (and the mean pass) report it with its list line.
    images = ImageList('list.txt', str(tmp_path), [name], [0], [7])
    result = scan_images(images, [0], resize=2, crop_size=2)
    [(index, message)] = result.bad
    assert index == 0 and 'list.txt, line 7' in message
    assert "mode '{}'".format(mode) in message

"""The documentation's code: the worked example of a Fisher block in
docs/kfac.md (run against per-sample gradients) and the library used from a
script in another directory; the README's word on the demo's SGD schedule
against the harness. The links of every page are checked in
tests/test_docs.py."""
import os
import re
import subprocess
import sys
import textwrap
import types

import numpy
import pytest

import chainer
import chainer.functions as F
import chainer.links as L

import chainerkfac
import config
import train_imagenet
from chainerkfac.fisher_blocks import registry
from harness import run
from tests.chainerkfac import helpers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def readme_python_blocks(section, page='docs/kfac.md'):
    """The ```python blocks of one section of a documentation page (up to
    the next heading of the same or a higher level)."""
    with open(os.path.join(REPO, page), encoding='utf-8') as f:
        text = f.read()
    start = text.index(section)
    level = section.split()[0]
    rest = text[start + len(section):]
    end = re.search(r'^#{1,%d} ' % len(level), rest, re.M)
    body = rest[:end.start()] if end else rest
    return re.findall(r'```python\n(.*?)```', body, re.S)


@pytest.fixture
def readme_block():
    saved = dict(registry._REGISTRY)
    namespace = {}
    for code in readme_python_blocks('## Adding a Fisher block'):
        exec(compile(code, 'docs/kfac.md', 'exec'), namespace)
    yield namespace
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)


class Tagger(chainer.Chain):
    def __init__(self):
        super().__init__()
        with helpers.float64_links(), self.init_scope():
            self.embed = L.EmbedID(5, 3)
            self.fc = L.Linear(3, 4)

    def forward(self, ids):
        return self.fc(F.tanh(self.embed(ids)))


def test_readme_block_is_the_diagonal_fisher_by_oracle(readme_block):
    assert registry.registered_factory(L.EmbedID(2, 2)) is \
        readme_block['EmbedIDDiagonalBlock']
    model = Tagger()
    rng = numpy.random.RandomState(0)
    ids = numpy.array([0, 2, 2, 4, 1, 0], numpy.int32)
    t = rng.randint(0, 4, len(ids)).astype(numpy.int32)
    damping = 1e-2
    optimizer = helpers.kfac(lr=1.0, momentum=0.0, damping=damping)
    optimizer.setup(model)
    assert helpers.block_named(optimizer, '/embed').kind == \
        'EmbedID (diagonal)'
    expected = helpers.diagonal_fisher_step(model, model.embed.W, ids, t,
                                            damping)
    optimizer.update(helpers.loss_of(model), ids, t)
    # Rows of ids absent from the batch become w - γw/γ, zero up to
    # rounding: an absolute tolerance too. Measured over 200 initial
    # weights: 1.0e-15 of the largest entry, 6.4e-13 relative elsewhere.
    numpy.testing.assert_allclose(model.embed.W.array, expected, rtol=1e-11,
                                  atol=1e-14 * abs(expected).max())


def test_library_imports_from_a_script_in_another_directory(tmp_path):
    """The installed library (``pip install -e .``, done by the Makefile)
    from a user's script elsewhere, with the README's swap line and a stock
    model: it trains, and the harness folders are not on the path."""
    script = tmp_path / 'user_script.py'
    script.write_text(textwrap.dedent('''
        import numpy
        import chainerkfac
        import chainer
        import chainer.links as L
        model = L.Classifier(chainer.Sequential(
            L.Linear(None, 16), chainer.functions.relu, L.Linear(None, 3)))
        optimizer = chainerkfac.optimizers.KFAC(lr=0.01, momentum=0.9,
                                                damping=1e-2)
        optimizer.setup(model)
        x = numpy.random.rand(8, 5).astype(numpy.float32)
        t = numpy.arange(8, dtype=numpy.int32) % 3
        for _ in range(3):
            optimizer.update(model, x, t)
        try:
            import models  # noqa: F401  (the harness is not installed)
            print('HARNESS IMPORTABLE')
        except ImportError:
            pass
        print('version', chainerkfac.__version__, 'steps', optimizer.t)
    '''))
    env = {k: v for k, v in os.environ.items() if k != 'PYTHONPATH'}
    proc = subprocess.run([sys.executable, str(script)], cwd=str(tmp_path),
                          env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert 'version {} steps 3'.format(chainerkfac.__version__) in \
        proc.stdout
    assert 'K-FAC registration' in proc.stdout     # shown by default
    assert 'HARNESS IMPORTABLE' not in proc.stdout


def test_readme_demo_sgd_has_no_warm_up_as_the_harness():
    """The demo's momentum SGD (global batch 256): the Goyal et al. warm-up
    of harness/run.py starts at the rate it warms up to, so the README
    says there is none."""
    args = train_imagenet.parse_args(['--demo'])
    args.warmup_epochs = 1.0                              # as demo.py sets
    cfg = config.load(os.path.join(REPO, 'config', 'demo.json'))
    _, schedule = run.build_optimizer(
        'sgd', cfg, types.SimpleNamespace(rank=0, size=1), 1, args,
        use_graphs=True)
    assert [schedule.values(e)['lr'] for e in (0, 0.5, 1)] == [0.1] * 3
    with open(os.path.join(REPO, 'README.md'), encoding='utf-8') as f:
        text = f.read()
    demo = text[text.index('## The demo'):text.index('## The systems')]
    sentence = demo[demo.index('Momentum SGD here'):]
    assert 'no warm-up' in sentence and 'with warm-up' not in sentence


def test_the_gpu_table_is_what_its_command_prints_of_the_results():
    """The README's GPU table is ``python -m benchmarks.gpu_table`` of the
    stored results it names (braces as bash expands them), cell for cell."""
    from benchmarks import gpu_table
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, 'README.md')) as f:
        text = f.read()
    command = re.search(r'`python -m benchmarks\.gpu_table\s+([^`]+)`',
                        text).group(1)
    stem, names, suffix = re.fullmatch(r'(\S*)\{([^}]*)\}(\S*)',
                                       command.strip()).groups()
    paths = [os.path.join(root, stem + name + suffix)
             for name in names.split(',')]
    printed = gpu_table.table(gpu_table.merge(paths)).split('\n\n')[0]
    start = text.index('| images/s | ours, b32')
    shown = text[start:text.index('\n\n', start)]
    assert shown == printed

"""The documentation's links: every relative link and image of every
Markdown page in the repository points at a file that exists and, where it
names an anchor, at a heading of that page (GitHub's anchor rules). The
README stays a landing page."""
import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Pages not written by this project (none today; vendored files would go
#: here).
_SKIP = ('.venv', '.venv-np2', '.git', 'demo_out', 'result', '.cache')

_LINK = re.compile(r'!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')
_FENCE = re.compile(r'^(```|~~~).*?^\1', re.S | re.M)
_CODE = re.compile(r'`[^`\n]*`')


def markdown_pages():
    pages = []
    for path in glob.glob(os.path.join(REPO, '**', '*.md'), recursive=True):
        rel = os.path.relpath(path, REPO)
        if rel.split(os.sep)[0] in _SKIP:
            continue
        pages.append(rel)
    return sorted(pages)


def github_anchor(heading):
    """The anchor GitHub gives a heading: lower case, punctuation other
    than ``-`` and ``_`` dropped, each space a hyphen."""
    text = re.sub(r'`([^`]*)`', r'\1', heading.strip())
    text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', text)
    text = text.lower()
    text = ''.join(c for c in text
                   if c.isalnum() or c in ' -_')
    return text.replace(' ', '-')


def anchors_of(path):
    with open(path, encoding='utf-8') as f:
        text = _FENCE.sub('', f.read())
    seen = {}
    anchors = set()
    for match in re.finditer(r'^#{1,6} +(.+?) *#* *$', text, re.M):
        anchor = github_anchor(match.group(1))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        anchors.add(anchor if count == 0 else '{}-{}'.format(anchor, count))
    return anchors


def broken_links(page, root=REPO):
    """``(target, reason)`` for each relative link of ``page`` (a path
    relative to ``root``) that does not resolve."""
    path = os.path.join(root, page)
    with open(path, encoding='utf-8') as f:
        text = _CODE.sub('', _FENCE.sub('', f.read()))
    broken = []
    for match in _LINK.finditer(text):
        target = match.group(1)
        if re.match(r'^[a-z][a-z0-9+.-]*:', target):    # http:, mailto:
            continue
        file_part, _, anchor = target.partition('#')
        resolved = os.path.normpath(
            os.path.join(os.path.dirname(path), file_part)) if file_part \
            else path
        if not os.path.exists(resolved):
            broken.append((target, 'no such file'))
            continue
        if anchor and resolved.endswith('.md') and \
                anchor not in anchors_of(resolved):
            broken.append((target, 'no heading with this anchor'))
    return broken


@pytest.mark.parametrize('page', markdown_pages())
def test_every_relative_link_resolves(page):
    assert broken_links(page) == [], page


def test_the_checker_finds_a_broken_link_and_anchor(tmp_path):
    (tmp_path / 'a.md').write_text(
        '# Title\n\n## Two words\n\n[ok](b.md#a-heading) [ok](#two-words) '
        '[missing](c.md) [bad anchor](b.md#nowhere) '
        '![img](pic.png) `[in code](nowhere.md)`\n\n'
        '```\n[in a block](nowhere.md)\n```\n')
    (tmp_path / 'b.md').write_text('# A heading\n')
    (tmp_path / 'pic.png').write_bytes(b'')
    assert broken_links('a.md', root=str(tmp_path)) == [
        ('c.md', 'no such file'),
        ('b.md#nowhere', 'no heading with this anchor')]


def test_github_anchors():
    assert github_anchor('cuDNN 9 for Chainer on CuPy 14') == \
        'cudnn-9-for-chainer-on-cupy-14'
    assert github_anchor('Curvature quantities (BackPACK for Chainer)') == \
        'curvature-quantities-backpack-for-chainer'
    assert github_anchor('`KFAC` options, eq. (20)') == \
        'kfac-options-eq-20'


def test_readme_is_a_landing_page():
    """What this is, the two commands, the swap, links onward: the
    reference lives in docs/."""
    with open(os.path.join(REPO, 'README.md'), encoding='utf-8') as f:
        text = f.read()
    assert text.count('\n') <= 250
    for needed in ('make demo', 'make test', 'optimizers.KFAC(',
                   'mpiexec', 'docs/kfac.md', 'docs/imagenet.md',
                   'docs/gpu.md', 'docs/curvature.md',
                   'docs/layer_parallel.md', 'docs/benchmarks.md',
                   'docs/tests.md', 'docs/figures.md'):
        assert needed in text, needed

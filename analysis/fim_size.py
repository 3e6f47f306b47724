"""Figure 4: data size of the FIM per process, by layer type.

    python -m analysis.fim_size --model resnet50 [--packed] [--out FILE.png]

The sizes come from the model's links through the Fisher blocks the
optimizer registers (:func:`chainerkfac.fisher_blocks.build_blocks`), once
with the full BN Fisher ("no approx") and once with the diagonal one
("diagonal FIM BN"). Counting rule, which gives the paper's numbers for
ResNet-50 (1000 classes) — 1017 MiB and 587 MiB, 107 K-FAC layers:

* Conv2D and Linear (K-FAC): both Kronecker factors in full,
  ``A`` of ``(C_in·k_h·k_w + b)²`` and ``G`` of ``d_out²`` elements, where
  ``b = 1`` if the layer has a bias (the bias column of ``A``; the FC layer
  has one, ResNet convolutions have none);
* BatchNormalization: the Fisher of (γ, β), ``(2C)²`` elements (full) or
  ``2C`` (diagonal);
* 4 bytes per element (fp32), MiB = 2²⁰ bytes; one copy of each factor, as
  every process holds them (the damped inverses, stored beside them, are not
  counted, as in the paper).

ResNet-50: Conv 567.07 + FC 19.83 + BN 430.44 = 1017.33 MiB, and with the
diagonal BN Fisher (0.20 MiB) 587.10 MiB. The FC bias column changes the
total by 0.016 MiB only; megabytes of 10⁶ bytes would give 1067 / 616.

``--packed`` adds the sizes of symmetric factors as upper triangles
(``n(n+1)/2``), the form in which they travel in ReduceScatterV.
"""
import argparse
from typing import Dict, List, Sequence

from analysis import _io, _models
from chainerkfac.fisher_blocks import (BatchNormalizationBlock,
                                       Convolution2DBlock, LinearBlock)

BYTES_PER_ELEMENT = 4   # fp32
MIB = 2 ** 20
CONV, FC, BN = 'Conv (K-FAC)', 'FC (K-FAC)', 'BN'
CATEGORIES = (CONV, FC, BN)
#: (label, bn_fisher mode) of the two bars of Figure 4.
VARIANTS = (('no approx', 'full'), ('diagonal FIM BN', 'diag'))


def category_of(block) -> str:
    """Figure 4's layer type of a Fisher block (its ``kind`` for others)."""
    if isinstance(block, Convolution2DBlock):
        return CONV
    if isinstance(block, LinearBlock):
        return FC
    if isinstance(block, BatchNormalizationBlock):
        return BN
    return block.kind


def factor_elements(block, packed: bool = False) -> int:
    """Elements of all factors of ``block``; symmetric ones as triangles
    when ``packed``."""
    total = 0
    for name, shape in block.factor_shapes().items():
        if packed and block.symmetric(name):
            total += shape[0] * (shape[0] + 1) // 2
        else:
            n = 1
            for d in shape:
                n *= int(d)
            total += n
    return total


def sizes_by_category(blocks: Sequence, packed: bool = False
                      ) -> Dict[str, float]:
    """MiB per layer type (fp32) and ``'total'``; every type of
    :data:`CATEGORIES` is present, zero if the model has none."""
    sizes = dict.fromkeys(CATEGORIES, 0.0)
    for block in blocks:
        if block.factor_names:
            category = category_of(block)
            sizes[category] = sizes.get(category, 0.0) + factor_elements(
                block, packed) * BYTES_PER_ELEMENT / MIB
    sizes['total'] = sum(sizes.values())
    return sizes


def layer_counts(blocks: Sequence) -> Dict[str, int]:
    """K-FAC layers per type (blocks with factors) and ``'total'``."""
    counts = dict.fromkeys(CATEGORIES, 0)
    for block in blocks:
        if block.factor_names:
            category = category_of(block)
            counts[category] = counts.get(category, 0) + 1
    counts['total'] = sum(counts.values())
    return counts


def fim_sizes(model, packed: bool = False) -> Dict:
    """Figure 4's numbers for a model (a :class:`chainer.Link`).

    Returns
    -------
    dict
        ``{"layers": {type: count, "total": n}, "unit": "MiB",
        "bytes_per_element": 4, "variants": {label: {type: MiB, "total":
        MiB}}}``; with ``packed`` also the ``label + " (packed)"`` variants.
    """
    variants = {}
    counts = None
    for label, mode in VARIANTS:
        blocks = _models.kfac_blocks(model, mode)
        counts = counts or layer_counts(blocks)
        variants[label] = sizes_by_category(blocks)
        if packed:
            variants[label + ' (packed)'] = sizes_by_category(blocks, True)
    return {'layers': counts, 'unit': 'MiB',
            'bytes_per_element': BYTES_PER_ELEMENT, 'variants': variants}


def format_table(result: Dict, title: str) -> str:
    columns = [c for c in result['layers'] if c != 'total']
    counts = result['layers']
    lines = [title,
             'K-FAC layers: {} ({})'.format(counts['total'], ', '.join(
                 '{} {}'.format(c, counts[c]) for c in columns)),
             '{:<28}'.format('variant') + ''.join(
                 '{:>14}'.format(c) for c in columns + ['total'])]
    # Two decimals for ResNet-50-size models, more for small ones.
    largest = max(s['total'] for s in result['variants'].values())
    cell = '{:>14.2f}' if largest >= 10 else '{:>14.5f}'
    for label, sizes in result['variants'].items():
        lines.append('{:<28}'.format(label) + ''.join(
            cell.format(sizes.get(c, 0.0)) for c in columns + ['total']))
    return '\n'.join(lines)


def plot(result: Dict, title: str):
    """Horizontal stacked bars, one per variant, first at the top."""
    labels: List[str] = list(result['variants'])
    columns = [c for c in result['layers'] if c != 'total']
    figure = _io.new_figure(figsize=(9.5, 1.2 + 0.7 * len(labels)))
    ax = figure.add_subplot(1, 1, 1)
    rows = range(len(labels))[::-1]
    left = [0.0] * len(labels)
    colors = {CONV: 'tab:blue', FC: 'tab:orange', BN: 'tab:green'}
    for column in columns:
        widths = [result['variants'][label].get(column, 0.0)
                  for label in labels]
        ax.barh(list(rows), widths, left=left, height=0.6, label=column,
                color=colors.get(column))
        left = [a + b for a, b in zip(left, widths)]
    for row, total in zip(rows, left):
        text = ('{:.0f}' if total >= 100 else '{:.3g}').format(total)
        ax.text(total, row, ' {} MiB'.format(text), va='center')
    ax.set_yticks(list(rows))
    ax.set_yticklabels(labels)
    ax.set_xlim(0, max(left) * 1.18 if max(left) > 0 else 1)
    ax.set_xlabel('Data size of FIM [MiB]')
    ax.set_ylabel('BN Fisher')
    ax.set_title(title, fontsize=10)
    ax.legend(loc='upper left', bbox_to_anchor=(1.01, 1.0), fontsize=8)
    figure.tight_layout()
    return figure


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m analysis.fim_size',
        description='Figure 4: data size of the FIM per process, by layer '
        'type, for the full and the diagonal BN Fisher.')
    parser.add_argument('--model', default='resnet50',
                        help='one of {} (default resnet50)'.format(
                            ', '.join(_models.ARCHS)))
    parser.add_argument('--n-class', type=int, default=None,
                        help='output classes (default 1000 for the '
                        'ResNet-50s, 10 for small)')
    parser.add_argument('--depth', type=int, default=8,
                        help='depth of --model small (6n+2)')
    parser.add_argument('--width', type=int, default=16,
                        help='width of --model small')
    parser.add_argument('--packed', action='store_true',
                        help='also show sizes with symmetric factors packed '
                        'as upper triangles')
    parser.add_argument('--out', default=None,
                        help='PNG path (default fig4_fim_size_MODEL.png); '
                        'the numbers go to the same name with .json')
    return parser.parse_args(argv)


@_io.cli('fim_size')
def main(argv=None):
    """Print and plot Figure 4 for ``--model``."""
    args = parse_args(argv)
    out = args.out or 'fig4_fim_size_{}.png'.format(args.model)
    _io.check_outputs(out, [])
    model = _models.build_model(args.model, args.n_class, args.depth,
                                args.width)
    result = fim_sizes(model, args.packed)
    if result['layers']['total'] == 0:
        raise _io.AnalysisError('model {!r} has no K-FAC layers'.format(
            args.model))
    result['model'] = args.model
    title = ('Figure 4: data size of FIM per process, {} (fp32, {} K-FAC '
             'layers)'.format(args.model, result['layers']['total']))
    json_path = _io.save_outputs(plot(result, title), out, result)
    print(format_table(result, title + ' [MiB]'))
    print('wrote {} and {}'.format(out, json_path))
    return 0


if __name__ == '__main__':
    raise SystemExit(main())

"""The preconditioned gradient's error against float64 when K-FAC's stage 5
runs in lower precision, on real factors (issue 26: "lower precision where
the damped factor's conditioning allows").

    python -m benchmarks.inverse_precision [--smoke] [--models small,resnet50]
        [--threads 1] [--out result/inverse_precision.json]

One every-step K-FAC step captures the factors (A, G) and gradients of
every Kronecker block of a model. For each block with both factors full,
the damping is split as the optimizer splits it (trace norm, eq. 14) and
the reference ``G⁻¹ ∇W A⁻¹`` is computed in float64 (``numpy.linalg.inv``
of the float64 damped factors). Then the same product with:

* ``fp32``: the inverses by the library's float32 Cholesky
  (:func:`chainerkfac.linalg.damped_inverses`), the two GEMMs in float32
  (today's path);
* ``tf32``: those inverses, the GEMMs' operands rounded to TF32 (10-bit
  mantissa, round to nearest even) and accumulated in float32: Tensor-Core
  GEMMs with ``CUPY_TF32=1``;
* ``fp16``: those inverses and the gradient scaled by their largest
  magnitude into float16, the GEMMs with float32 accumulation and a
  float16 result (:func:`chainerkfac.linalg.half_matmul`, the library's
  NumPy twin of the GPU's fp16 GEMM), rescaled.

And, stage 5 in float32, with other factors: ``tf32 factors``, those of
the same step built from TF32 products (``KFAC(factor_dtype='tf32')``,
the GPU's Tensor Cores for the capture GEMMs, twinned on the CPU); and, to
scale them, ``another batch``: the exact factors of another mini-batch of
the same size on the same weights, the change that the factors' sampling
makes anyway (the paper's eq. 21 between two batches).

The error of a block is ``‖P − P₆₄‖_F / ‖P₆₄‖_F``; the report gives, per
precision, its median, 90th percentile and largest over the blocks, the
block of the largest with the condition numbers κ of its damped factors,
and the largest error among the blocks whose ``κ_A κ_G`` is below each of
a few bounds (where a lower precision would be safe). Rounding is
emulated on the CPU; the GPU's own kernels round the same way but for the
order of their sums. Reported, not asserted, and no default changes on it.
"""
import argparse
import math
import sys
from typing import Dict, List

import chainerkfac  # NOQA  (before chainer: NumPy-2 compatibility shims)
import numpy

from benchmarks import _args
from benchmarks import _common
from benchmarks.step_time import FULL, SMOKE, KFACStep, _batch, build_model
from chainerkfac import linalg
from chainerkfac.fisher_blocks import kronecker

PRECISIONS = ('fp32', 'tf32', 'fp16')
#: The factors changed instead of stage 5's arithmetic (float32 inverses
#: and GEMMs): built from TF32 products (``factor_dtype='tf32'``), and,
#: for scale, the exact factors of another mini-batch of the same size
#: (what the factors' own sampling changes).
FACTOR_VARIANTS = ('tf32 factors', 'another batch')
#: Bounds on κ_A κ_G for the "where conditioning allows" columns.
KAPPA_BOUNDS = (1e2, 1e4, 1e6)


def _half_product(a, b):
    """``a @ b`` from float16 operands scaled into range, float32
    accumulation, float16 result, rescaled (float32)."""
    scale_a = float(numpy.abs(a).max()) or 1.0
    scale_b = float(numpy.abs(b).max()) or 1.0
    product = linalg.half_matmul((a / scale_a).astype(numpy.float16),
                                 (b / scale_b).astype(numpy.float16))
    return product.astype(numpy.float32) * numpy.float32(scale_a * scale_b)


def _products(g_inv, matrix, a_inv) -> Dict[str, numpy.ndarray]:
    g_inv, matrix, a_inv = (x.astype(numpy.float32) for x in
                            (g_inv, matrix, a_inv))
    tf32 = linalg.tf32_matmul(linalg.tf32_matmul(g_inv, matrix), a_inv)
    return {'fp32': g_inv.dot(matrix).dot(a_inv),
            'tf32': tf32,
            'fp16': _half_product(_half_product(g_inv, matrix), a_inv)}


def _kappa(matrix) -> float:
    values = numpy.linalg.eigvalsh(matrix)
    return float(values[-1] / values[0]) if values[0] > 0 else math.inf


def block_errors(optimizer, others: Dict = None) -> List[Dict]:
    """Per Kronecker block with full A and G: the condition numbers of
    the damped factors and each precision's relative error; with
    ``others`` (name -> an optimizer of the same model after its own step),
    also the error of the float32 product that takes that optimizer's
    factors instead (the same gradient, damping split alike)."""
    others = others or {}
    out = []
    for block in optimizer.blocks:
        if not isinstance(block, kronecker.KroneckerBlock) or \
                not block.has_inverses() or block.diagonal:
            continue
        a, g = block.factors['A'], block.factors['G']
        damping = optimizer.damping * block.damping_scale(optimizer.rho_bn)
        damping_a, damping_g = block.trace_split(a, g, damping)
        a64 = a.astype(numpy.float64) + damping_a * numpy.eye(len(a))
        g64 = g.astype(numpy.float64) + damping_g * numpy.eye(len(g))
        grads = [p.grad for p in block.params]
        matrix = grads[0].reshape(block.out_size, -1)
        if block.has_bias:
            matrix = numpy.concatenate([matrix, grads[1][:, None]], axis=1)
        reference = numpy.linalg.inv(g64).dot(
            matrix.astype(numpy.float64)).dot(numpy.linalg.inv(a64))
        inverses = _float32_inverses(a, g, damping_a, damping_g)
        if inverses is None:
            continue
        norm = numpy.linalg.norm(reference)
        errors = {name: float(numpy.linalg.norm(product - reference) / norm)
                  for name, product in _products(
                      inverses[1], matrix, inverses[0]).items()}
        for name, other in others.items():
            product = _other_factors_product(other, block.name, damping,
                                             matrix)
            if product is not None:
                errors[name] = float(
                    numpy.linalg.norm(product - reference) / norm)
        out.append({'block': block.name, 'n_a': len(a), 'n_g': len(g),
                    'kappa_a': _kappa(a64), 'kappa_g': _kappa(g64),
                    'errors': errors})
    return out


def _other_factors_product(optimizer, name: str, damping: float, matrix):
    """``G⁻¹ ∇W A⁻¹`` in float32 from the factors of ``optimizer``'s block
    ``name`` (damping split by their own traces), None where a damped
    factor is not positive definite in float32."""
    block = next(b for b in optimizer.blocks if b.name == name)
    a, g = block.factors['A'], block.factors['G']
    inverses = _float32_inverses(a, g, *block.trace_split(a, g, damping))
    if inverses is None:
        return None
    return _products(inverses[1], matrix, inverses[0])['fp32']


def _float32_inverses(a, g, damping_a: float, damping_g: float):
    """``((A + d_A I)⁻¹, (G + d_G I)⁻¹)`` by the library's float32
    Cholesky, one try (no damping raised); None where either fails."""
    results = linalg.damped_inverses(
        [a.astype(numpy.float32), g.astype(numpy.float32)],
        [damping_a, damping_g], max_tries=1)
    if any(r.inverse is None for r in results):
        return None
    return tuple(r.inverse for r in results)


def summarise(blocks: List[Dict]) -> Dict[str, Dict]:
    summary = {}
    names = [n for n in PRECISIONS + FACTOR_VARIANTS
             if all(n in b['errors'] for b in blocks)]
    for name in names:
        errors = numpy.array([b['errors'][name] for b in blocks])
        worst = blocks[int(errors.argmax())]
        within = {}
        for bound in KAPPA_BOUNDS:
            chosen = [b['errors'][name] for b in blocks
                      if b['kappa_a'] * b['kappa_g'] < bound]
            within['{:g}'.format(bound)] = (max(chosen) if chosen
                                            else None)
        summary[name] = {
            'median': float(numpy.median(errors)),
            'p90': float(numpy.percentile(errors, 90)),
            'max': float(errors.max()), 'worst_block': worst['block'],
            'worst_kappa_a': worst['kappa_a'],
            'worst_kappa_g': worst['kappa_g'],
            'max_below_kappa': within}
    return summary


def table(results: Dict[str, Dict]) -> str:
    rows = []
    for model, result in results.items():
        for name, s in result['summary'].items():
            rows.append([model, name, s['median'], s['p90'], s['max'],
                         '{} (κ_A {:.3g}, κ_G {:.3g})'.format(
                             s['worst_block'], s['worst_kappa_a'],
                             s['worst_kappa_g'])] +
                        [s['max_below_kappa'][k] for k in sorted(
                            s['max_below_kappa'], key=float)])
    return ("The preconditioned gradient's relative error against float64 "
            '(Frobenius), over the Kronecker blocks\n' + _common.format_table(
                ['model', 'precision', 'median', 'p90', 'max', 'worst block'] +
                ['max, κ_Aκ_G < {:g}'.format(b) for b in KAPPA_BOUNDS],
                rows))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m benchmarks.inverse_precision', description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--smoke', action='store_true',
                        help='a tiny model, for the tests')
    parser.add_argument('--models', default=None,
                        help='comma-separated subset of {} (default: all)'
                        .format(','.join(FULL)))
    parser.add_argument('--threads', type=_args.positive_int, default=1,
                        help='BLAS threads')
    parser.add_argument('--out', default='result/inverse_precision.json',
                        help='JSON output (default: %(default)s)')
    args = parser.parse_args(argv)
    specs = SMOKE if args.smoke else FULL
    unknown = [n for n in (args.models or '').split(',')
               if n and n not in specs]
    if unknown:
        parser.error('--models: unknown {}; choose from {}'.format(
            ', '.join(unknown), ', '.join(specs)))
    _args.check_paths(parser, args)
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    specs = SMOKE if args.smoke else FULL
    names = args.models.split(',') if args.models else list(specs)
    unknown = [n for n in names if n not in specs]
    if unknown:
        raise SystemExit('unknown model(s) {}; choose from {}'.format(
            ', '.join(unknown), ', '.join(specs)))
    data = _common.header('inverse_precision', argv)
    data['results'] = {}
    with _common.limit_blas_threads(args.threads):
        for name in names:
            spec = specs[name]
            print('capturing the factors of {} (batch {})...'.format(
                name, spec['batch']), flush=True)
            x, t = _batch(spec, numpy)
            step = KFACStep(build_model(spec['arch'], spec['kwargs']), 1,
                            False)
            step(x, t)
            # the same weights (build_model seeds them) and batch, TF32
            # products; then the same weights on another batch
            tf32 = KFACStep(build_model(spec['arch'], spec['kwargs']), 1,
                            False, factor_dtype='tf32')
            tf32(x, t)
            other = KFACStep(build_model(spec['arch'], spec['kwargs']), 1,
                             False)
            other(*_batch(spec, numpy, seed=2))
            blocks = block_errors(step.optimizer, {
                'tf32 factors': tf32.optimizer,
                'another batch': other.optimizer})
            data['results'][name] = {'batch': spec['batch'],
                                     'blocks': blocks,
                                     'summary': summarise(blocks)}
    text = table(data['results'])
    print(_common.describe_machine(data))
    print(text)
    _common.write_json(args.out, data)
    print('wrote {}'.format(args.out))
    return 0


if __name__ == '__main__':
    sys.exit(main())

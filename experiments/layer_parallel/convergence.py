"""Fig. 4: MGRIT residual histories of the state and adjoint solves against
the number of layers, on Peaks and on the digits.

    python -m experiments.layer_parallel.convergence
        [--layers 64,128,256,512,1024,2048] [--cases peaks,digits]
        [--weights smooth,independent] [--iterations 15] [--coarsening 4]
        [--relax FCF] [--batch B] [--out DIR]

For every case, initial weights and depth N: the seed's network with fixed
weights (as in the seed's section 5.2), one batch (Peaks: s = 5000;
digits: 50 images), one forward and one adjoint MGRIT solve from zero
states with c = 4, FCF-relaxation and as many levels as leave at least 2
coarse steps, ``--iterations`` iterations each. Two kinds of weights:
``smooth`` in the layer index (the regime the seed's time-derivative
regularisation keeps training in) and ``independent`` draws per layer
(white noise in t: the coarse levels' injected weights then stand for
their layers worst). The histories do not depend on the number of
processes (the tests check them bitwise on 1-4), so one process computes
them.

Writes ``fig4_convergence.png`` (relative residual against iteration,
N = 256 and 2048 bold) and ``fig4_convergence.json`` (every history, and
the V-cycles to a drop of 10⁻⁵, the goal being at most 12 for every N).
Indian Pines (the seed's third case) is not shipped and is not run.
"""
import sys
import time

from chainerkfac import layer_parallel as lp
from benchmarks import _args
from benchmarks import _common
from experiments.layer_parallel import common

#: Relative residual drop of the goal (and of the seed's Fig. 4, 5 orders).
DROP = 1e-5
HIGHLIGHT = (256, 2048)


def run(case: str, weights: str, n_layers: int, iterations: int,
        coarsening: int, relax: str, batch: int = None) -> dict:
    net = common.make_net(case, n_layers, weights)
    x, t = common.make_batch(case, batch)
    mgrit = lp.MGRIT(net, coarsening=coarsening, relax=relax, tol=0.0,
                     max_iter=iterations, warm_start=False)
    net.cleargrads()
    begin = time.perf_counter()
    _, state = mgrit.forward(x)
    _, adjoint = mgrit.backward(t)
    return {
        'layers': n_layers, 'batch': len(x),
        'levels': [layout.steps for layout in mgrit.forward_solver.layouts],
        'state': state, 'adjoint': adjoint,
        'state_iterations': common.iterations_to(state, DROP),
        'adjoint_iterations': common.iterations_to(adjoint, DROP),
        'seconds': time.perf_counter() - begin,
    }


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    panels = [(case, weights) for case in results
              for weights in results[case]]
    fig, axes = plt.subplots(len(panels), 2, figsize=(10, 3.3 * len(panels)),
                             squeeze=False)
    for row, (case, weights) in enumerate(panels):
        for col, kind in enumerate(('state', 'adjoint')):
            ax = axes[row][col]
            for entry in results[case][weights]:
                history = entry[kind]
                relative = [value / history[0] for value in history]
                bold = entry['layers'] in HIGHLIGHT
                ax.semilogy(range(len(relative)), relative,
                            marker='o' if bold else None, ms=3,
                            lw=2 if bold else 0.8, alpha=1 if bold else 0.5,
                            label='N = {}'.format(entry['layers']))
            ax.axhline(DROP, color='grey', ls=':', lw=1)
            ax.set_title('{}, {} weights: {} residual'.format(
                case, weights, kind))
            ax.set_xlabel('MGRIT iteration')
            ax.set_ylabel('residual / first residual')
            ax.grid(True, which='major', alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle('Fig. 4: MGRIT convergence, c = 4, FCF (one process)')
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def v_cycles(count, iterations: int) -> str:
    """V-cycles to the drop in words: ``count`` None means the drop was
    not reached within the ``iterations`` run."""
    if count is None:
        return 'not reached in {} iterations'.format(iterations)
    return str(count)


def main(argv=None):
    parser = _common.argument_parser(
        'experiments.layer_parallel.convergence', __doc__)
    parser.add_argument('--layers', type=_args.int_list(2),
                        default='64,128,256,512,1024,2048',
                        help='comma-separated layer counts N (default: '
                        '%(default)s)')
    parser.add_argument('--cases', type=_args.names(list(common.CASES)),
                        default='peaks,digits',
                        help='comma-separated, of {} (default: '
                        '%(default)s)'.format(', '.join(common.CASES)))
    parser.add_argument('--weights', type=_args.names(common.WEIGHTS),
                        default='smooth,independent',
                        help='comma-separated, of {}: weights smooth in '
                        'the layer index or drawn per layer (default: '
                        '%(default)s)'.format(', '.join(common.WEIGHTS)))
    parser.add_argument('--iterations', type=_args.positive_int, default=15,
                        help='MGRIT iterations of each solve, run in full '
                        '(default: %(default)s)')
    parser.add_argument('--coarsening', type=_args.at_least(2), default=4,
                        help='coarsening factor (default: %(default)s)')
    parser.add_argument('--relax', default='FCF', choices=('F', 'FCF'),
                        help='relaxation (default: %(default)s)')
    parser.add_argument('--batch', type=_args.positive_int, default=None,
                        help="inputs per solve (default: the case's)")
    parser.add_argument('--out', default=common.RESULTS,
                        help='folder of fig4_convergence.json and its PNG '
                        '(default: %(default)s, the committed results, '
                        'which a run replaces)')
    args = parser.parse_args(argv)
    _args.check_paths(parser, args, files=(), folders=('out',))
    common.setup_logging()
    layers, cases = args.layers, args.cases
    results = {case: {weights: [] for weights in args.weights}
               for case in cases}
    for case in cases:
        for weights in results[case]:
            for n_layers in layers:
                entry = run(case, weights, n_layers, args.iterations,
                            args.coarsening, args.relax, args.batch)
                results[case][weights].append(entry)
                common.logger.info(
                    '%-6s %-11s N=%5d levels %-28s V-cycles to 1e-5: state '
                    '%s, adjoint %s  (%.1f s)', case, weights, n_layers,
                    entry['levels'],
                    v_cycles(entry['state_iterations'], args.iterations),
                    v_cycles(entry['adjoint_iterations'], args.iterations),
                    entry['seconds'])
    worst = max((entry[kind] for by_weights in results.values()
                 for entries in by_weights.values() for entry in entries
                 for kind in ('state_iterations', 'adjoint_iterations')),
                key=lambda k: float('inf') if k is None else k)
    payload = common.header('convergence', sys.argv[1:] if argv is None
                            else argv)
    payload.update(drop=DROP, coarsening=args.coarsening, relax=args.relax,
                   results=results, worst_iterations=worst,
                   goal='at most 12 V-cycles to 1e-5 for every N')
    stem = '{}/fig4_convergence'.format(args.out)
    common.write_json(stem + '.json', payload)
    plot(results, stem + '.png')
    common.logger.info('most V-cycles to 1e-5: %s (goal <= 12); wrote %s'
                       '.png and .json', v_cycles(worst, args.iterations),
                       stem)


if __name__ == '__main__':
    main()

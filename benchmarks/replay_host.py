"""The host's work around a replayed CUDA-graph step: what
:class:`chainerkfac.graphs.StepGraph` asks of its optimizer adapter at
every step, timed on the CPU (no GPU is needed: the adapters are Python).

    python -m benchmarks.replay_host [--smoke] [--out FILE.json]
        [--repeats 200]

A replayed step launches one graph; before the launch the adapter writes
the hyperparameters to the device and binds new rules to them
(``before_step``), says whether the step may be replayed (``refusal``) and
which host values the graph holds (``baked``); after it, it does the
step's host bookkeeping (``after_replay``). What comes before the launch
is on the step's critical path wherever the loop waits for the previous
step (the benchmarks synchronise every step; the harness reads the
skipped-step flag before the next step): at ResNet-50's replayed step of
about 20 ms (batch 32, H200) each 0.2 ms is 1 %.

For ResNet-50 (161 parameters; ``--smoke``: the small ResNet) and each
adapter as :func:`chainerkfac.graphs.graphed` makes it (momentum SGD with
weight decay and its hyperparameters on the device; K-FAC at its
defaults, refresh interval 20, after a refresh step), the median
milliseconds of each call over ``--repeats`` steps (the pre-launch calls
in a step's order, each repeat a new step), and of the three together.
"""
import sys
import time
from typing import Callable, Dict

import chainerkfac  # NOQA  (first: NumPy-2 shims before chainer loads)

import numpy

from chainer import optimizer_hooks

from benchmarks import _args
from benchmarks import _common
from chainerkfac import graphs
from chainerkfac.graphs import kfac_step
from chainerkfac.optimizers import KFAC, FusedMomentumSGD

MODELS = {'resnet50': ('resnet50', {}, 224),
          'small': ('small', {'depth': 8, 'width': 8, 'n_class': 10}, 32)}
PRE_LAUNCH = ('before_step', 'refusal', 'baked')


def timed(call: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``call()`` over ``repeats`` (one untimed)."""
    call()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return 1e3 * _common.median(samples)


def _model(name: str):
    from benchmarks.step_time import build_model
    arch, kwargs, size = MODELS[name]
    numpy.random.seed(0)
    model = build_model(arch, kwargs)
    x = numpy.random.rand(2, 3, size, size).astype(numpy.float32)
    t = numpy.zeros(2, numpy.int32)
    return model, x, t


def adapters(name: str) -> Dict[str, tuple]:
    """``{adapter name: (adapter, optimizer)}``, each after one step."""
    out = {}
    model, x, t = _model(name)
    sgd = FusedMomentumSGD(lr=0.1, momentum=0.9).setup(model)
    sgd.add_hook(optimizer_hooks.WeightDecay(1e-4))
    sgd.update(model, x, t)
    out['momentum_sgd'] = (graphs.graphed(sgd).adapter, sgd)
    model, x, t = _model(name)
    kfac = KFAC(lr=0.1, momentum=0.9, refresh_interval_a=20,
                refresh_interval_g=20, refresh_interval_f=20,
                verbose=False).setup(model)
    kfac.update(model, x, t)
    adapter = kfac_step.KFACOptimizer(kfac)
    adapter.before_step()
    adapter.after_capture(adapter.host_state())
    out['kfac'] = (adapter, kfac)
    return out


def pre_launch(adapter, optimizer, repeats: int) -> Dict[str, float]:
    """Median milliseconds of each pre-launch call, taken in order as a
    step takes them, each repeat a new step (``optimizer.t`` advanced, as
    a replay's bookkeeping advances it), and of their sum."""
    samples = {c: [] for c in PRE_LAUNCH + ('sum',)}
    for _ in range(repeats + 1):
        optimizer.t += 1
        total = 0.0
        for name in PRE_LAUNCH:
            start = time.perf_counter()
            getattr(adapter, name)()
            elapsed = time.perf_counter() - start
            samples[name].append(elapsed)
            total += elapsed
        samples['sum'].append(total)
    return {c: 1e3 * _common.median(v[1:]) for c, v in samples.items()}


def measure(name: str, repeats: int) -> Dict:
    result = {'model': name, 'adapters': {}}
    for kind, (adapter, optimizer) in adapters(name).items():
        calls = pre_launch(adapter, optimizer, repeats)
        before = calls.pop('sum')
        if kind == 'kfac':
            # its after_replay also advances the optimizer's schedule
            calls['after_replay'] = timed(optimizer.finish_replayed_step,
                                          repeats)
        else:
            calls['after_replay'] = timed(adapter.after_replay, repeats)
        result['adapters'][kind] = {
            'parameters': len(graphs.step.ParameterWalk(optimizer)()),
            'ms': calls,
            'pre_launch_ms': before,
        }
    return result


def main(argv=None):
    parser = _common.argument_parser('benchmarks.replay_host', __doc__)
    parser.add_argument('--smoke', action='store_true',
                        help='the small ResNet, 20 repeats (overrides '
                             '--repeats)')
    parser.add_argument('--out', default='result/replay_host.json',
                        help='JSON output (default: %(default)s)')
    parser.add_argument('--repeats', type=_args.positive_int, default=200,
                        help='timed steps per call; the figures are their '
                             'medians (default: %(default)s)')
    args = parser.parse_args(argv)
    _args.check_paths(parser, args)
    data = _common.header('replay_host', sys.argv[1:] if argv is None
                          else argv)
    name = 'small' if args.smoke else 'resnet50'
    data['result'] = measure(name, 20 if args.smoke else args.repeats)
    print(_common.describe_machine(data))
    rows = [[kind, a['parameters']] + [a['ms'][c] for c in PRE_LAUNCH] +
            [a['pre_launch_ms'], a['ms']['after_replay']]
            for kind, a in data['result']['adapters'].items()]
    print('{}: ms per replayed step (medians)'.format(name))
    print(_common.format_table(
        ['adapter', 'params'] + list(PRE_LAUNCH) +
        ['before launch', 'after_replay'], rows))
    _common.write_json(args.out, data)
    print('wrote', args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())

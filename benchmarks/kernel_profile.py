"""Where a step's GPU time goes, kernel by kernel, beside the peer's.

    python -m benchmarks.kernel_profile [--batch 64] [--steps 5]
        [--warmup 5] [--variants sgd,sgd_graph,...]
        [--peer-variants sgd,kfac_inverse_stale,...]
        [--out result/kernel_profile.json]
    python -m benchmarks.kernel_profile --resummarise RESULT.json

``step_time --gpu --peer`` says how long a step takes; this says where the
difference lies. Each variant runs its warm-up steps, then ``--steps``
steps under PyTorch's profiler, whose CUPTI tracing records every kernel
of the process whichever library launched it: CuPy's kernels, this
project's ctypes cuDNN and cuBLAS, PyTorch's own — so both sides are
measured by one method, in one process. Ours: ResNet-50 under Chainer,
the variants of :mod:`benchmarks.step_time` (its step classes; cuDNN
chosen as ``train_imagenet.py --gpu`` chooses it). The peer's: the same
network in PyTorch (torchvision's ResNet-50, the strides moved to ours:
:func:`benchmarks.peer_pytorch.resnet50`) with ``torch.optim.SGD`` and
kfac-pytorch
(:mod:`benchmarks.peer_pytorch`). A stale K-FAC variant is profiled on
stale steps only (the steps start after a refresh).

The kernels are summed by category (:data:`CATEGORIES`, a rule on the
kernel's name: convolution forward / dgrad / wgrad, layout transforms,
batch normalization, activations, GEMMs, the inverses' cuSOLVER and trsm
calls, the optimizer's update, ...), per step. A table puts each of our
variants beside its peer (:data:`PAIRS`): microseconds and kernels per
step by category and the difference, with the GPU's busy time (the union
of the kernels' intervals) against the wall time of the steps; then each
side's largest kernels by name. A PNG draws the same bars. The traces are
kept (``<out>_traces/<side>_<variant>.json.gz``, Chrome trace format:
open them in Perfetto), and ``--resummarise`` sums them again on any
machine, e.g. after the categories were refined.

Needs a CUDA GPU, CuPy and PyTorch (its profiler), and kfac-pytorch for
the peer (``--peer-variants ''`` profiles ours alone).
"""
import argparse
import gzip
import json
import os
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from benchmarks import _args
from benchmarks import _common
from harness import tuning

#: (category, fragments of the lower-cased kernel name); the first rule
#: with a fragment in the name decides. Checked against kernel names of
#: cuDNN 9, cuBLAS, CuPy, Chainer and PyTorch
#: (``tests/benchmarks/test_kernel_profile.py``).
CATEGORIES: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ('conv wgrad', ('wgrad', 'backwardfilter', 'backward_filter')),
    ('conv dgrad', ('dgrad', 'backwarddata', 'backward_data')),
    ('conv forward', ('fprop', 'convolve', 'scudnn', 'winograd', 'fft',
                      'implicit_gemm', 'conv2d', 'convolution')),
    ('batch norm', ('bn_fw', 'bn_bw', 'batch_norm', 'batchnorm', 'welford')),
    ('layout', ('nchwtonhwc', 'nhwctonchw', 'transpose', 'im2col', 'col2im',
                'scalepackedtensor', 'tensor_transform')),
    ('inverse (cuSOLVER, trsm)', ('potrf', 'potri', 'potrs', 'trsm',
                                  'trtri', 'lauum', 'cusolver', 'syevd',
                                  'getrf')),
    ('GEMM', ('gemm', 'gemv', 'cutlass', 'cublas', 'syrk', 'xmma')),
    ('pooling', ('pool',)),
    ('softmax, loss', ('softmax', 'crossent', 'cross_entropy', 'nll')),
    ('optimizer update', ('momentum', 'multi_tensor', 'sgd',
                          'regularized_grad', 'unscaled_step',
                          'chainerkfac_norm', 'all_finite', 'nonfinite',
                          'guard_')),
    ('activation', ('relu', 'threshold', 'activation', 'clamp')),
    ('reduction', ('reduce', 'reduction', 'sum', 'mean', 'argmax')),
    ('copy, fill', ('copy', 'fill')),
    ('elementwise', ('elementwise', 'cupy_', 'functor')),
)
#: Copies and fills the trace records as such (not kernels).
MEMORY = 'memcpy, memset'
OTHER = 'other'
#: Every category, in the order of the tables.
ORDER = tuple(c for c, _ in CATEGORIES) + (MEMORY, OTHER)

#: Our variants (:mod:`benchmarks.step_time`'s) and the peer's.
VARIANTS = ('sgd', 'sgd_graph', 'kfac_every', 'kfac_every_graph',
            'kfac_tf32', 'kfac_fp16', 'kfac_low_rank', 'kfac_shifted',
            'kfac_stale', 'kfac_stale_graph', 'kfac_stale_graph_tf32')
PEER_VARIANTS = ('sgd', 'kfac_inverse', 'kfac_inverse_stale')
DEFAULT_VARIANTS = ('sgd', 'sgd_graph', 'kfac_every', 'kfac_stale_graph')
#: Ours -> the peer's variant it is compared with.
PAIRS = {'sgd': 'sgd', 'sgd_graph': 'sgd', 'kfac_every': 'kfac_inverse',
         'kfac_every_graph': 'kfac_inverse',
         'kfac_tf32': 'kfac_inverse', 'kfac_fp16': 'kfac_inverse',
         'kfac_low_rank': 'kfac_inverse', 'kfac_shifted': 'kfac_inverse',
         'kfac_stale': 'kfac_inverse_stale',
         'kfac_stale_graph': 'kfac_inverse_stale',
         'kfac_stale_graph_tf32': 'kfac_inverse_stale'}
STALE = ('kfac_stale', 'kfac_stale_graph', 'kfac_stale_graph_tf32',
         'kfac_inverse_stale')
#: Largest kernels listed per profiled variant.
TOP = 15


def category(name: str) -> str:
    """The category (:data:`CATEGORIES`) of a kernel's name."""
    lower = name.lower()
    for label, fragments in CATEGORIES:
        if any(f in lower for f in fragments):
            return label
    return OTHER


def device_events(trace: Dict) -> List[Tuple[str, str, float, float]]:
    """``(name, category, start µs, duration µs)`` of every kernel, copy
    and fill in a Chrome trace of PyTorch's profiler (its ``cat`` is
    ``kernel``, ``gpu_memcpy`` or ``gpu_memset``); the host's events are
    left out."""
    events = []
    for event in trace.get('traceEvents', []):
        kind = str(event.get('cat', '')).lower()
        if event.get('ph') != 'X' or kind not in (
                'kernel', 'gpu_memcpy', 'gpu_memset'):
            continue
        name = str(event.get('name', ''))
        label = category(name) if kind == 'kernel' else MEMORY
        events.append((name, label, float(event['ts']),
                       float(event.get('dur', 0.0))))
    return events


def busy_time(intervals: Sequence[Tuple[float, float]]) -> float:
    """Length of the union of ``(start, duration)`` intervals: the time
    the GPU ran something, kernels on several streams counted once."""
    total, end = 0.0, None
    for start, duration in sorted(intervals):
        stop = start + duration
        if end is None or start > end:
            total += duration
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total


def summarise(trace: Dict, steps: int, top: int = TOP) -> Dict:
    """Per step: µs and count by category, the busy time, the span from
    the first event's start to the last one's end, and the ``top`` names
    by time."""
    events = device_events(trace)
    per_category = {}
    per_name = {}
    for name, label, _, duration in events:
        entry = per_category.setdefault(label, [0.0, 0])
        entry[0] += duration
        entry[1] += 1
        entry = per_name.setdefault(name, [0.0, 0, label])
        entry[0] += duration
        entry[1] += 1
    span = (max(s + d for _, _, s, d in events) -
            min(s for _, _, s, _ in events)) if events else 0.0
    largest = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        'steps': steps,
        'events': len(events),
        'device_us_per_step': sum(d for *_, d in events) / steps,
        'busy_us_per_step': busy_time([(s, d) for _, _, s, d in events]) /
        steps,
        'span_us_per_step': span / steps,
        'categories': {c: {'us_per_step': per_category[c][0] / steps,
                           'count_per_step': per_category[c][1] / steps}
                       for c in ORDER if c in per_category},
        'top': [{'name': name, 'category': label,
                 'us_per_step': total / steps,
                 'count_per_step': count / steps}
                for name, (total, count, label) in largest],
    }


def read_trace(path: str) -> Dict:
    opener = gzip.open if path.endswith('.gz') else open
    with opener(path, 'rt') as f:
        return json.load(f)


# -- tables and the figure ----------------------------------------------------


def pair_table(ours: Dict, theirs: Optional[Dict]) -> str:
    """Our variant's categories beside the peer's: µs and kernels per
    step, and ours − theirs."""
    rows = []
    for label in ORDER:
        mine = ours['categories'].get(label)
        peer = theirs['categories'].get(label) if theirs else None
        if mine is None and peer is None:
            continue
        mine_us = mine['us_per_step'] if mine else 0.0
        peer_us = peer['us_per_step'] if peer else 0.0
        rows.append([label, mine_us, _count(mine), peer_us if theirs else
                     None, _count(peer) if theirs else None,
                     mine_us - peer_us if theirs else None])
    for key, words in (('device_us_per_step', 'all device work'),
                       ('busy_us_per_step', 'GPU busy (union)'),
                       ('wall_us_per_step', 'wall, synchronised')):
        rows.append([words, ours.get(key), None,
                     theirs.get(key) if theirs else None, None,
                     ours[key] - theirs[key] if theirs and
                     ours.get(key) is not None and
                     theirs.get(key) is not None else None])
    return _common.format_table(
        ['category', 'ours µs/step', 'ours kernels', 'peer µs/step',
         'peer kernels', 'ours − peer µs'], rows)


def _count(entry):
    return None if entry is None else entry['count_per_step']


def top_table(summary: Dict) -> str:
    rows = [[_short(t['name']), t['category'], t['us_per_step'],
             t['count_per_step']] for t in summary['top']]
    return _common.format_table(['kernel', 'category', 'µs/step',
                                 'calls/step'], rows)


def _short(name: str, width: int = 90) -> str:
    return name if len(name) <= width else name[:width - 1] + '…'


def tables(data: Dict) -> str:
    ours, peer = data['ours'], data.get('peer', {})
    parts = []
    for variant, summary in ours.items():
        partner = PAIRS.get(variant)
        theirs = peer.get(partner)
        title = 'ours {} (batch {}){}'.format(
            variant, data['batch'],
            ' against the peer\'s {}'.format(partner) if theirs else '')
        parts.append('{}:\n{}'.format(title, pair_table(summary, theirs)))
    for side, runs in (('ours', ours), ('peer', peer)):
        for variant, summary in runs.items():
            parts.append('largest kernels, {} {}:\n{}'.format(
                side, variant, top_table(summary)))
    return '\n\n'.join(parts)


def figure(data: Dict, path: str) -> None:
    """Horizontal bars, µs per step by category: each of our variants
    beside its peer, one panel per variant."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    ours, peer = data['ours'], data.get('peer', {})
    panels = list(ours)
    fig = Figure(figsize=(8, 0.45 * len(ORDER) * len(panels) + 1))
    FigureCanvasAgg(fig)
    for i, variant in enumerate(panels):
        axes = fig.add_subplot(len(panels), 1, i + 1)
        theirs = peer.get(PAIRS.get(variant))
        labels = [c for c in ORDER if c in ours[variant]['categories'] or
                  (theirs and c in theirs['categories'])]
        ys = range(len(labels))

        def values(summary):
            return [summary['categories'].get(c, {}).get('us_per_step', 0.0)
                    for c in labels]
        height = 0.4 if theirs else 0.8
        axes.barh([y - height / 2 if theirs else y for y in ys],
                  values(ours[variant]), height, label='chainerkfac ' +
                  variant)
        if theirs:
            axes.barh([y + height / 2 for y in ys], values(theirs), height,
                      label='peer ' + PAIRS[variant])
        axes.set_yticks(list(ys))
        axes.set_yticklabels(labels, fontsize='small')
        axes.invert_yaxis()
        axes.set_xlabel('GPU µs per step (batch {})'.format(data['batch']))
        axes.set_title('{}: wall {:.0f} µs, GPU busy {:.0f} µs{}'.format(
            variant, ours[variant].get('wall_us_per_step') or 0.0,
            ours[variant]['busy_us_per_step'],
            '; peer {:.0f} / {:.0f} µs'.format(
                theirs.get('wall_us_per_step') or 0.0,
                theirs['busy_us_per_step']) if theirs else ''),
            fontsize='small')
        axes.legend(fontsize='x-small')
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path + '.tmp.png', dpi=110)
    os.replace(path + '.tmp.png', path)


# -- profiling on the GPU -----------------------------------------------------


def why_unavailable() -> Optional[str]:
    """None where a profile can run here; else why not, in words."""
    try:
        import cupy
        cupy.cuda.Device(0).use()
    except Exception as error:   # not installed, or no device
        return 'CuPy on a CUDA GPU is needed ({}: {})'.format(
            type(error).__name__, error)
    try:
        import torch.profiler  # noqa: F401  (CUPTI, for every kernel)
        import torch
    except Exception as error:
        return ('PyTorch is needed for its profiler ({}: {})'.format(
            type(error).__name__, error))
    if not torch.cuda.is_available():
        return 'PyTorch sees no CUDA device'
    return None


def advance_past_refresh(step: Callable[[], bool], limit: int) -> None:
    """Step until a step refreshed (then the next ones are stale)."""
    for _ in range(limit):
        if step():
            return
    raise RuntimeError('no refresh in {} steps'.format(limit))


def profile(step: Callable[[], bool], steps: int, warmup: int,
            synchronize: Callable[[], None], trace_path: str,
            stale_interval: Optional[int] = None) -> Dict:
    """Warm up, then profile ``steps`` steps (all stale, for a stale
    variant: ``stale_interval`` its refresh interval, from the second
    stale step of a cycle); summarise, and keep the trace gzipped at
    ``trace_path``."""
    import torch
    for _ in range(warmup):
        step()
    if stale_interval is not None:
        advance_past_refresh(step, stale_interval + 1)
        # the first stale step after a refresh is captured anew where the
        # variant is graphed (a capture, not a replay): not profiled
        step()
        steps = min(steps, stale_interval - 2)
    synchronize()
    activities = [torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        refreshed = [step() for _ in range(steps)]
        synchronize()
        wall = time.perf_counter() - start
    os.makedirs(os.path.dirname(os.path.abspath(trace_path)), exist_ok=True)
    plain = trace_path[:-3] if trace_path.endswith('.gz') else trace_path
    prof.export_chrome_trace(plain + '.part')
    trace = read_trace(plain + '.part')
    with gzip.open(trace_path + '.part', 'wt') as f:
        json.dump(trace, f)
    os.replace(trace_path + '.part', trace_path)
    if plain != trace_path:
        os.remove(plain + '.part')
    summary = summarise(trace, steps)
    summary.update(wall_us_per_step=wall / steps * 1e6,
                   refresh_steps=sum(bool(r) for r in refreshed),
                   trace=trace_path)
    if not summary['events']:
        summary['warning'] = ('the profiler recorded no kernel (CUPTI saw '
                              'none: a replayed graph\'s kernels are '
                              'recorded from CUDA 12 on)')
    return summary


def profile_ours(args, trace_dir: str) -> Dict[str, Dict]:
    """Our variants on ResNet-50 (step_time's steps and cuDNN choice)."""
    import chainer
    import cupy
    from benchmarks import step_time
    spec = dict(step_time.GPU['resnet50'], batch=args.batch)
    limit, timed, words = cudnn_for(args)
    print('cuDNN: {}'.format(words), flush=True)
    step_time.set_workspace_limit(limit)
    synchronize = cupy.cuda.Device().synchronize
    x, t = step_time._batch(spec, cupy)
    results = {}
    with chainer.using_config('autotune', timed):
        for variant in args.variants:
            print('profiling ours {} (batch {})...'.format(
                variant, args.batch), flush=True)
            model = step_time.build_model(spec['arch'], spec['kwargs'])
            model.to_device('@cupy:0')
            run = _our_step(step_time, variant, model, args.interval,
                            synchronize)

            def step(run=run, model=model):
                run(x, t)
                step_time.drop_graph(model)
                return run.refreshed
            results[variant] = profile(
                step, args.steps, args.warmup, synchronize,
                os.path.join(trace_dir, 'ours_{}.json.gz'.format(variant)),
                args.interval if variant in STALE else None)
            del run, model, step
            step_time.free_device_memory(cupy)
    return results


def cudnn_for(args) -> Tuple[Optional[int], bool, str]:
    """``(workspace limit, timed, start-up line)``: cuDNN as a default
    ``train_imagenet.py --gpu`` run chooses it (CUDA graphs on: timed
    algorithms within 1 GiB, for the eager refresh steps as well), or as
    one with ``--cuda-graphs off`` (``--eager-run``). The profile of
    2026-11-27 took the second for an eager variant, and its convolutions
    came to 35 ms per step against the peer's 4 ms (PyTorch times them)."""
    from benchmarks import step_time
    [limit], timed, words = step_time.cudnn_choice(
        None if args.cudnn_workspace == 'auto' else [args.cudnn_workspace],
        args.cudnn_autotune, True, not args.eager_run)
    return limit, timed, words


def _our_step(step_time, variant, model, interval, synchronize):
    if variant == 'sgd':
        return step_time.SGDStep(model, synchronize)
    if variant == 'sgd_graph':
        return step_time.SGDGraphStep(model)
    if variant == 'kfac_every_graph':
        return step_time.KFACGraphStep(model, 1, refresh_steps=True)
    if variant in step_time.KFAC_GRAPH_VARIANTS:
        return step_time.KFACGraphStep(
            model, interval, **step_time.KFAC_GRAPH_VARIANTS[variant][0])
    return step_time.KFACStep(model, interval if variant in STALE else 1,
                              True,
                              **step_time.KFAC_VARIANTS[variant])


def profile_peer(args, trace_dir: str) -> Dict[str, Dict]:
    """The peer's variants (:mod:`benchmarks.peer_pytorch`)."""
    import cupy
    import torch
    from benchmarks import peer_pytorch
    reason = peer_pytorch.why_unavailable()
    if reason is not None:
        print('peer skipped: {}'.format(reason), flush=True)
        return {'skipped': reason}
    cupy.get_default_memory_pool().free_all_blocks()
    results = {}
    for variant in args.peer_variants:
        print('profiling the peer {} (batch {})...'.format(
            variant, args.batch), flush=True)
        [step] = peer_pytorch._build_steps(
            [variant], args.batch, 224, args.interval).values()
        results[variant] = profile(
            step, args.steps, args.warmup, torch.cuda.synchronize,
            os.path.join(trace_dir, 'peer_{}.json.gz'.format(variant)),
            args.interval if variant in STALE else None)
        del step
        torch.cuda.empty_cache()
    return results


# -- command line -------------------------------------------------------------


def _list(choices: Sequence[str], allow_empty: bool = False):
    def parse(text: str) -> Tuple[str, ...]:
        names = [n for n in text.split(',') if n]
        unknown = [n for n in names if n not in choices]
        if unknown or not (names or allow_empty):
            raise argparse.ArgumentTypeError(
                'choose from {} (got {!r})'.format(', '.join(choices), text))
        return tuple(n for n in choices if n in names)
    return parse


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog='python -m benchmarks.kernel_profile', description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--batch', type=_args.positive_int, default=64,
                        help='per-GPU batch (default 64)')
    parser.add_argument('--steps', type=_args.positive_int, default=5,
                        help='profiled steps per variant (default 5)')
    parser.add_argument('--warmup', type=_args.nonnegative_int, default=5,
                        help='steps before them (default 5: a replayed '
                        'variant is captured after 3)')
    parser.add_argument('--interval', type=_args.at_least(2), default=20,
                        help='refresh interval of the stale variants')
    parser.add_argument('--variants', type=_list(VARIANTS),
                        default=DEFAULT_VARIANTS,
                        help='ours, comma-separated, from {} (default {})'
                        .format(','.join(VARIANTS), ','.join(
                            DEFAULT_VARIANTS)))
    parser.add_argument('--peer-variants', type=_list(PEER_VARIANTS, True),
                        default=None,
                        help="the peer's, from {} ('' for none; default: "
                        'those paired with ours)'.format(
                            ','.join(PEER_VARIANTS)))
    parser.add_argument('--eager-run', action='store_true',
                        help="cuDNN as a run with --cuda-graphs off "
                        "chooses it (cuDNN's heuristics within Chainer's "
                        '8MiB); default: as a default train_imagenet.py '
                        '--gpu run (CUDA graphs on: timed algorithms '
                        'within 1GiB, for its eager steps too)')
    parser.add_argument('--cudnn-autotune', default='auto',
                        choices=('auto', 'on', 'off'),
                        help='as train_imagenet.py\'s (default auto)')
    parser.add_argument('--cudnn-workspace', type=tuning.workspace_size,
                        default='auto',
                        help='as train_imagenet.py\'s (default auto)')
    parser.add_argument('--out', default='result/kernel_profile.json',
                        help='JSON output; the PNG beside it, the traces '
                        'in <out without .json>_traces/')
    parser.add_argument('--resummarise', type=_args.json_file,
                        metavar='RESULT.json',
                        default=None,
                        help='sum the traces of an earlier result again '
                        '(no GPU needed) and write its tables and PNG')
    args = parser.parse_args(argv)
    _args.check_paths(parser, args)
    if args.peer_variants is None:
        args.peer_variants = tuple(p for p in PEER_VARIANTS
                                   if p in {PAIRS[v] for v in args.variants})
    return args


def resummarise(path: str) -> Dict:
    """An earlier result with its traces summed again; trace paths are
    taken relative to the result's folder when they are not found as
    written."""
    with open(path) as f:
        data = json.load(f)
    for side in ('ours', 'peer'):
        for variant, summary in data.get(side, {}).items():
            if not isinstance(summary, dict) or 'trace' not in summary:
                continue
            trace = summary['trace']
            if not os.path.exists(trace):
                trace = os.path.join(os.path.dirname(os.path.abspath(path)),
                                     os.path.basename(os.path.dirname(
                                         trace)), os.path.basename(trace))
            if not os.path.exists(trace):
                raise SystemExit('{}: the trace of {} {} is missing ({})'
                                 .format(path, side, variant,
                                         summary['trace']))
            kept = {k: summary[k] for k in ('wall_us_per_step',
                                            'refresh_steps', 'trace')
                    if k in summary}
            steps = summary['steps']
            summary.clear()
            summary.update(summarise(read_trace(trace), steps))
            summary.update(kept)
    return data


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    root = os.path.splitext(args.out)[0]
    if args.resummarise:
        data = resummarise(args.resummarise)
    else:
        reason = why_unavailable()
        if reason is not None:
            raise SystemExit('kernel_profile: {}'.format(reason))
        data = _common.header('kernel_profile', argv, gpu=True)
        data.update(batch=args.batch, warmup=args.warmup,
                    interval=args.interval)
        trace_dir = root + '_traces'
        data['ours'] = profile_ours(args, trace_dir)
        peer = profile_peer(args, trace_dir) if args.peer_variants else {}
        if 'skipped' in peer:
            data['peer_skipped'] = peer.pop('skipped')
        data['peer'] = peer
    text = tables(data)
    png = root + '.png'
    figure(data, png)
    if 'machine' in data:
        print(_common.describe_machine(data))
    print(text)
    _common.write_json(args.out, data)
    print('wrote {} and {}'.format(args.out, png))
    return 0


if __name__ == '__main__':
    sys.exit(main())

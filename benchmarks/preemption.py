"""How long a run takes to stop on a scheduler's signal, and what the
per-step agreement costs.

    python -m benchmarks.preemption [--smoke] [--out FILE.json]
        [--repeats 3] [--archs small,resnet50] [--agreement-sizes 2,4]

(``--agreement-sizes ''`` skips the agreement.)

**Signal to exit.** ``train_imagenet.py`` runs under ``mpiexec`` with
K-FAC (``config/bs32k.json``'s settings, 32 images per process, factors
refreshed every step) on synthetic JPEGs in ImageNet's layout: the small
ResNet of the demo (16² crops, 2 processes) and ResNet-50 (224² crops, one
process with 2 BLAS threads — two would not fit this machine's memory
beside the other jobs). ``--fisher-diff`` writes a line per step, the
heartbeat: after the second line (the step time is the time between the
first two), SIGUSR1 goes to ``mpiexec`` a uniformly drawn fraction of a step
later; ``exit_s`` is the wall time from the signal until ``mpiexec`` has
exited (status 75). The run's own message splits it: from the signal to
the end of the step in progress (``to_boundary_s``), and the snapshot
write (``write_s``); the rest is the processes' and ``mpiexec``'s exit.
The bound to plan a scheduler's lead time with is one step plus one
snapshot write plus the exit (the worst case: a signal at the start of a
step).

**Agreement.** The stop is agreed at every step boundary with one
``Allreduce`` of two ``int32`` (:func:`harness.preemption.agree`); under
``mpiexec -n P`` its mean time over 2000 calls (after a barrier) is
compared with a step of each model.
"""
import argparse
import json
import os
import random
import re
import signal
import sys
import tempfile
import time

from benchmarks import _args
from benchmarks import _common
from harness import mpi

#: The runs: arch options, processes, BLAS threads per process, images.
RUNS = {
    'small': {'options': ['--arch', 'small', '--depth', '8', '--width', '16',
                          '--crop-size', '16', '--resize', '18'],
              'nproc': 2, 'threads': 1, 'image': 24, 'steps_per_epoch': 12},
    'resnet50': {'options': ['--arch', 'resnet50', '--crop-size', '224',
                             '--resize', '256'],
                 'nproc': 1, 'threads': 2, 'image': 64,
                 'steps_per_epoch': 6},
}
BATCH = 32
N_CLASS = 10
_MESSAGE = re.compile(
    r'([0-9.]+) s from the signal to the step boundary, the snapshot '
    r'written ([0-9.]+) s after the step boundary')


def build_data(root, n_images, size, seed=0):
    """``n_images`` random JPEGs of ``size``² in class folders, and the
    train and val lists (val: the first 32)."""
    import numpy
    from PIL import Image
    rng = numpy.random.RandomState(seed)
    lines = []
    for i in range(n_images):
        label = i % N_CLASS
        rel = 'n{:08d}/{}.JPEG'.format(label, i)
        os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
        pixels = rng.randint(0, 256, (size, size, 3)).astype(numpy.uint8)
        Image.fromarray(pixels).save(os.path.join(root, rel), quality=90)
        lines.append('{} {}\n'.format(rel, label))
    for name, chosen in (('train.txt', lines), ('val.txt', lines[:32])):
        with open(os.path.join(root, name), 'w') as f:
            f.writelines(chosen)


def write_config(path, global_batch, epochs):
    import config as config_module
    cfg = config_module.to_dict(config_module.load(
        config_module.preset_path('bs32k')))
    cfg.update(global_batch_size=global_batch, epochs=epochs,
               n_class=N_CLASS)
    with open(path, 'w') as f:
        json.dump(cfg, f)


def heartbeats(path):
    try:
        with open(path) as f:
            return sum(1 for line in f if line.strip())
    except OSError:
        return 0


def _read(path):
    with open(path, errors='replace') as f:
        return f.read()


def stop_once(arch, directory, seed, timeout):
    """One run stopped by SIGUSR1 at a random point of its third step."""
    spec = RUNS[arch]
    out = os.path.join(directory, 'run{}'.format(seed))
    cmd = [_common.mpiexec_path(), '-n', str(spec['nproc']), sys.executable,
           os.path.join(_common.ROOT, 'train_imagenet.py'),
           os.path.join(directory, 'train.txt'),
           os.path.join(directory, 'val.txt'), '--root', directory,
           '--config', os.path.join(directory, 'config.json'), '--out', out,
           '--fisher-diff', '--no-progress', '--seed', str(seed)]
    cmd += spec['options']
    log_path = os.path.join(directory, 'log{}.txt'.format(seed))
    process = _common.BackgroundLaunch(
        cmd, _common.worker_env(spec['threads']), log_path)
    diff = os.path.join(out, 'fisher_diff.jsonl')
    marks = []
    while len(marks) < 2:
        if not process.running() or \
                time.time() > process.started + timeout:
            process.process.kill()
            process.wait()
            mpi.remove_session_dir(process.pid)
            raise RuntimeError('{}: no second step (see {})'.format(
                arch, log_path))
        if heartbeats(diff) > len(marks):
            marks.append(time.perf_counter())
        time.sleep(0.01)
    step_s = marks[1] - marks[0]
    fraction = random.Random(seed).random()
    time.sleep(fraction * step_s)
    sent = time.perf_counter()
    process.process.send_signal(signal.SIGUSR1)
    status = process.wait(timeout=timeout)
    exit_s = time.perf_counter() - sent
    found = _MESSAGE.search(_read(log_path))
    snapshot = [os.path.getsize(os.path.join(out, n)) for n in os.listdir(out)
                if n.startswith('snapshot_step_')]
    return {'seed': seed, 'status': status, 'step_s': step_s,
            'signal_at_fraction_of_step': fraction, 'exit_s': exit_s,
            'to_boundary_s': float(found.group(1)) if found else None,
            'write_s': float(found.group(2)) if found else None,
            'snapshot_bytes_per_process': max(snapshot) if snapshot else 0}


def measure_stops(arch, repeats, epochs, timeout):
    spec = RUNS[arch]
    global_batch = BATCH * spec['nproc']
    with tempfile.TemporaryDirectory(prefix='preemption.') as directory:
        build_data(directory, global_batch * spec['steps_per_epoch'],
                   spec['image'])
        write_config(os.path.join(directory, 'config.json'), global_batch,
                     epochs)
        runs = [stop_once(arch, directory, seed, timeout)
                for seed in range(repeats)]
    out = {'arch': arch, 'nproc': spec['nproc'], 'batch': BATCH,
           'blas_threads': spec['threads'], 'runs': runs}
    for key in ('step_s', 'exit_s', 'to_boundary_s', 'write_s'):
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = _common.median(values) if values else None
    out['max_exit_s'] = max(r['exit_s'] for r in runs)
    out['all_status_75'] = all(r['status'] == 75 for r in runs)
    return out


def agreement_worker(calls):
    """Rank 0 prints the mean seconds of one :func:`harness.preemption.
    agree` over ``calls``."""
    from chainerkfac.communicators import create_communicator
    from harness import preemption
    comm = create_communicator('naive')
    stop = preemption.StopRequest(())
    for _ in range(100):
        preemption.agree(comm, stop)
    comm.mpi_comm.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        preemption.agree(comm, stop)
    seconds = (time.perf_counter() - start) / calls
    if comm.rank == 0:
        print(json.dumps({'size': comm.size, 'seconds': seconds}),
              flush=True)


def measure_agreement(size, calls):
    done, _ = _common.run_mpiexec(
        [_common.mpiexec_path(), '-n', str(size), sys.executable, '-m',
         'benchmarks.preemption', '--agreement-worker', str(calls)],
        _common.worker_env(1), timeout=600)
    lines = [line for line in done.stdout.splitlines()
             if line.startswith('{')]
    if done.returncode != 0 or not lines:
        raise RuntimeError('agreement worker failed:\n' + done.stdout +
                           done.stderr)
    return json.loads(lines[-1])


def main(argv=None):
    parser = _common.argument_parser('benchmarks.preemption', __doc__)
    parser.add_argument('--smoke', action='store_true',
                        help='the small ResNet once, 200 agreement calls '
                             'on 2 processes (overrides --repeats, --archs '
                             'and --agreement-sizes)')
    parser.add_argument('--out', default='result/preemption.json',
                        help='JSON output (default: %(default)s)')
    parser.add_argument('--repeats', type=_args.positive_int, default=3,
                        help='stopped runs per model, each signalled at '
                             'another point of its step (default: '
                             '%(default)s)')
    parser.add_argument('--archs', type=_args.names(list(RUNS)),
                        default='small,resnet50',
                        help='comma-separated models to stop, of small, '
                             'resnet50 (default: %(default)s)')
    parser.add_argument('--agreement-sizes',
                        type=_args.or_empty(_args.int_list(2)),
                        default='2,4',
                        help="comma-separated process counts to time the "
                             "agreement on; '' skips it (default: "
                             "%(default)s)")
    parser.add_argument('--timeout', type=_args.positive_float, default=1800,
                        help="seconds a run may take to its second step, "
                             "and again to exit after the signal (default: "
                             "%(default)s)")
    parser.add_argument('--agreement-worker', type=int,
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.agreement_worker:
        agreement_worker(args.agreement_worker)
        return 0
    _args.check_paths(parser, args)
    archs = ['small'] if args.smoke else args.archs
    repeats = 1 if args.smoke else args.repeats
    data = _common.header('preemption', sys.argv[1:] if argv is None
                          else argv)
    data['stops'] = [measure_stops(arch, repeats, 3, args.timeout)
                     for arch in archs]
    sizes = [2] if args.smoke else args.agreement_sizes
    data['agreement'] = [measure_agreement(size, 200 if args.smoke
                                           else 2000) for size in sizes]
    steps = {s['arch']: s['step_s'] for s in data['stops']}
    for entry in data['agreement']:
        entry['fraction_of_step'] = {arch: entry['seconds'] / step
                                     for arch, step in steps.items()}
    print(_common.describe_machine(data))
    print(_common.format_table(
        ['model', 'processes', 'step s', 'signal to exit s (median)',
         'max', 'to step end s', 'write s', 'snapshot MB', 'status 75'],
        [[s['arch'], s['nproc'], s['step_s'], s['exit_s'], s['max_exit_s'],
          s['to_boundary_s'], s['write_s'],
          max(r['snapshot_bytes_per_process'] for r in s['runs']) / 1e6,
          s['all_status_75']] for s in data['stops']]))
    print(_common.format_table(
        ['processes', 'agreement us'] + ['/ {} step'.format(a)
                                         for a in steps],
        [[a['size'], a['seconds'] * 1e6] +
         [a['fraction_of_step'][arch] for arch in steps]
         for a in data['agreement']]))
    _common.write_json(args.out, data)
    print('wrote', args.out)
    return 0


if __name__ == '__main__':
    sys.exit(main())

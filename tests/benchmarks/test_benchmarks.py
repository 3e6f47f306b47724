"""Each benchmark in its seconds-long ``--smoke`` mode, run as a user runs
it (``python -m benchmarks.<name>``): the JSON holds the expected fields
with finite positive numbers. Nothing here asserts a speed."""
import json
import math
import os
import subprocess
import sys
import types

import numpy
import pytest

from analysis import scaling
from benchmarks import _common

ROOT = _common.ROOT
STAGES = ('forward_backward', 'factors', 'reduce_scatter', 'inverse',
          'precondition', 'all_gather', 'update')
CAPTURE_TYPES = ('Linear A', 'Linear G', 'Conv A', 'Conv G', 'BN F')


def run_benchmark(name, tmp_path, *extra):
    out = str(tmp_path / (name + '.json'))
    cmd = [sys.executable, '-m', 'benchmarks.' + name, '--smoke',
           '--out', out] + list(extra)
    proc = subprocess.run(cmd, cwd=ROOT, env=_common.worker_env(threads=1),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out) as f:
        return json.load(f), proc.stdout


def positive(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and value > 0


def check_header(data, name):
    assert data['benchmark'] == name
    assert data['command'].startswith('python -m benchmarks.' + name)
    assert '--smoke' in data['command']
    assert set(data['versions']) >= {'python', 'chainer', 'numpy'}
    assert data['machine']['cpu'] and positive(data['machine']['cores'])
    assert isinstance(data['machine']['gpus'], list)
    assert data['date'][:2] == '20'


def test_step_time_smoke(tmp_path):
    data, stdout = run_benchmark('step_time', tmp_path)
    check_header(data, 'step_time')
    assert 'x SGD' in stdout and 'forward_backward' in stdout
    assert 'Capture per refresh step by layer type' in stdout
    assert data['gpu'] is False
    assert data['variants'] == ['sgd', 'kfac_every', 'kfac_stale']
    [result] = data['results']
    assert result['model'] == 'small' and positive(result['n_kfac_layers'])
    for variant in ('sgd', 'kfac_every', 'kfac_stale'):
        assert positive(result['median_s'][variant])
        assert len(result['samples_s'][variant]) >= 1
    for key in ('kfac_every', 'kfac_stale', 'kfac_stale_amortised'):
        assert positive(result['ratio_to_sgd'][key])
    for variant in ('kfac_every', 'kfac_stale'):
        stages = result['stage_times_s'][variant]
        assert set(stages) == set(STAGES)
        assert all(math.isfinite(v) and v >= 0 for v in stages.values())
        assert positive(stages['forward_backward'])
    assert positive(result['stage_times_s']['kfac_every']['inverse'])
    assert set(result['goals']) == {'kfac_every', 'kfac_stale'}
    assert all(isinstance(g['met'], bool) for g in result['goals'].values())
    # The small ResNet has every layer type: each is timed, and the total
    # is their sum.
    [(variant, capture)] = result['capture_by_type_s'].items()
    assert variant == 'kfac_every'
    assert set(capture) == set(CAPTURE_TYPES) | {'total', 'total_over_sgd'}
    assert all(positive(v) for v in capture.values())
    assert capture['total'] == pytest.approx(
        sum(capture[k] for k in CAPTURE_TYPES))


def test_replay_host_smoke(tmp_path):
    data, stdout = run_benchmark('replay_host', tmp_path)
    check_header(data, 'replay_host')
    assert 'before launch' in stdout
    result = data['result']
    assert result['model'] == 'small'
    assert set(result['adapters']) == {'momentum_sgd', 'kfac'}
    for adapter in result['adapters'].values():
        assert adapter['parameters'] == 29
        assert set(adapter['ms']) == {'before_step', 'refusal', 'baked',
                                      'after_replay'}
        assert all(positive(v) for v in adapter['ms'].values())
        assert positive(adapter['pre_launch_ms'])


def test_step_time_smoke_every_variant(tmp_path):
    variants = ('sgd,kfac_every,kfac_stale,kfac_diag_bn,kfac_fp16,'
                'kfac_tf32,kfac_newton_schulz,kfac_low_rank')
    data, stdout = run_benchmark('step_time', tmp_path, '--variants',
                                 variants)
    assert data['variants'] == variants.split(',')
    [result] = data['results']
    for variant in variants.split(','):
        assert positive(result['median_s'][variant])
    for variant in ('kfac_diag_bn', 'kfac_fp16', 'kfac_tf32',
                    'kfac_newton_schulz', 'kfac_low_rank'):
        assert positive(result['ratio_to_sgd'][variant])
        assert set(result['stage_times_s'][variant]) == set(STAGES)
        assert positive(result['extra_over_sgd'][variant]['inverse'])
    assert set(result['capture_by_type_s']) == {
        'kfac_every', 'kfac_diag_bn', 'kfac_fp16', 'kfac_tf32',
        'kfac_low_rank'}
    assert 'kfac_fp16 [s]' in stdout


def test_step_time_inverse_only_smoke(tmp_path):
    data, stdout = run_benchmark('step_time', tmp_path, '--inverse-only',
                                 '--rounds', '2')
    check_header(data, 'step_time')
    assert 'Inverse stage alone' in stdout
    [result] = data['inverse']
    # depth-8 small ResNet: 10 Kronecker layers (A, G) and 9 full BN (F).
    assert result['n_factors'] == 29
    assert result['repeats'] == 2 and len(result['samples_s']) == 2
    assert positive(result['median_s']) and positive(result['sum_n3'])
    assert set(result['by_kind_s']) == {'A', 'G', 'F'}
    assert result['method'] == 'cholesky'
    assert 'results' not in data


def test_step_time_inverse_methods_smoke(tmp_path):
    """Both methods on the same factors; the iteration's inverses within
    fp32 reach of Cholesky's."""
    data, stdout = run_benchmark(
        'step_time', tmp_path, '--inverse-only', '--rounds', '1',
        '--inverse-methods', 'cholesky,newton_schulz',
        '--newton-schulz-max-dim', '40')
    cholesky, iterated = data['inverse']
    assert (cholesky['method'], iterated['method']) == ('cholesky',
                                                        'newton_schulz')
    assert iterated['n_factors'] == cholesky['n_factors'] == 29
    assert 0 < iterated['newton_schulz_eligible'] < 29
    assert iterated['newton_schulz_max_dim'] == 40
    assert 0 < iterated['max_rel_vs_cholesky'] < 1e-3
    assert positive(iterated['median_s'])
    assert 'newton_schulz' in stdout


def test_step_time_rejects_variants_without_sgd():
    from benchmarks import step_time
    with pytest.raises(SystemExit):
        step_time.parse_args(['--variants', 'kfac_every,kfac_fp16'])
    assert step_time.parse_args(['--gpu']).variants == \
        step_time.GPU_VARIANTS


def test_capture_timer_times_each_layer_type_and_unwraps():
    from benchmarks import step_time
    spec = step_time.SMOKE['small']
    model = step_time.build_model(spec['arch'], spec['kwargs'])
    step = step_time.KFACStep(model, 1, gpu=False)
    x, t = step_time._batch(spec, numpy)
    calls = []
    seconds = step_time.time_capture(step, x, t, 2, lambda: calls.append(1))
    assert set(seconds) == set(CAPTURE_TYPES) | {'total'}
    blocks = [b for b in step.optimizer.blocks if b.factor_names]
    # Synchronised before and after every capture call: 2 per call, one
    # call per forward factor and one per backward factor of each block.
    passes = [{kind.forward for kind in b.factor_kinds.values()}
              for b in blocks]
    per_step = sum(len(p) for p in passes)
    assert len(calls) == 2 * 2 * per_step
    assert all('capture_inputs' not in vars(b) and
               'capture_gradients' not in vars(b) for b in blocks)


def _measure(step_time, variants, rounds=3):
    spec = dict(step_time.SMOKE['small'], capture_steps=1)
    return step_time.measure('small', spec, variants, 2, rounds, 1, numpy)


@pytest.mark.parametrize('sgd_too', [False, True])
def test_a_variant_out_of_memory_beside_the_others_is_timed_alone(
        monkeypatch, sgd_too):
    """ResNet-50 at batch 128 on an 80 GB H100 (2026-11-27): every
    variant's model, K-FAC state and graphs in one process, and two of
    seven ran out of device memory; the goals then read a stale step
    from the one round it took before it failed. Such a variant is timed
    again, with SGD, once the others are let go; one that fails for
    another reason is left out of the figures."""
    from benchmarks import step_time
    real = step_time._timed_step
    crowded_calls, alone_calls = [], []

    def timed_step(step, x, t, synchronize, steps=None):
        if sgd_too and steps and step is steps.get('sgd') and \
                'kfac_every' in steps:
            raise MemoryError('Out of memory allocating 822,083,584 bytes')
        if steps and step is steps.get('kfac_stale'):
            if 'kfac_every' in steps:   # the others alive: no room
                crowded_calls.append(1)
                raise MemoryError('Out of memory allocating 411,041,792 '
                                  'bytes')
            alone_calls.append(sorted(steps))
        if steps and step is steps.get('kfac_low_rank'):
            raise RuntimeError('a bug of its own')
        return real(step, x, t, synchronize, steps)

    monkeypatch.setattr(step_time, '_timed_step', timed_step)
    result = _measure(step_time, ['sgd', 'kfac_every', 'kfac_stale',
                                  'kfac_low_rank'])
    assert len(crowded_calls) == 1
    # alone: with SGD only, every round (SGD crowded out too is timed
    # alone first, and stays for the others)
    assert alone_calls == [['kfac_stale', 'sgd']] * 3
    assert set(result['timed_alone']) == {'kfac_stale'} | (
        {'sgd'} if sgd_too else set())
    assert positive(result['median_s']['sgd'])
    # once a round beside the others (or alone, crowded out itself: its
    # samples beside the others dropped), then once beside kfac_stale
    assert len(result['samples_s']['sgd']) == 6
    assert 'MemoryError' in result['timed_alone']['kfac_stale']
    assert set(result['failed']) == {'kfac_low_rank'}
    stale = result['samples_s']['kfac_stale'] + \
        result['samples_s']['kfac_stale_refresh']
    assert len(stale) == 3 and all(positive(s) for s in stale)
    assert positive(result['median_s']['kfac_stale'])
    assert positive(result['ratio_to_sgd']['kfac_stale'])
    assert len(result['samples_s']['kfac_every']) == 3
    # the failed variant's figures are left out, its samples kept
    assert result['median_s']['kfac_low_rank'] is None
    assert 'kfac_low_rank' not in result['ratio_to_sgd']
    assert 'kfac_low_rank' not in result['stage_times_s']
    assert 'kfac_low_rank' not in result['capture_by_type_s']
    assert 'kfac_every' in result['capture_by_type_s']
    assert result['n_kfac_layers'] > 0
    text = step_time.tables({'results': [result], 'gpu': False,
                             'refresh_interval': 2, 'blas_threads': 1})
    assert 'TIMED ALONE small kfac_stale' in text
    assert 'FAILED small: kfac_low_rank (round 0): RuntimeError' in text


class _FakeGraph:
    def __init__(self, stats):
        self.stats = stats
        self.capture_seconds = [0.5]
        self.closed = False

    def close(self):
        self.closed = True


def test_a_graph_that_could_not_capture_for_memory_is_timed_alone(
        monkeypatch):
    """A replayed variant whose capture ran out of memory does not fail:
    it runs eagerly under its name, never replayed. It is timed again
    alone; the others' graphs are closed first (a graph keeps its
    step's memory), and their counts are still reported."""
    from benchmarks import step_time
    made = []

    class FakeGraphStep(step_time.SGDStep):
        """The first beside the others (no room to capture), the second
        alone (captured, replayed)."""

        def __init__(self, model):
            super().__init__(model, lambda: None)
            self.graph = _FakeGraph(
                {'eager': 4, 'capture out of memory': 1,
                 'capture failed': 1} if not made else
                {'eager': 3, 'captured': 1, 'replayed': 3})
            made.append(self)

    monkeypatch.setattr(step_time, 'SGDGraphStep', FakeGraphStep)
    result = _measure(step_time, ['sgd', 'kfac_every', 'sgd_graph'])
    assert len(made) == 2
    assert made[0].graph.closed and made[1].graph.closed
    assert set(result['timed_alone']) == {'sgd_graph'}
    assert 'never replayed' in result['timed_alone']['sgd_graph']
    assert result['graph_stats']['sgd_graph']['replayed'] == 3
    assert result['not_replayed'] == []
    assert len(result['samples_s']['sgd_graph']) == 3
    assert not result['failed']


def test_crowded_out_reads_the_graph_counts():
    from benchmarks import step_time
    assert step_time.crowded_out({'capture out of memory': 1,
                                  'capture failed': 1, 'eager': 5})
    # the second try after the cached blocks went back captured
    assert not step_time.crowded_out({'capture out of memory': 1,
                                      'captured': 1, 'replayed': 4})
    # refused for another reason: not a matter of memory
    assert not step_time.crowded_out({'capture failed': 1, 'eager': 5})
    assert not step_time.crowded_out({'capture out of memory': 1,
                                      'capture failed': 1,
                                      'refresh passes: replayed': 2})
    assert step_time._variant_of('kfac_stale_refresh') == 'kfac_stale'
    assert step_time._variant_of('kfac_stale_graph_amortised') == \
        'kfac_stale_graph'


def test_dist_scaling_smoke(tmp_path):
    data, stdout = run_benchmark('dist_scaling', tmp_path)
    check_header(data, 'dist_scaling')
    assert 'Bytes per step' in stdout
    assert [r['processes'] for r in data['results']] == [1, 2]
    for result in data['results']:
        assert positive(result['step_time'])
        assert set(result['stage_times']) == set(STAGES)
        assert all(math.isfinite(v) and v >= 0
                   for v in result['stage_times'].values())
        assert positive(result['inverse_precondition'])
        assert positive(result['inverse_precondition_ratio'])
        assert len(result['per_rank']) == result['processes']
        assert positive(result['n_kfac_layers'])
        assert 0 < result['cost_model_share'] <= 1
        for wire in ('packed_fp32', 'packed_fp16', 'unpacked_fp32'):
            for kind in ('refresh', 'stale'):
                for collective in ('reduce_scatter_v', 'all_gather_v'):
                    value = result['bytes_by_wire'][wire][kind][collective]
                    assert isinstance(value, int) and value > 0
        assert result['bytes'] == result['bytes_by_wire']['packed_fp32'][
            'refresh']
        for wire in ('packed_fp32', 'packed_fp16'):
            assert all(positive(v) for v in
                       result['byte_ratios'][wire].values())
    two = data['results'][1]
    assert positive(two['reference_1_process']['inverse_precondition'])


def test_dist_scaling_output_feeds_analysis_scaling(tmp_path):
    data, _ = run_benchmark('dist_scaling', tmp_path, '--processes', '1')
    path = str(tmp_path / 'dist_scaling.json')
    loaded = scaling.load_benchmark(path)
    assert loaded['results'][0]['processes'] == 1


def test_shard_update_smoke(tmp_path):
    data, stdout = run_benchmark('shard_update', tmp_path)
    check_header(data, 'shard_update')
    assert 'Weight-update sharding' in stdout
    [result] = data['results']
    assert result['processes'] == 2 and positive(result['parameters'])
    for name in ('momentum_sgd', 'lars', 'kfac'):
        entry = result['optimizers'][name]
        for variant in ('unsharded', 'sharded'):
            figures = entry[variant]
            for key in ('step_s', 'update_s', 'update_compute_s_max'):
                assert positive(figures[key]), (name, variant, key)
            assert len(figures['state_bytes_per_rank']) == 2
            assert figures['state_bytes_max'] == max(
                figures['state_bytes_per_rank'])
        assert positive(entry['sharded']['all_gather_s'])
        # Each process holds part of the state, together all of it.
        unsharded = entry['unsharded']['state_bytes_per_rank']
        sharded = entry['sharded']['state_bytes_per_rank']
        assert unsharded[0] == unsharded[1] == sum(sharded), name
        assert all(positive(v) for v in entry['ratios'].values())


def test_convergence_smoke(tmp_path):
    run_dir = tmp_path / 'runs'
    data, stdout = run_benchmark('convergence', tmp_path, '--run-dir',
                                 str(run_dir))
    check_header(data, 'convergence')
    assert 'epochs to' in stdout
    assert data['failed'] == []
    assert {r['optimizer'] for r in data['runs']} == {'kfac', 'sgd', 'lars'}
    for run in data['runs']:
        assert run['returncode'] == 0
        assert os.path.exists(os.path.join(run['dir'], 'log'))
        assert os.path.exists(os.path.join(run['dir'], 'config.json'))
        assert positive(run['best_top1'])
        assert positive(run['train_time_s'])
        assert run['epochs_run'] == data['epochs']
    for name in ('kfac', 'sgd', 'lars'):
        summary = data['summary'][name]
        assert summary['best']['lr'] in data['lr_grid'][name]
        assert len(summary['lrs']) == len(data['lr_grid'][name])
    comparison = data['comparison']
    assert comparison['goal'] == 0.6 and isinstance(comparison['met'], bool)
    assert positive(data['global_batch_size'])
    assert positive(data['acc_iters'])


def test_lars_table1_smoke(tmp_path):
    run_dir = tmp_path / 'runs'
    data, stdout = run_benchmark('lars_table1', tmp_path, '--run-dir',
                                 str(run_dir))
    check_header(data, 'lars_table1')
    assert 'Table 1 at small scale' in stdout
    assert data['failed'] == []
    settings = ('lars_scaled_m0.9', 'lars_unscaled_m0.9',
                'lars_unscaled_m0.929', 'kfac')
    assert {r['optimizer'] for r in data['runs']} == set(settings)
    for run in data['runs']:
        with open(os.path.join(run['dir'], 'log')) as f:
            log = json.load(f)
        with open(os.path.join(run['dir'], 'config.json')) as f:
            config = json.load(f)
        setting = data['settings'][run['optimizer']]
        if setting['optimizer'] == 'lars':
            assert config['lars_momentum'] == setting['form']
            assert log[-1]['momentum'] == setting['momentum']
            # the run's own record of what it used (the table prints it)
            assert config['run']['baseline']['warmup_epochs'] == min(
                setting['warmup_epochs'], data['epochs'])
        assert positive(run['best_top1'])
    for name in settings:
        assert data['summary'][name]['best']['lr'] in data['lr_grid'][name]
    assert os.path.getsize(data['figure']) > 0


@pytest.mark.parametrize('strategy', ['shifted', 'unfolded'])
def test_conv_a_option_forces_a_strategy_where_it_applies(strategy,
                                                          monkeypatch):
    from benchmarks import step_time
    from chainerkfac.fisher_blocks import patches
    used = []

    def recording(name):
        original = getattr(patches, name)

        def record(x, geometry, *args):
            used.append((name, geometry.sy))
            return original(x, geometry, *args)
        return record

    for name in ('_shifted_gram', '_unfolded_gram'):
        monkeypatch.setattr(patches, name, recording(name))
    spec = step_time.SMOKE['small']
    # --conv-a passes KFAC(conv_a_strategy=...), an option of the blocks.
    step = step_time.KFACStep(
        step_time.build_model(spec['arch'], spec['kwargs']), 1, gpu=False,
        conv_a_strategy=strategy)
    step(*step_time._batch(spec, numpy))
    # Stride-1 3x3 convolutions: the forced strategy; strided ones and 1x1
    # (G, shortcuts) can only be unfolded.
    stride_one = {name for name, stride in used if stride == 1}
    assert ('_shifted_gram' in stride_one) == (strategy == 'shifted')
    assert {name for name, stride in used if stride == 2} == {
        '_unfolded_gram'}


def test_step_time_throughput_sweep_smoke(tmp_path):
    data, stdout = run_benchmark('step_time', tmp_path, '--batches', '4,8',
                                 '--workspace-sizes', '8MiB,1GiB')
    check_header(data, 'step_time')
    assert 'Throughput, images per second' in stdout
    assert (tmp_path / 'step_time.png').stat().st_size > 0
    sweep = data['sweep']
    assert [(r['batch'], r['workspace_bytes']) for r in sweep] == [
        (4, 8 << 20), (8, 8 << 20), (4, 1 << 30), (8, 1 << 30)]
    for r in sweep:
        ips = r['images_per_s']
        assert set(ips) == {'sgd', 'kfac_every', 'kfac_stale',
                            'kfac_stale_amortised'}
        assert all(positive(v) for v in ips.values())
        # images/s is the batch over the median step
        assert ips['sgd'] == pytest.approx(r['batch'] / r['median_s']['sgd'])
        # the amortised cycle lies between its every-step and stale parts
        # (which of the two is faster is a timing: at batch 4 on a loaded
        # machine either can be)
        low, high = sorted((ips['kfac_every'], ips['kfac_stale']))
        assert low <= ips['kfac_stale_amortised'] * (1 + 1e-12) and \
            ips['kfac_stale_amortised'] <= high * (1 + 1e-12)
        assert 'peer_pytorch' not in r     # --peer needs --gpu


def test_step_time_throughput_arithmetic_and_table():
    from benchmarks import step_time
    ips = step_time.images_per_second(
        {'sgd': 0.1, 'kfac_inverse': 0.4, 'kfac_inverse_stale': 0.2,
         'kfac_inverse_stale_refresh': 0.5}, 32, 4, 'kfac_inverse',
        'kfac_inverse_stale')
    assert ips['sgd'] == pytest.approx(320)
    assert ips['kfac_inverse_stale'] == pytest.approx(160)
    assert ips['kfac_inverse_stale_amortised'] == pytest.approx(
        32 * 4 / (0.4 + 3 * 0.2))
    assert 'kfac_inverse_stale_refresh' not in ips
    row = {'model': 'resnet50', 'batch': 32, 'workspace_bytes': None,
           'images_per_s': {'sgd': 100.0},
           'peer_pytorch': {'median_s': {'sgd': 0.1}},
           'peer_images_per_s': ips}
    text = step_time.sweep_table({'sweep': [row], 'gpu': True,
                                  'autotune': True, 'refresh_interval': 4})
    assert '| resnet50 |    32 | default   |' in text
    assert 'autotune on' in text and '320' in text
    assert step_time._byte_list('8MiB,1GiB,4096,2KiB') == [
        8 << 20, 1 << 30, 4096, 2048]
    assert step_time._words(64 << 20) == '64MiB'
    import argparse
    for bad in ('8MB', 'lots', '1.5GiB'):
        with pytest.raises(argparse.ArgumentTypeError, match='KiB, MiB'):
            step_time._byte_list(bad)
    with pytest.raises(SystemExit):
        step_time.parse_args(['--batches', '0'])
    with pytest.raises(SystemExit):
        step_time.parse_args(['--inverse-only', '--batches', '8'])
    with pytest.raises(SystemExit):     # CUDA graphs need a GPU
        step_time.parse_args(['--variants', 'sgd,sgd_graph'])
    # --gpu times the replayed steps too, as train_imagenet.py --gpu runs
    assert 'sgd_graph' in step_time.parse_args(['--gpu']).variants
    assert step_time.parse_args(
        ['--gpu', '--variants', 'sgd,sgd_graph']).variants == (
            'sgd', 'sgd_graph')
    with pytest.raises(SystemExit):     # K-FAC's replayed stale steps too
        step_time.parse_args(['--variants', 'sgd,kfac_stale_graph'])
    assert 'kfac_stale_graph' in step_time.parse_args(['--gpu']).variants
    # the GPU's batch limits of the inverse stage, 0 for none batched
    assert step_time.parse_args(
        ['--gpu', '--inverse-only', '--batched-max-dims', '0,256']
    ).batched_max_dims == [0, 256]
    for bad in (['--inverse-only', '--batched-max-dims', '64'],
                ['--gpu', '--batched-max-dims', '64'],
                ['--gpu', '--inverse-only', '--batched-max-dims', '-1']):
        with pytest.raises(SystemExit):
            step_time.parse_args(bad)
    # ... and its routes from a lone factor's Cholesky factor to the inverse
    assert step_time.parse_args(
        ['--gpu', '--inverse-only', '--cholesky-inverses', 'potrs,potri']
    ).cholesky_inverses == ['potrs', 'potri']
    for bad in (['--inverse-only', '--cholesky-inverses', 'potrs'],
                ['--gpu', '--inverse-only', '--cholesky-inverses', 'lu']):
        with pytest.raises(SystemExit):
            step_time.parse_args(bad)
    # a replayed stale K-FAC variant with TF32 stage 5, amortised over its
    # cycle with the every-step TF32 variant
    assert 'kfac_stale_graph_tf32' in step_time.parse_args(['--gpu']).variants
    assert step_time.KFAC_VARIANTS['kfac_tf32'] == {
        'factor_dtype': 'tf32', 'precondition_dtype': 'tf32'}
    assert step_time.KFAC_GRAPH_VARIANTS['kfac_stale_graph_tf32'] == (
        step_time.KFAC_VARIANTS['kfac_tf32'], 'kfac_tf32')


@pytest.mark.parametrize('encoding', ['ascii', 'latin-1'])
def test_tables_print_where_stdout_cannot_encode_their_symbols(tmp_path,
                                                               encoding):
    """Under a Latin-1 or ASCII locale (``LANG=en_US`` on an older
    cluster), κ of the inverse-precision table is printed escaped; the run
    ends with 0, not a UnicodeEncodeError."""
    env = dict(_common.worker_env(threads=1), PYTHONIOENCODING=encoding)
    proc = subprocess.run(
        [sys.executable, '-m', 'benchmarks.inverse_precision', '--smoke',
         '--out', str(tmp_path / 'out.json')], cwd=ROOT, env=env,
        capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode('ascii', 'replace')
    assert b'\\u03ba_A' in proc.stdout
    assert (tmp_path / 'out.json').exists()


def test_inverse_precision_smoke(tmp_path):
    """Every precision's errors against float64 are there, finite, and
    float32's is below the others' on every block (24 mantissa bits
    against 11: a ratio of 2^13 between their roundings)."""
    data, stdout = run_benchmark('inverse_precision', tmp_path)
    check_header(data, 'inverse_precision')
    assert 'relative error against float64' in stdout
    [result] = data['results'].values()
    assert result['blocks']
    for block in result['blocks']:
        errors = block['errors']
        assert all(positive(e) for e in errors.values()), block
        assert errors['fp32'] < min(errors['tf32'], errors['fp16']), block
        assert positive(block['kappa_a']) and positive(block['kappa_g'])
    for summary in result['summary'].values():
        assert summary['median'] <= summary['p90'] <= summary['max']
    # the factors' own variants: TF32 products against another batch's
    # exact factors (TF32 rounds at ~1e-3; a batch changes much more)
    summary = result['summary']
    assert set(summary) == {'fp32', 'tf32', 'fp16', 'tf32 factors',
                            'another batch'}
    assert summary['tf32 factors']['median'] < \
        summary['another batch']['median']
    assert 'tf32 factors' in stdout


def test_step_time_sweep_tables_the_replayed_variants():
    """The replayed variants get columns where a row has them; the graphed
    stale cycle is amortised with the eager every-step step (a graphed
    run's refresh steps are eager)."""
    from benchmarks import step_time
    median = {'sgd': 0.05, 'kfac_every': 0.25, 'kfac_stale': 0.07,
              'sgd_graph': 0.02, 'kfac_stale_graph': 0.025,
              'kfac_stale_graph_refresh': 0.3}
    ips = step_time.images_per_second(median, 32, 20, 'kfac_every',
                                      'kfac_stale', 'kfac_stale_graph',
                                      extras={'kfac_stale_graph': 0.1})
    # the capture after each refresh is part of the graphed cycle
    assert ips['kfac_stale_graph_amortised'] == pytest.approx(
        32 * 20 / (0.25 + 0.1 + 19 * 0.025))
    assert ips['kfac_stale_amortised'] == pytest.approx(
        32 * 20 / (0.25 + 19 * 0.07))
    # a cycle not timed: no amortised figure rather than a flattering one
    untimed = step_time.images_per_second(
        median, 32, 20, 'kfac_every', 'kfac_stale', 'kfac_stale_graph',
        extras={'kfac_stale_graph': None})
    assert 'kfac_stale_graph_amortised' not in untimed
    assert untimed['kfac_stale_amortised'] == ips['kfac_stale_amortised']
    # with the refresh step replayed too (--replay-refresh-steps): the
    # every-step replayed step in the cycle, where it replayed
    median['kfac_every_graph'] = 0.2
    replayed = step_time.replayed_refresh_cycle(
        median, 32, 20, {'kfac_stale_graph': 0.1})
    assert replayed == {step_time.REPLAYED_REFRESH: pytest.approx(
        32 * 20 / (0.2 + 0.1 + 19 * 0.025))}
    assert step_time.replayed_refresh_cycle(
        median, 32, 20, {'kfac_stale_graph': None}) == {}
    assert step_time.replayed_refresh_cycle(
        step_time.replayed_medians({'median_s': median, 'not_replayed': [
            'kfac_every_graph']}), 32, 20, {'kfac_stale_graph': 0.1}) == {}
    ips.update(replayed)
    row = {'model': 'resnet50', 'batch': 32, 'workspace_bytes': 1 << 30,
           'images_per_s': ips}
    data = {'sweep': [row], 'gpu': True, 'autotune': True,
            'refresh_interval': 20}
    text = step_time.sweep_table(data)
    assert 'sgd_graph img/s' in text and \
        'kfac_stale_graph_amortised img/s' in text
    assert '1.6e+03' in text                     # 32 / 0.02
    eager_only = dict(row, images_per_s={'sgd': 640.0})
    assert 'graph' not in step_time.sweep_table(dict(data,
                                                     sweep=[eager_only]))


def test_step_time_drop_graph_lets_the_activations_go():
    """A Classifier keeps its last step's graph until its next forward:
    the benchmark drops it after every timed step, so that the variants'
    models do not each hold a step of activations."""
    import weakref
    from benchmarks import step_time
    import models
    numpy.random.seed(0)
    model = models.SoftLabelClassifier(models.build_model('small', 10, 8, 4))
    x = numpy.random.randn(2, 3, 8, 8).astype(numpy.float32)
    loss = model(x, numpy.array([1, 2], numpy.int32))
    loss.backward()
    node = weakref.ref(loss.creator_node)
    del loss
    assert node() is not None          # held by model.loss
    step_time.drop_graph(model)
    import gc
    gc.collect()
    assert node() is None


def test_launching_benchmarks_pass_their_options_on():
    """dist_scaling and shard_update: the sizes are the smoke or full
    ones with the given options over them, and the workers get exactly the
    given options (and --smoke)."""
    import types
    from benchmarks import _common
    smoke, full = {'rounds': 2, 'model': 'small'}, {'rounds': 8,
                                                    'model': 'resnet50'}
    args = types.SimpleNamespace(smoke=False, rounds=3, model=None)
    assert _common.spec_from(args, smoke, full, ('rounds', 'model')) == {
        'rounds': 3, 'model': 'resnet50'}
    assert _common.worker_options(args, ('rounds', 'model')) == [
        '--rounds=3']
    args = types.SimpleNamespace(smoke=True, rounds=None, model='small')
    assert _common.spec_from(args, smoke, full, ('rounds', 'model')) == smoke
    assert _common.worker_options(args, ('rounds', 'model')) == [
        '--model=small', '--smoke']


@pytest.mark.parametrize('argv, limits, timed', [
    # the default GPU run: replayed variants, so as train_imagenet.py --gpu
    # with its CUDA graphs: timed algorithms within 1 GiB for every variant
    (['--gpu'], [1 << 30], True),
    # eager variants only: cuDNN's heuristics within Chainer's 8 MiB
    (['--gpu', '--variants', 'sgd,kfac_every'], [None], False),
    (['--gpu', '--autotune'], [1 << 30], True),
    (['--gpu', '--autotune', 'off'], [1 << 30], False),
    (['--gpu', '--variants', 'sgd,kfac_stale', '--autotune'], [None], True),
    (['--gpu', '--workspace-sizes', '8MiB,64MiB'], [8 << 20, 64 << 20],
     True),
    # the CPU has no cuDNN: nothing to set
    ([], [None], False),
    (['--autotune'], [None], True),
])
def test_step_time_cudnn_as_a_run_sets_it(argv, limits, timed):
    """The benchmark's cuDNN choice is train_imagenet.py's (the one
    function, harness.tuning.cudnn_tuning), so that the default --gpu run
    times the steps a user's run takes; the options override it."""
    from benchmarks import step_time
    args = step_time.parse_args(argv)
    assert (args.workspace_limits, args.timed) == (limits, timed)
    if '--gpu' in argv:
        assert ('timed' if timed else "cuDNN's heuristics") in args.cudnn
    with pytest.raises(SystemExit):
        step_time.parse_args(['--autotune', 'sometimes'])


def test_step_time_goals_against_the_peer():
    """Ours over the peer's step, the replayed step where it ran, each
    against the issue's bound; a goal whose steps did not both run is left
    out, and the table says met / NOT met."""
    from benchmarks import step_time
    theirs = {'sgd': 0.020, 'kfac_inverse': 0.30, 'kfac_inverse_stale': 0.04}
    ours = {'sgd': 0.050, 'sgd_graph': 0.019, 'kfac_every': 0.20,
            'kfac_stale': 0.07, 'kfac_stale_graph': 0.026,
            'kfac_low_rank': 0.12}
    goals = step_time.goals_vs_peer(ours, theirs)
    assert goals['SGD step']['ours'] == 'sgd_graph'
    assert goals['SGD step']['value'] == pytest.approx(0.019 / 0.020)
    assert goals['SGD step']['met']
    assert goals['K-FAC stale step']['value'] == pytest.approx(0.026 / 0.04)
    assert goals['K-FAC stale step']['met']           # 0.65 <= 0.8
    assert goals['K-FAC every step']['value'] == pytest.approx(0.2 / 0.3)
    assert not goals['K-FAC every step']['met']       # 0.67 > 0.5
    low_rank = goals['K-FAC every step, low-rank factors']
    assert low_rank['value'] == pytest.approx(0.12 / 0.3)
    assert low_rank['met'] and low_rank['ours'] == 'kfac_low_rank'
    # without the replayed variants, the eager steps are compared
    eager = step_time.goals_vs_peer(
        {'sgd': 0.050, 'kfac_stale': 0.07}, theirs)
    assert eager['SGD step']['ours'] == 'sgd'
    assert not eager['SGD step']['met']
    assert set(eager) == {'SGD step', 'K-FAC stale step'}
    text = step_time.goals_vs_peer_table([(32, goals)])
    assert 'Goals against the peer' in text
    assert text.count('NOT met') == 1 and text.count('met') == 4
    # in the sweep's table, per batch
    row = {'model': 'resnet50', 'batch': 64, 'workspace_bytes': 1 << 30,
           'images_per_s': {'sgd': 1000.0}, 'goals_vs_peer': eager}
    text = step_time.sweep_table({'sweep': [row], 'gpu': True,
                                  'autotune': True, 'refresh_interval': 20})
    assert 'Goals against the peer' in text and '|    64 | SGD step' in text


def test_step_time_reports_the_timed_ways_of_forming_a(monkeypatch):
    """The GPU run records which way each convolution input shape's A
    took by timing (autotune), and the summary counts them."""
    from benchmarks import step_time
    from chainerkfac.fisher_blocks import patches
    g = patches.ConvGeometry(3, 3, 1, 1, 1, 1)
    monkeypatch.setattr(patches, '_TIMED', {
        ((32, 64, 56, 56), '<f4', g, '<f4', False, '@cupy:0'): 'shifted',
        ((32, 512, 7, 7), '<f4', g, '<f4', False, '@cupy:0'): 'unfolded',
        ((32, 128, 28, 28), '<f4', g, '<f4', False, '@cupy:0'): 'shifted',
        ((32, 512, 7, 7), '<f4', g, '<f4', True, '@cupy:0'): 'shifted',
        ((32, 512, 7, 7), '<f4', g, '<f2', False, '@cupy:0'): 'shifted'})
    timed = step_time.conv_a_timed()
    assert (timed['shifted'], timed['unfolded']) == (4, 1)
    assert timed['shapes']['32x512x7x7 3x3 float32'] == 'unfolded'
    assert timed['shapes']['32x512x7x7 3x3 tf32'] == 'shifted'
    assert timed['shapes']['32x512x7x7 3x3 fp16'] == 'shifted'


def test_step_time_reports_the_timed_inverse_routes(monkeypatch):
    """The GPU run records how the lone factors of each size went from
    their Cholesky factor to their inverse by timing, and says so under
    the capture table."""
    from benchmarks import step_time
    from chainerkfac import linalg_cuda
    monkeypatch.setattr(linalg_cuda, '_TIMED_ROUTES', {
        (4608, 'float32', 0): 'potrs', (1000, 'float32', 0): 'potri'})
    timed = step_time.inverse_routes_timed()
    assert timed == {'n=1000 float32': 'potri', 'n=4608 float32': 'potrs'}
    spec = step_time.SMOKE['small']
    result = step_time.measure('small', spec, ['sgd', 'kfac_every'], 20, 1,
                               1, numpy)
    result['inverse_routes_timed'] = timed
    text = step_time.tables({'results': [result], 'refresh_interval': 20,
                             'gpu': False, 'blas_threads': 1})
    assert ('small: lone factors inverted by potrs / potri, by timing '
            '(autotune): n=1000 float32 potri, n=4608 float32 potrs') in text


def test_step_time_a_failing_variant_does_not_lose_the_run(monkeypatch,
                                                           capsys):
    """A variant that raises (on the GPU: a kernel, a capture, memory) is
    taken out of the run and named; the other variants are timed."""
    from benchmarks import step_time
    spec = step_time.SMOKE['small']
    original = step_time.KFACStep.__call__

    def call(self, x, t):
        if self.optimizer.precondition_dtype == 'tf32':
            raise RuntimeError('out of memory (test)')
        return original(self, x, t)
    monkeypatch.setattr(step_time.KFACStep, '__call__', call)
    result = step_time.measure('small', spec, ['sgd', 'kfac_every',
                                               'kfac_tf32'], 20, 2, 1, numpy)
    assert list(result['failed']) == ['kfac_tf32']
    assert 'warm-up' in result['failed']['kfac_tf32']
    assert 'out of memory (test)' in result['failed']['kfac_tf32']
    assert positive(result['median_s']['kfac_every'])
    assert result['median_s']['kfac_tf32'] is None
    assert set(result['capture_by_type_s']) == {'kfac_every'}
    text = step_time.tables({'results': [result], 'refresh_interval': 20,
                             'gpu': False, 'blas_threads': 1})
    assert 'FAILED small: kfac_tf32 (warm-up)' in text
    assert 'FAILED kfac_tf32' in capsys.readouterr().err


def test_step_time_saves_the_rounds_before_the_capture_timing(
        monkeypatch, capsys):
    """What the rounds measured is saved before the capture timing (a GPU
    run stopped by its time limit there keeps its step times), marked
    partial; each round's times are shown as they come."""
    from benchmarks import step_time
    spec = step_time.SMOKE['small']
    saved = []

    def stop(*args):
        raise KeyboardInterrupt('the time limit (test)')
    monkeypatch.setattr(step_time, 'time_capture', stop)
    with pytest.raises(KeyboardInterrupt):
        step_time.measure('small', spec, ['sgd', 'kfac_every'], 20, 2, 1,
                          numpy, save=saved.append)
    [partial] = saved
    assert partial['partial'] is True
    assert positive(partial['median_s']['sgd'])
    assert positive(partial['median_s']['kfac_every'])
    assert len(partial['samples_s']['kfac_every']) == 2
    assert partial['capture_by_type_s'] == {}
    json.dumps(partial)                       # it can be written
    err = capsys.readouterr().err
    assert 'round 1/2: ' in err and 'round 2/2: ' in err
    monkeypatch.undo()
    result = step_time.measure('small', spec, ['sgd', 'kfac_every'], 20, 1,
                               1, numpy, save=saved.append)
    assert 'partial' not in result and saved[-1]['partial'] is True
    assert set(result['capture_by_type_s']) == {'kfac_every'}


def test_step_time_tables_leave_out_the_stages_of_replayed_steps(
        monkeypatch):
    """A replayed variant has no stage split (its steps are timed whole):
    no empty row in the stage table; and a run whose SGD failed still
    summarises the others."""
    from benchmarks import step_time
    spec = step_time.SMOKE['small']
    result = step_time.measure('small', spec, ['sgd', 'kfac_every'], 20, 1,
                               1, numpy)
    result['median_s']['sgd_graph'] = 0.01
    result['stage_times_s']['sgd_graph'] = {}
    text = step_time.tables({'results': [result], 'refresh_interval': 20,
                             'gpu': True, 'blas_threads': 1})
    stages = text.split('Stage times')[1].split('Where')[0]
    assert '| small | kfac_every |' in stages
    assert 'sgd_graph' not in stages

    def broken(self, x, t):
        raise RuntimeError('SGD broke (test)')
    monkeypatch.setattr(step_time.SGDStep, '__call__', broken)
    result = step_time.measure('small', spec, ['sgd', 'kfac_every'], 20, 1,
                               1, numpy)
    assert list(result['failed']) == ['sgd']
    assert result['extra_over_sgd'] == {}
    assert positive(result['median_s']['kfac_every'])
    text = step_time.tables({'results': [result], 'refresh_interval': 20,
                             'gpu': False, 'blas_threads': 1})
    assert 'FAILED small: sgd (warm-up)' in text
    # the GPU's ResNet-50 goals divide by SGD's step: left out, not raised
    gpu = step_time.goals(dict(result, model='resnet50'), 'gpu')
    assert 'forward_backward_over_sgd' not in gpu
    assert gpu['capture_s']['value'] == \
        result['capture_by_type_s']['kfac_every']['total']


def test_step_time_times_each_variant_without_the_others_hooks():
    """An every-step K-FAC optimizer keeps its capture hook in the
    thread's function hooks between steps; while another variant's step
    is timed, it is set aside (each of the default run's variants made a
    few hundred calls into the others' hooks a step), and put back."""
    import chainer
    from benchmarks import step_time
    spec = step_time.SMOKE['small']
    x, t = step_time._batch(spec, numpy)
    steps = {'sgd': step_time.SGDStep(step_time.build_model(
        spec['arch'], spec['kwargs']), lambda: None)}
    for name in ('kfac_every', 'kfac_tf32'):
        steps[name] = step_time.KFACStep(
            step_time.build_model(spec['arch'], spec['kwargs']), 1, False)
        steps[name](x, t)
    hooks = chainer.get_function_hooks()
    names = {n: step_time._capture_hook(steps[n]).name
             for n in ('kfac_every', 'kfac_tf32')}
    assert set(names.values()) <= set(hooks)
    with step_time.alone(steps['sgd'], steps):
        assert not set(names.values()) & set(hooks)
    with step_time.alone(steps['kfac_every'], steps):
        assert names['kfac_every'] in hooks
        assert names['kfac_tf32'] not in hooks
    assert set(names.values()) <= set(hooks)
    for step in steps.values():      # let the hooks go with the optimizers
        if hasattr(step.optimizer, 'estimator'):
            step.optimizer.estimator.capture_hook.remove()


class _CycleStep:
    """A replayed K-FAC variant's stand-in: a refresh at step
    ``refresh_at``; the step after it is ``after`` ('captured' where the
    refresh dropped the graph, 'replayed' where it kept it)."""

    def __init__(self, refresh_at, after):
        import collections
        self.graph = types.SimpleNamespace(stats=collections.Counter())
        self.refresh_at, self.after = refresh_at, after
        self.calls = 0
        self.refreshed = False

    def __call__(self, x, t):
        self.calls += 1
        self.refreshed = self.calls == self.refresh_at
        if self.refreshed:
            way = 'eager'
        elif self.calls == self.refresh_at + 1:
            way = self.after
        else:
            way = 'replayed'
        self.graph.stats[way] += 1


@pytest.mark.parametrize('after', ['captured', 'replayed'])
def test_step_time_refresh_cycle_finds_what_a_refresh_costs(after):
    """The step after a graphed variant's refresh is timed and named: a
    capture again is what every cycle pays beyond its refresh step and
    replays (less a replay, at least 0); a replay costs nothing more."""
    from benchmarks import step_time
    step = _CycleStep(refresh_at=4, after=after)
    cycle = step_time.refresh_cycle(step, None, None, 20, lambda: None)
    assert step.calls == 5
    assert cycle['steps_to_refresh'] == 4 and cycle['next'] == after
    assert cycle['refresh_s'] >= 0 and cycle['next_s'] >= 0
    timed = dict(cycle, next_s=0.3)
    assert step_time.recapture_seconds(timed, 0.05) == (
        pytest.approx(0.25) if after == 'captured' else 0.0)
    assert step_time.recapture_seconds(dict(timed, next_s=0.01), 0.05) == 0
    assert step_time.recapture_seconds({'failed': 'x'}, 0.05) is None
    assert step_time.recapture_seconds(timed, None) is None
    never = _CycleStep(refresh_at=99, after=after)
    with pytest.raises(RuntimeError, match='no refresh step within 6'):
        step_time.refresh_cycle(never, None, None, 5, lambda: None)


def test_step_time_amortises_a_graphed_cycle_with_its_recapture(
        monkeypatch):
    """measure() times each graphed variant's refresh cycle after the
    rounds and puts its recapture into the amortised ratio of every
    round. On the CPU a StepGraph runs every step eagerly (the cycle is
    timed as 'eager', nothing added); a cycle that captured again is put
    in by a stand-in."""
    from benchmarks import step_time
    spec = dict(step_time.SMOKE['small'], rounds=2, warmup=1)
    variants = ('sgd', 'kfac_every', 'kfac_stale_graph')
    eager = step_time.measure('small', spec, variants, 3, spec['rounds'],
                              spec['warmup'], numpy)
    cycle = eager['refresh_cycle']['kfac_stale_graph']
    assert cycle['next'] == 'eager' and cycle['recapture_s'] == 0.0
    assert 1 <= cycle['steps_to_refresh'] <= 4
    samples = eager['samples_s']
    expected = [(e + 2 * g) / 3 / s for e, g, s in zip(
        samples['kfac_every'], samples['kfac_stale_graph'], samples['sgd'])]
    assert eager['ratio_to_sgd']['kfac_stale_graph_amortised'] == \
        pytest.approx(sorted(expected)[len(expected) // 2] if
                      len(expected) % 2 else sum(sorted(expected)) / 2)

    def recaptured(step, *args, **kwargs):
        return {'steps_to_refresh': 3, 'refresh_s': 1.0, 'next_s': 10.0,
                'next': 'captured'}
    monkeypatch.setattr(step_time, 'refresh_cycle', recaptured)
    slow = step_time.measure('small', spec, variants, 3, spec['rounds'],
                             spec['warmup'], numpy)
    extra = slow['refresh_cycle']['kfac_stale_graph']['recapture_s']
    median_graph = slow['median_s']['kfac_stale_graph']
    assert extra == pytest.approx(10.0 - median_graph)
    samples = slow['samples_s']
    expected = sorted((e + extra + 2 * g) / 3 / s for e, g, s in zip(
        samples['kfac_every'], samples['kfac_stale_graph'], samples['sgd']))
    assert slow['ratio_to_sgd']['kfac_stale_graph_amortised'] == \
        pytest.approx(sum(expected) / 2)
    assert step_time.recaptures(slow) == {'kfac_stale_graph': extra}


def test_step_time_goals_leave_out_a_graph_that_never_replayed():
    """A graphed variant whose capture failed is timed eagerly under its
    name: the goals against the peer take the eager variant instead."""
    from benchmarks import step_time
    result = {'median_s': {'sgd': 0.05, 'sgd_graph': 0.049,
                           'kfac_stale': 0.07, 'kfac_stale_graph': 0.03},
              'not_replayed': ['sgd_graph']}
    goals = step_time.goals_vs_peer(step_time.replayed_medians(result),
                                    {'sgd': 0.04,
                                     'kfac_inverse_stale': 0.05})
    assert goals['SGD step']['ours'] == 'sgd'
    assert goals['K-FAC stale step']['ours'] == 'kfac_stale_graph'
    assert goals['SGD step']['value'] == pytest.approx(0.05 / 0.04)


def test_step_time_every_step_goal_takes_the_replayed_passes():
    """``kfac_every_graph`` (the refresh steps' passes replayed) is in
    ``--gpu``'s runs and the sweep's, counts as replayed by its passes'
    replays, and is the every-step goal's step where it replayed."""
    from benchmarks import step_time
    assert 'kfac_every_graph' in step_time.parse_args(['--gpu']).variants
    assert 'kfac_every_graph' in step_time.SWEEP_GPU_VARIANTS
    with pytest.raises(SystemExit):     # CUDA graphs need a GPU
        step_time.parse_args(['--variants', 'sgd,kfac_every_graph'])
    assert step_time.replayed({'eager': 9, 'refresh passes: replayed': 5}
                              ) == 5
    assert step_time.replayed({'eager': 9}) == 0
    theirs = {'kfac_inverse': 0.4}
    result = {'median_s': {'kfac_every': 0.38, 'kfac_every_graph': 0.27}}
    goals = step_time.goals_vs_peer(step_time.replayed_medians(result),
                                    theirs)
    assert goals['K-FAC every step']['ours'] == 'kfac_every_graph'
    assert goals['K-FAC every step']['value'] == pytest.approx(0.27 / 0.4)
    result['not_replayed'] = ['kfac_every_graph']
    goals = step_time.goals_vs_peer(step_time.replayed_medians(result),
                                    theirs)
    assert goals['K-FAC every step']['ours'] == 'kfac_every'


def test_step_time_sweep_point_by_point_in_processes(tmp_path):
    """On the GPU each batch of a sweep runs in a process of its own (its
    device memory gone with it); here forced on the CPU: the same rows,
    merged, and the table and PNG from them."""
    data, stdout = run_benchmark('step_time', tmp_path, '--batches', '4,8',
                                 '--process-per-batch', 'on')
    assert stdout.count('in a process of its own') == 2
    assert [r['batch'] for r in data['sweep']] == [4, 8]
    for r in data['sweep']:
        assert 'failed' not in r or r['failed'] == {}
        assert positive(r['images_per_s']['sgd'])
    assert 'Throughput, images per second' in stdout
    assert (tmp_path / 'step_time.png').stat().st_size > 0


def test_step_time_a_sweep_point_that_dies_is_recorded(monkeypatch,
                                                        tmp_path):
    from benchmarks import step_time
    argv = ['--gpu', '--peer', '--batches=32,64', '--out', 'x.json',
            '--models', 'resnet50']
    assert step_time.point_argv(argv, 64, 'p.json') == [
        '--gpu', '--peer', '--models', 'resnet50', '--batches', '64',
        '--out', 'p.json', '--process-per-batch', 'off']
    calls = []

    def run(command):
        calls.append(command)
        return types.SimpleNamespace(returncode=-9)     # killed: no JSON
    monkeypatch.setattr(step_time.subprocess, 'run', run)
    args = step_time.parse_args(argv)
    saved = []
    rows = step_time.sweep_in_processes(argv, args, {'resnet50': {}},
                                        saved.append)
    assert len(calls) == 2 and len(saved) == 2
    assert [(r['batch'], r['failed']) for r in rows] == [
        (32, 'its process ended with exit status -9'),
        (64, 'its process ended with exit status -9')]
    text = step_time.sweep_table({'sweep': rows, 'gpu': True,
                                  'autotune': True, 'refresh_interval': 20})
    assert 'FAILED resnet50 at batch 64: its process ended' in text


def test_step_time_gpu_sweep_defaults_to_what_its_table_reads():
    from benchmarks import step_time
    assert step_time.parse_args(['--gpu']).variants == step_time.GPU_VARIANTS
    sweep = step_time.parse_args(['--gpu', '--batches', '32,256']).variants
    assert sweep == step_time.SWEEP_GPU_VARIANTS
    read = set(step_time.THROUGHPUT[:3]) | {
        v for _, candidates, _, _ in step_time.PEER_GOALS
        for v in candidates}
    assert read == set(sweep)


def test_dropout_bound_smoke(tmp_path):
    """The dropout study in seconds: one K-FAC run per kl_clip and
    MomentumSGD's, each with its epochs' ν (K-FAC), loss and accuracy;
    the default bound's run holds ν near 0.01 at this width too."""
    data, out = run_benchmark('dropout_bound', tmp_path)
    check_header(data, 'dropout_bound')
    names = [r['run'] for r in data['runs']]
    assert names == ['KFAC kl_clip=0.0001', 'KFAC kl_clip=0.01',
                     'MomentumSGD']
    for run in data['runs']:
        epoch, = run['epochs']
        assert positive(epoch['loss'])
        assert 0 <= epoch['validation_accuracy'] <= 1
        assert ('step_scale' in epoch) == run['run'].startswith('KFAC')
    default, wider = (r['epochs'][0]['step_scale']['mean']
                      for r in data['runs'][:2])
    assert default < 0.05 < wider
    assert 'wrote' in out

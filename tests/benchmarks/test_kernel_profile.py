"""benchmarks/kernel_profile.py on a CPU: the categories of real kernel
names, the sums of a trace (overlaps counted once in the busy time), the
profiling loop against a stand-in of PyTorch's profiler (stale variants
profiled on stale steps only), --resummarise from moved traces, the
tables and the PNG; without a GPU, a message. Its figures need a GPU."""
import gzip
import json
import sys
import types

import pytest

from benchmarks import kernel_profile as kp

#: Kernel names as cuDNN 9, cuBLAS, cuSOLVER, CuPy / Chainer, this
#: project and PyTorch 2 give them, and the category each belongs to.
NAMES = [
    ('sm90_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nchwkcrs_nchw_'
     'tilesize128x128x32_warpgroupsize1x1x1_g1_execute_kernel__5x_cudnn',
     'conv forward'),
    ('ampere_scudnn_128x64_relu_interior_nn_v1', 'conv forward'),
    ('void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>'
     '(cudnn::winograd_nonfused::WinogradDataParams<float, float>)',
     'conv forward'),
    ('sm80_xmma_dgrad_implicit_gemm_indexed_tf32f32_tf32f32_f32_nchwkcrs_'
     'nchw_tilesize64x64x32_stage4_warpsize2x2x1_g1_tensor16x8x8_kernel',
     'conv dgrad'),
    ('sm80_xmma_wgrad_implicit_gemm_indexed_tf32f32_tf32f32_f32_nchwkcrs_'
     'nchw_tilesize128x128x16_stage4_warpsize2x2x1_g1_tensor16x8x8_kernel',
     'conv wgrad'),
    ('void cudnn::cnn::wgrad_alg0_engine<float, 128, 5, 5, 3, 3, 3, false, '
     '512>(int, int, int, float const*, int, float*, float const*)',
     'conv wgrad'),
    ('void cudnn::ops::nchwToNhwcKernel<float, float, float, false, true, '
     '(cudnnKernelDataType_t)2>(cudnn::ops::nchw2nhwc_params_t<float>, '
     'float const*, float*)', 'layout'),
    ('void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, '
     '1>(cudnnTensorStruct, float const*, cudnnTensorStruct, float*)',
     'batch norm'),
    ('void cudnn::bn_bw_1C11_kernel_new<float, float, float2, 512, true, 1>'
     '(float, float, float, float, cudnnTensorStruct, float const*)',
     'batch norm'),
    ('void at::native::batch_norm_collect_statistics_kernel<at::native::'
     'InvStd, float, float, float, int>(at::GenericPackedTensorAccessor)',
     'batch norm'),
    ('void cudnn::ops::activation_fw_4d_kernel<float, float, 128, 1, 4, '
     'cudnn::ops::relu_func<float, (cudnnNanPropagation_t)0, false> >',
     'activation'),
    ('relu_bwd', 'activation'),
    ('void at::native::vectorized_elementwise_kernel<4, at::native::'
     '(anonymous namespace)::launch_clamp_scalar(at::TensorIteratorBase&, '
     'c10::Scalar, c10::Scalar, at::native::detail::ClampLimits)',
     'activation'),
    ('void cudnn::ops::pooling_fw_4d_kernel<float, float, cudnn::'
     'maxpooling_func<float, (cudnnNanPropagation_t)0>, '
     '(cudnnPoolingMode_t)0, false>', 'pooling'),
    ('void at::native::(anonymous namespace)::max_pool_backward_nchw'
     '<float, float>(float const*, long const*, int, long)', 'pooling'),
    ('sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32_'
     'warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_cublas', 'GEMM'),
    ('ampere_sgemm_128x64_tn', 'GEMM'),
    ('void splitKreduce_kernel<32, 16, int, float, float, float, float, '
     'true, false, false>(cublasSplitKParams<float>, float const*)',
     'GEMM'),
    ('void trsm_left_kernel<float, 256, 4, false, false, true, false, '
     'true>(cublasTrsmParams<float>, float, float const*, int)',
     'inverse (cuSOLVER, trsm)'),
    ('void potrf_alg2_cta_upper<float, float, 32>(int, int, float*, int)',
     'inverse (cuSOLVER, trsm)'),
    ('void cudnn::ops::softmax_fw_kernel<2, float, float, 256, 1, 1, 0>',
     'softmax, loss'),
    ('softmax_crossent_bwd', 'softmax, loss'),
    ('void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda'
     '_kernel_2d<float, float, long>(float*, float*, float const*)',
     'softmax, loss'),
    ('momentum_sgd', 'optimizer update'),
    ('chainerkfac_regularized_grad', 'optimizer update'),
    ('guard_save_32', 'optimizer update'),
    ('void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at'
     '::native::(anonymous namespace)::TensorListMetadata<3>, at::native::'
     '(anonymous namespace)::FusedSgdMathFunctor<float, 3> >',
     'optimizer update'),
    ('cupy_sum', 'reduction'),
    ('void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, '
     'at::native::MeanOps<float, float, float, float>, unsigned int> >',
     'reduction'),
    ('cupy_copy__float32_float32', 'copy, fill'),
    ('void at::native::vectorized_elementwise_kernel<4, at::native::'
     'FillFunctor<float>, at::detail::Array<char*, 1> >', 'copy, fill'),
    ('cupy_add__float32_float32_float32', 'elementwise'),
    ('void at::native::vectorized_elementwise_kernel<4, at::native::'
     'CUDAFunctor_add<float>, at::detail::Array<char*, 3> >',
     'elementwise'),
    ('some_kernel_nobody_named', 'other'),
]


@pytest.mark.parametrize('name, expected', NAMES)
def test_categories_of_real_kernel_names(name, expected):
    assert kp.category(name) == expected


def _event(name, ts, dur, cat='kernel', ph='X'):
    return {'ph': ph, 'cat': cat, 'name': name, 'ts': ts, 'dur': dur,
            'pid': 0, 'tid': 7}


def _trace(scale=1.0):
    """Two steps: a convolution on one stream overlapping a BN kernel on
    another, an elementwise add, a copy, and host events to leave out."""
    events = []
    for step in range(2):
        base = 1000.0 * step
        events += [
            _event('sm80_xmma_fprop_implicit_gemm_x', base, 40 * scale),
            _event('cudnn::bn_fw_tr_1C11_kernel_NCHW', base + 30, 20),
            _event('cupy_add__float32_float32_float32', base + 100, 10),
            _event('Memcpy DtoD (Device -> Device)', base + 200, 5,
                   cat='gpu_memcpy'),
            _event('cudaLaunchKernel', base, 3, cat='cuda_runtime'),
            _event('aten::add', base, 50, cat='cpu_op'),
            _event('instant', base, 0, ph='i'),
        ]
    return {'traceEvents': events}


def test_summarise_sums_per_step_and_counts_overlaps_once():
    summary = kp.summarise(_trace(), steps=2, top=2)
    assert summary['events'] == 8
    categories = summary['categories']
    assert categories['conv forward'] == {'us_per_step': 40.0,
                                          'count_per_step': 1.0}
    assert categories['batch norm']['us_per_step'] == 20.0
    assert categories['elementwise']['us_per_step'] == 10.0
    assert categories[kp.MEMORY]['us_per_step'] == 5.0
    assert list(categories) == [c for c in kp.ORDER if c in categories]
    assert summary['device_us_per_step'] == 75.0
    # the BN kernel runs within the convolution's [0, 40) from 30 to 50
    assert summary['busy_us_per_step'] == 50.0 + 10.0 + 5.0
    assert summary['span_us_per_step'] == (1205.0 - 0.0) / 2
    assert [t['name'] for t in summary['top']] == [
        'sm80_xmma_fprop_implicit_gemm_x', 'cudnn::bn_fw_tr_1C11_kernel_NCHW']


def test_busy_time_unions_intervals():
    assert kp.busy_time([]) == 0.0
    assert kp.busy_time([(0, 10), (2, 3), (10, 5), (20, 1)]) == 16.0
    assert kp.busy_time([(5, 5), (0, 6)]) == 10.0


def test_tables_pair_ours_with_the_peer():
    ours = kp.summarise(_trace(scale=2.0), 2)
    theirs = kp.summarise(_trace(), 2)
    ours['wall_us_per_step'], theirs['wall_us_per_step'] = 300.0, 250.0
    text = kp.pair_table(ours, theirs)
    conv = next(line for line in text.splitlines()
                if line.startswith('| conv forward'))
    assert [c.strip() for c in conv.strip('|').split('|')] == [
        'conv forward', '80', '1', '40', '1', '40']
    wall = next(line for line in text.splitlines() if 'wall' in line)
    assert wall.rstrip(' |').endswith('50')
    alone = kp.pair_table(ours, None)
    conv = next(line for line in alone.splitlines()
                if line.startswith('| conv forward'))
    assert [c.strip() for c in conv.strip('|').split('|')] == [
        'conv forward', '80', '1', '-', '-', '-']
    data = {'batch': 64, 'ours': {'sgd_graph': ours, 'kfac_every': ours},
            'peer': {'sgd': theirs}}
    text = kp.tables(data)
    assert "ours sgd_graph (batch 64) against the peer's sgd" in text
    assert 'ours kfac_every (batch 64):' in text
    assert 'largest kernels, peer sgd' in text


def test_figure_is_a_png(tmp_path):
    ours, theirs = kp.summarise(_trace(2.0), 2), kp.summarise(_trace(), 2)
    path = tmp_path / 'k.png'
    kp.figure({'batch': 32, 'ours': {'sgd': ours, 'kfac_every': ours},
               'peer': {'sgd': theirs}}, str(path))
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    assert not list(tmp_path.glob('*.tmp.png'))


class FakeProfiler:
    """``torch.profiler``'s profile: writes the trace it was given."""

    def __init__(self, trace, seen):
        self.trace, self.seen = trace, seen

    def __call__(self, activities):
        self.seen.append(activities)
        return self

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def export_chrome_trace(self, path):
        assert not path.endswith('.gz')   # PyTorch would gzip it itself
        with open(path, 'w') as f:
            json.dump(self.trace, f)


@pytest.fixture
def fake_torch(monkeypatch):
    seen = []
    torch = types.ModuleType('torch')
    torch.profiler = types.SimpleNamespace(
        ProfilerActivity=types.SimpleNamespace(CUDA='CUDA'),
        profile=FakeProfiler(_trace(), seen))
    monkeypatch.setitem(sys.modules, 'torch', torch)
    return seen


def test_profile_keeps_the_trace_and_starts_stale_runs_after_a_refresh(
        fake_torch, tmp_path):
    calls = []

    def step():   # refreshes at its 1st, 21st, ... call
        calls.append(len(calls))
        return len(calls) % 20 == 1
    path = str(tmp_path / 'traces' / 'ours_kfac_stale.json.gz')
    summary = kp.profile(step, steps=30, warmup=3, synchronize=lambda: None,
                         trace_path=path, stale_interval=20)
    # 3 warm-up steps, 18 more to the refresh at the 21st, one stale step
    # unprofiled (a graphed variant's capture), then at most 18
    assert len(calls) == 3 + 18 + 1 + 18
    assert summary['steps'] == 18 and summary['refresh_steps'] == 0
    assert summary['trace'] == path and fake_torch == [['CUDA']]
    with gzip.open(path, 'rt') as f:
        assert json.load(f) == _trace()
    assert sorted(p.name for p in (tmp_path / 'traces').iterdir()) == [
        'ours_kfac_stale.json.gz']
    assert summary['wall_us_per_step'] > 0 and 'warning' not in summary


def test_profile_without_kernels_says_so(fake_torch, monkeypatch, tmp_path):
    monkeypatch.setattr(sys.modules['torch'].profiler, 'profile',
                        FakeProfiler({'traceEvents': []}, []))
    summary = kp.profile(lambda: False, 2, 0, lambda: None,
                         str(tmp_path / 'x.json.gz'))
    assert summary['events'] == 0 and 'no kernel' in summary['warning']


def test_a_stale_variant_that_never_refreshes_is_an_error(fake_torch,
                                                          tmp_path):
    with pytest.raises(RuntimeError, match='no refresh in 21 steps'):
        kp.profile(lambda: False, 2, 0, lambda: None,
                   str(tmp_path / 'x.json.gz'), stale_interval=20)


def test_resummarise_finds_moved_traces(tmp_path, capsys):
    traces = tmp_path / 'kp_traces'
    traces.mkdir()
    for name in ('ours_sgd', 'peer_sgd'):
        with gzip.open(traces / (name + '.json.gz'), 'wt') as f:
            json.dump(_trace(), f)
    stale = {'steps': 2, 'categories': {}, 'wall_us_per_step': 123.0,
             'refresh_steps': 0, 'busy_us_per_step': 0.0}
    result = {'batch': 64,
              'ours': {'sgd': dict(stale, trace='/gpu/out/kp_traces/'
                                   'ours_sgd.json.gz')},
              'peer': {'sgd': dict(stale, trace='/gpu/out/kp_traces/'
                                   'peer_sgd.json.gz')}}
    source = tmp_path / 'kp.json'
    source.write_text(json.dumps(result))
    out = tmp_path / 'again.json'
    assert kp.main(['--resummarise', str(source), '--out', str(out)]) == 0
    data = json.loads(out.read_text())
    assert data['ours']['sgd']['busy_us_per_step'] == 65.0
    assert data['ours']['sgd']['wall_us_per_step'] == 123.0
    assert data['peer']['sgd']['categories']['conv forward'][
        'us_per_step'] == 40.0
    assert (tmp_path / 'again.png').exists()
    assert "against the peer's sgd" in capsys.readouterr().out
    (traces / 'peer_sgd.json.gz').unlink()
    with pytest.raises(SystemExit, match='the trace of peer sgd is missing'):
        kp.main(['--resummarise', str(source), '--out', str(out)])


def test_without_a_gpu_it_says_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, 'cupy', None)
    with pytest.raises(SystemExit, match='kernel_profile: CuPy on a CUDA '
                       'GPU is needed'):
        kp.main(['--out', str(tmp_path / 'k.json')])
    assert not (tmp_path / 'k.json').exists()


def test_arguments():
    args = kp.parse_args([])
    assert args.variants == kp.DEFAULT_VARIANTS and args.batch == 64
    assert args.peer_variants == ('sgd', 'kfac_inverse',
                                  'kfac_inverse_stale')
    args = kp.parse_args(['--variants', 'sgd_graph', '--peer-variants', ''])
    assert args.variants == ('sgd_graph',) and args.peer_variants == ()
    args = kp.parse_args(['--variants', 'kfac_every,sgd'])
    assert args.variants == ('sgd', 'kfac_every')
    assert args.peer_variants == ('sgd', 'kfac_inverse')
    for bad in (['--variants', 'adam'], ['--variants', ''],
                ['--batch', '0'], ['--interval', '1'], ['--warmup', '-1'],
                ['--peer-variants', 'kfac_eigen']):
        with pytest.raises(SystemExit):
            kp.parse_args(bad)


def test_every_variant_has_a_peer_and_a_step():
    from benchmarks import step_time
    assert set(kp.PAIRS) == set(kp.VARIANTS)
    assert set(kp.PAIRS.values()) <= set(kp.PEER_VARIANTS)
    for variant in kp.VARIANTS:
        assert (variant in step_time.VARIANTS), variant


def test_our_steps_refresh_as_their_variants_say():
    """Every K-FAC variant but the stale ones refreshes at every step,
    with its step_time options; the stale ones at the interval."""
    import types
    from benchmarks import step_time
    made = []

    def kfac_step(model, interval, gpu, **options):
        made.append((interval, options))
    fake = types.SimpleNamespace(
        SGDStep=lambda *a: 'sgd', SGDGraphStep=lambda *a: 'sgd_graph',
        KFACGraphStep=lambda *a, **k: 'graph', KFACStep=kfac_step,
        KFAC_GRAPH_VARIANTS=step_time.KFAC_GRAPH_VARIANTS,
        KFAC_VARIANTS=step_time.KFAC_VARIANTS)
    for variant in kp.VARIANTS:
        made.clear()
        kp._our_step(fake, variant, None, 20, None)
        if variant in step_time.KFAC_VARIANTS:
            [(interval, options)] = made
            assert interval == (20 if variant in kp.STALE else 1), variant
            assert options == step_time.KFAC_VARIANTS[variant]
    made.clear()
    kp._our_step(fake, 'kfac_low_rank', None, 20, None)
    assert made == [(1, {'low_rank': True})]


def test_cudnn_is_chosen_as_a_default_run_chooses_it():
    """As ``train_imagenet.py --gpu`` (CUDA graphs on by default): timed
    algorithms within 1 GiB for every variant, an eager one too (the
    refresh steps of a graphed run are eager); ``--eager-run`` as a run
    with the graphs off."""
    limit, timed, words = kp.cudnn_for(kp.parse_args(['--variants',
                                                      'kfac_every']))
    assert (limit, timed) == (1 << 30, True)
    assert 'with CUDA graphs' in words
    limit, timed, words = kp.cudnn_for(kp.parse_args(['--eager-run']))
    assert (limit, timed) == (None, False)
    assert 'eager steps' in words
    limit, timed, _ = kp.cudnn_for(kp.parse_args(
        ['--cudnn-workspace', '8MiB', '--cudnn-autotune', 'off']))
    assert (limit, timed) == (8 << 20, False)
    with pytest.raises(SystemExit):
        kp.parse_args(['--cudnn-workspace', 'lots'])
    assert kp.parse_args(['--variants', 'kfac_every_graph']).peer_variants \
        == ('kfac_inverse',)

"""Every bundled config against Table 3 and Table 1 as printed in the paper."""
import math

import pytest

import config

# Table 3 as printed in the paper's text: α_mixup, γ(0), γ_target, ρ_BN,
# t_warmup, p_decay, e_start, e_end, η(0), m(0). Powers of ten as (mantissa,
# exponent).
TABLE3 = {
    4096: (0.4, (2.5, -5), (2.5, -7), 16.0, 313, 11.0, 1, 53, (8.18, -6),
           0.997),
    8192: (0.4, (2.5, -5), (2.5, -7), 16.0, 157, 8.0, 1, 53.5, (1.25, -5),
           0.993),
    16384: (0.4, (2.5, -5), (2.5, -7), 32.0, 79, 8.0, 1, 53.5, (2.5, -5),
            0.985),
    32768: (0.6, (2.0, -5), (2.0, -7), 16.0, 59, 3.5, 1.5, 49.5, (3.0, -5),
            0.97),
    65536: (0.6, (1.5, -5), (1.5, -7), 16.0, 40, 2.9, 2, 64.5, (4.0, -5),
            0.95),
    131072: (1.0, (1.0, -5), (1.0, -7), 8.0, 30, 2.9, 3, 107.6, (7.0, -5),
             0.93),
}
# Table 1: epochs per mini-batch size.
TABLE1_EPOCHS = {4096: 35, 8192: 35, 16384: 35, 32768: 45, 65536: 60,
                 131072: 100}

MAIN = {'bs4k': 4096, 'bs8k': 8192, 'bs16k': 16384, 'bs32k': 32768,
        'bs64k': 65536, 'bs131k': 131072}
FIGURE6 = {  # name: (bn_fisher, refresh interval of A, G and F)
    'bs32k': ('full', 1),
    'bs32k_diag': ('diag', 1),
    'bs32k_stale': ('full', 'eq23'),
    'bs32k_stale_diag': ('diag', 'eq23'),
    'bs32k_stale_eq22': ('full', 'eq22'),
}
#: Our configs carry the published magnitudes: printed × 10^3.
SCALE_EXPONENT = 3


def mantissa(value):
    return float('{:e}'.format(value).split('e')[0])


def printed_times_1000(m_e):
    m, e = m_e
    return m * 10.0 ** (e + SCALE_EXPONENT)


def test_all_presets_present():
    # Every Table 3 / Figure 6 config, plus the embedded demo's.
    assert set(config.preset_names()) == set(MAIN) | set(FIGURE6) | {'demo'}
    assert config.load(config.preset_path('demo')).acc_iters(2) == 4


@pytest.mark.parametrize('name', sorted(set(MAIN) | set(FIGURE6)))
def test_config_matches_table3(name):
    cfg = config.load(config.preset_path(name))
    batch = cfg.global_batch_size
    assert batch == MAIN.get(name, 32768)
    (alpha, gamma0, gamma_target, rho_bn, t_warmup, p_decay, e_start, e_end,
     lr0, m0) = TABLE3[batch]
    # η(0) and γ: same mantissa as printed, magnitude × 1000.
    for value, printed in ((cfg.lr, lr0), (cfg.damping, gamma0),
                           (cfg.damping_target, gamma_target)):
        assert mantissa(value) == printed[0]
        assert math.isclose(value, printed_times_1000(printed),
                            rel_tol=1e-12)
    assert math.isclose(cfg.damping / cfg.damping_target, 100, rel_tol=1e-12)
    assert cfg.alpha_mixup == alpha
    assert cfg.rho_bn == rho_bn
    assert cfg.damping_warmup_steps == t_warmup
    assert cfg.p_decay == p_decay
    assert cfg.e_start == e_start and cfg.e_end == e_end
    assert cfg.momentum == m0
    assert cfg.epochs == TABLE1_EPOCHS[batch]
    assert cfg.batch_size_per_process == 32
    assert cfg.fisher == 'emp' and cfg.factor_dtype == 'float32'
    assert cfg.weight_rescale is True
    bn_fisher, refresh = FIGURE6.get(name, ('full', 1))
    assert cfg.bn_fisher == bn_fisher
    assert (cfg.refresh_interval_a, cfg.refresh_interval_g,
            cfg.refresh_interval_f) == (refresh,) * 3


def test_epochs_agree_with_table1_iterations():
    # Table 1 prints iterations = ceil(epochs x 1,281,167 / BS), except for
    # 8,192 where it prints 5,434 (35 epochs are 5,474 iterations).
    iterations = {4096: 10948, 16384: 2737, 32768: 1760, 65536: 1173,
                  131072: 978}
    for name, batch in MAIN.items():
        if batch in iterations:
            cfg = config.load(config.preset_path(name))
            assert math.ceil(cfg.epochs * 1281167 / batch) \
                == iterations[batch]

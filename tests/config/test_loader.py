import dataclasses
import json

import pytest

import chainerkfac
import config
from chainerkfac.optimizers import options
from config import ConfigError, TrainConfig, derive_acc_iters


def base():
    with open(config.preset_path('bs32k')) as f:
        return json.load(f)


def write(tmp_path, data, name='run.json'):
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return str(path)


def test_load_returns_typed_config():
    cfg = config.load(config.preset_path('bs4k'))
    assert isinstance(cfg, TrainConfig)
    assert isinstance(cfg.e_start, float) and cfg.e_start == 1.0
    assert isinstance(cfg.epochs, int)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0


@pytest.mark.parametrize('name', config.preset_names())
def test_save_round_trips(tmp_path, name):
    cfg = config.load(config.preset_path(name))
    path = str(tmp_path / 'resolved.json')
    config.save(cfg, path)
    assert config.load(path) == cfg
    assert config.to_dict(cfg) == json.load(open(path))


def test_defaults_and_int_widening(tmp_path):
    data = base()
    for key in ('batch_size_per_process', 'bn_fisher', 'fisher',
                'factor_dtype', 'refresh_interval_a', 'refresh_interval_g',
                'refresh_interval_f', 'weight_rescale', 'description'):
        del data[key]
    data['lr'] = 1  # an int where a float is expected is fine
    cfg = config.load(write(tmp_path, data))
    assert cfg.batch_size_per_process == 32 and cfg.bn_fisher == 'full'
    assert cfg.refresh_interval_a == 1 and cfg.weight_rescale is True
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)


@pytest.mark.parametrize('key, value, message', [
    ('lr', -0.1, 'must be a finite number >= 0'),
    ('lr', 0, 'must be positive'),
    ('damping', 0.0, 'must be a finite positive number'),
    ('damping_target', 1.0, 'larger than damping='),
    ('e_end', 1.5, 'larger than e_start'),
    ('e_start', -1, 'non-negative'),
    ('momentum', 1.0, r'\[0, 1\)'),
    ('momentum', -0.1, r'\[0, 1\)'),
    ('bn_fisher', 'kron', 'one of'),
    ('fisher', 'true', 'one of'),
    ('factor_dtype', 'float64', 'one of'),
    ('refresh_interval_a', 0, 'must be a refresh interval'),
    ('refresh_interval_g', 'eq99', 'preset'),
    ('epochs', 0, 'at least 1'),
    ('damping_warmup_steps', 0, 'must be an int >= 1'),
    ('alpha_mixup', -0.5, 'non-negative'),
    ('global_batch_size', 1000, 'multiple of batch_size_per_process'),
    # wrong types
    ('epochs', 45.0, 'must be an integer'),
    ('epochs', '45', 'must be an integer'),
    ('lr', '0.03', 'must be a number'),
    ('lr', True, 'must be a number'),
    ('weight_rescale', 1, 'true or false'),
    ('bn_fisher', None, 'must be a string'),
    ('refresh_interval_f', 2.5, 'preset name'),
    ('max_factor_dim', 0, 'max_factor_dim'),
    ('max_factor_dim', 512.0, 'a positive integer or null'),
    ('max_factor_dim', '1024', 'a positive integer or null'),
])
def test_bad_value_names_key_and_file(tmp_path, key, value, message):
    data = base()
    data[key] = value
    path = write(tmp_path, data)
    with pytest.raises(ConfigError, match=message) as info:
        config.load(path)
    assert info.value.key == key
    assert "key '{}'".format(key) in str(info.value)
    assert path in str(info.value)


@pytest.mark.parametrize('name', config.preset_names())
def test_imagenet_configs_keep_every_factor_full(name):
    # The library's cost guard (max_factor_dim=1024 by default) would keep
    # ResNet-50's wide factors diagonal; the paper's runs have none.
    cfg = config.load(config.preset_path(name))
    assert cfg.max_factor_dim is None
    assert config.kfac_options(cfg)['max_factor_dim'] is None


@pytest.mark.parametrize('name', config.preset_names())
def test_imagenet_configs_keep_the_papers_update(name):
    # The library's defaults are stale factors (interval 20) with a bounded
    # step; the configs set the paper's: their own intervals (1, or the
    # eq. 22 / eq. 23 presets), no bound.
    cfg = config.load(config.preset_path(name))
    kwargs = config.kfac_options(cfg)
    assert kwargs['kl_clip'] is None and kwargs['low_rank'] is False
    with open(config.preset_path(name)) as f:
        written = json.load(f)
    for key in ('refresh_interval_a', 'refresh_interval_g',
                'refresh_interval_f'):
        assert kwargs[key] == written.get(key, 1)
    optimizer = chainerkfac.optimizers.KFAC(**kwargs)
    assert optimizer.step_bound is None and optimizer.low_rank is False
    assert optimizer.refresh_intervals['A'](0, 0) == 1


def test_kl_clip_reaches_the_optimizer(tmp_path):
    data = base()
    data['kl_clip'] = 1e-3
    cfg = config.load(write(tmp_path, data))
    assert config.kfac_options(cfg)['kl_clip'] == 1e-3
    data['kl_clip'] = 0
    with pytest.raises(ConfigError, match='kl_clip'):
        config.load(write(tmp_path, data))


def test_low_rank_reaches_the_optimizer(tmp_path):
    data = base()
    data['low_rank'] = True
    cfg = config.load(write(tmp_path, data))
    assert config.kfac_options(cfg)['low_rank'] is True
    data['low_rank'] = 'yes'
    with pytest.raises(ConfigError, match='low_rank'):
        config.load(write(tmp_path, data))


def test_max_factor_dim_reaches_the_optimizer(tmp_path):
    data = base()
    data['max_factor_dim'] = 512
    cfg = config.load(write(tmp_path, data))
    assert config.kfac_options(cfg)['max_factor_dim'] == 512


def test_inverse_method_reaches_the_optimizer(tmp_path):
    assert config.kfac_options(config.load(write(
        tmp_path, base())))['inverse_method'] == 'cholesky'
    data = base()
    data['inverse_method'] = 'newton_schulz'
    cfg = config.load(write(tmp_path, data))
    assert config.kfac_options(cfg)['inverse_method'] == 'newton_schulz'


@pytest.mark.parametrize('key', ['bn_fisher', 'fisher', 'factor_dtype',
                                 'weight_rescale', 'inverse_method'])
def test_choices_are_the_optimizers(tmp_path, key):
    """The loader takes its choices and their checks from
    ``chainerkfac.optimizers.options``: every value KFAC accepts is a valid
    config value (``fisher: "exact"`` among them), and a refused one gets
    the library's wording, attributed to the key and the file."""
    choices = {'bn_fisher': options.BN_FISHER_MODES,
               'fisher': options.FISHER_TYPES,
               'factor_dtype': options.FACTOR_DTYPES,
               'weight_rescale': options.WEIGHT_RESCALE_CHOICES,
               'inverse_method': options.INVERSE_METHODS}[key]
    for value in choices:
        data = base()
        data[key] = value
        assert getattr(config.load(write(tmp_path, data)), key) == value
    data = base()
    data[key] = 'none of them'
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        config.load(path)
    with pytest.raises(options.OptionError) as library:
        options.check_option(key, 'none of them')
    assert info.value.key == key and path in str(info.value)
    assert library.value.why in str(info.value)


def test_unknown_key_names_key_file_and_suggestion(tmp_path):
    data = base()
    data['learning_rate'] = 0.1
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        config.load(path)
    assert "key 'learning_rate'" in str(info.value) and path in str(info.value)
    data = base()
    data['momentun'] = data.pop('momentum')
    with pytest.raises(ConfigError, match="did you mean 'momentum'"):
        config.load(write(tmp_path, data))


def test_missing_key_and_bad_json(tmp_path):
    data = base()
    del data['e_end']
    path = write(tmp_path, data)
    with pytest.raises(ConfigError, match="key 'e_end': missing"):
        config.load(path)
    bad = tmp_path / 'bad.json'
    bad.write_text('{"lr": 0.1,}')
    with pytest.raises(ConfigError, match='invalid JSON') as info:
        config.load(str(bad))
    assert str(bad) in str(info.value)
    with pytest.raises(ConfigError, match='JSON object'):
        config.load(write(tmp_path, [1, 2]))


def test_programmatic_configs_are_validated_too():
    cfg = config.load(config.preset_path('bs32k'))
    smaller = dataclasses.replace(cfg, global_batch_size=256, epochs=2)
    assert smaller.acc_iters(2) == 4
    with pytest.raises(ConfigError, match="key 'momentum'"):
        dataclasses.replace(cfg, momentum=1.5)


def test_unknown_preset():
    with pytest.raises(ValueError, match='bs32k_stale'):
        config.preset_path('bs33k')


def test_derive_acc_iters():
    assert derive_acc_iters(32768, 1024, 32) == 1
    assert derive_acc_iters(131072, 1024, 32) == 4
    assert derive_acc_iters(256, 2, 32) == 4
    assert derive_acc_iters(96, 3, 32) == 1


@pytest.mark.parametrize('args, message', [
    ((32768, 3, 32), r'not divisible by 3 processes x 32 samples = 96.*'
                     r'must divide 1024'),
    ((32768, 2048, 32), r'2048 processes x 32 samples = 65536 .*exceed.*'
                        r'32768: use at most 1024 processes'),
    ((1000, 1, 32), 'not a multiple of the batch per process 32'),
    ((1024, 0, 32), 'number of processes must be a positive int'),
    ((1024, 2.0, 32), 'number of processes must be a positive int'),
])
def test_derive_acc_iters_errors(args, message):
    with pytest.raises(ValueError, match=message):
        derive_acc_iters(*args)


def test_lars_momentum_is_a_form_of_the_lars_optimizer(tmp_path):
    from chainerkfac.optimizers import lars
    assert config.load(config.preset_path('bs32k')).lars_momentum == \
        'unscaled'
    for form in lars.MOMENTUM_FORMS:
        data = base()
        data['lars_momentum'] = form
        assert config.load(write(tmp_path, data)).lars_momentum == form
    data = base()
    data['lars_momentum'] = 'nesterov'
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        config.load(path)
    assert info.value.key == 'lars_momentum' and path in str(info.value)
    assert 'scaled' in str(info.value)


def test_epochs_past_e_end_say_where_epochs_came_from(tmp_path):
    """The file says 40 epochs; 50 from --epochs are not the file's."""
    data = base()
    data.update(epochs=40, e_end=41.0)
    path = write(tmp_path, data)
    cfg = config.load(path)
    config.check_epochs(cfg, path)
    longer = dataclasses.replace(cfg, epochs=50)
    with pytest.raises(ConfigError) as info:
        config.check_epochs(longer, path, '--epochs')
    assert str(info.value).startswith(
        "{}: key 'epochs': 50 epochs (from --epochs on the command line, "
        "not the config) exceed e_end = 41".format(path))
    with pytest.raises(ConfigError) as info:
        config.check_epochs(longer, path)
    assert "key 'epochs': 50 epochs exceed e_end = 41" in str(info.value)

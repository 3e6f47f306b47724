"""Training configurations: one JSON per mini-batch size of Table 3, the
Figure 6 variants of the 32K run, and a typed loader.

>>> import config
>>> cfg = config.load(config.preset_path('bs32k'))
>>> cfg.lr, cfg.acc_iters(n_processes=256)
(0.03, 4)

The learning rates and damping values are 1000 times those printed in
Table 3; see ``config/README.md``.
"""
from config.loader import ConfigError  # NOQA
from config.loader import TrainConfig  # NOQA
from config.loader import check_epochs  # NOQA
from config.loader import derive_acc_iters  # NOQA
from config.loader import from_dict  # NOQA
from config.loader import kfac_options  # NOQA
from config.loader import load  # NOQA
from config.loader import preset_names  # NOQA
from config.loader import preset_path  # NOQA
from config.loader import save  # NOQA
from config.loader import to_dict  # NOQA

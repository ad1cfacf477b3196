"""The names a search config may choose: its sampler, pruner and strategy.

The config validates against these types; the registries that give each name its meaning
(``mopflow.training.search.algorithms``: samplers and pruners; ``mopflow.training.search.sweep``:
strategies) check, when imported, that they hold exactly these names.
"""

from __future__ import annotations

from typing import Literal

SamplerName = Literal["tpe", "random", "grid", "gp", "cmaes"]
PrunerName = Literal["asha", "successive_halving", "hyperband", "median", "none"]
StrategyName = Literal["task", "ddp", "mop"]

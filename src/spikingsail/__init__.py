"""SpikingSail: distributed training of conventional and spiking PyTorch networks.

parser = spikingsail.add_config_arguments(parser)
args = parser.parse_args()
engine, optimizer = spikingsail.SpikingSail(args, model, optimizer).run()
for batch in engine.dataloader(dataset):
    loss = engine(batch)
    engine.backward(loss)
    engine.step()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from spikingsail.errors import BackendError, ConfigError, LaunchError, RankDiscoveryError, SailError

if TYPE_CHECKING:
    from spikingsail.backends import load_config
    from spikingsail.config import SailConfig
    from spikingsail.engine.engine import Engine
    from spikingsail.engine.initialize import SpikingSail, add_config_arguments, initialize
    from spikingsail.environments import RankInfo, discover_rank_info
    from spikingsail.launchers.spawn import spawn

# Imported on first use, so that `sail doctor` and `sail --help` start (and can report a broken
# torch installation) without importing torch.
_LAZY = {
    "SailConfig": "spikingsail.config",
    "load_config": "spikingsail.backends",
    "Engine": "spikingsail.engine.engine",
    "SpikingSail": "spikingsail.engine.initialize",
    "add_config_arguments": "spikingsail.engine.initialize",
    "initialize": "spikingsail.engine.initialize",
    "RankInfo": "spikingsail.environments",
    "discover_rank_info": "spikingsail.environments",
    "spawn": "spikingsail.launchers.spawn",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'spikingsail' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "ConfigError",
    "Engine",
    "LaunchError",
    "RankDiscoveryError",
    "RankInfo",
    "SailConfig",
    "SailError",
    "SpikingSail",
    "add_config_arguments",
    "discover_rank_info",
    "initialize",
    "load_config",
    "spawn",
]

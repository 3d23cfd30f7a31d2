"""SpikingSail: distributed training of conventional and spiking PyTorch networks.

parser = spikingsail.add_config_arguments(parser)
args = parser.parse_args()
engine, optimizer = spikingsail.SpikingSail(args, model, optimizer).run()
for batch in engine.dataloader(dataset):
    loss = engine(batch)
    engine.backward(loss)
    engine.step()
"""

from spikingsail.config import SailConfig, load_config
from spikingsail.engine.engine import Engine
from spikingsail.engine.initialize import SpikingSail, add_config_arguments, initialize
from spikingsail.environments import RankInfo, discover_rank_info
from spikingsail.errors import BackendError, ConfigError, LaunchError, RankDiscoveryError, SailError
from spikingsail.launchers.spawn import spawn

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

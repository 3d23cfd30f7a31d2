"""The training config: typed sections and the one place they are validated."""

from spikingsail.config.parse import load_config
from spikingsail.config.schema import SailConfig

__all__ = ["SailConfig", "load_config"]

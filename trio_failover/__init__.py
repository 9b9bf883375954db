"""trio-failover: a failover reverse proxy for self-hosted LLM inference fleets."""

from .config import Config, Upstream

__version__ = "0.1.0"

__all__ = ["Config", "Upstream", "__version__"]

"""Whether W&B has an API key, found without asking W&B (which would prompt for one).

With no ``mode`` configured, the W&B sink logs online when a key is found and offline otherwise
(with a warning), so a training node without a key never waits at a login prompt.
"""

from __future__ import annotations

import netrc
import os
from urllib.parse import urlparse

__all__ = ["api_key_configured"]


def api_key_configured() -> bool:
    """Whether W&B has a key: ``WANDB_API_KEY``, or a ``netrc`` entry for the W&B host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC", os.path.join(os.path.expanduser("~"), ".netrc"))
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False

"""The ``tmetrics`` command line."""

from tmetrics_core.cli.main import main

__all__ = ["main"]

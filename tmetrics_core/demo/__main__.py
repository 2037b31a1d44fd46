"""``python -m tmetrics_core.demo`` and ``torchrun ... -m tmetrics_core.demo``: the demo with
metrics, as ``tmetrics demo`` (under torchrun each process is one rank)."""

from __future__ import annotations

from typing import Any

import click

from tmetrics_core.demo.launch import demo_options
from tmetrics_core.errors import TMetricsError


@click.command(name="demo")
@demo_options
def main(**kwargs: Any) -> None:
    """Train the demo MoE transformer with tmetrics attached."""
    from tmetrics_core.demo.instrument import run_instrumented_demo

    try:
        run_instrumented_demo(kwargs)
    except TMetricsError as err:
        raise click.UsageError(str(err)) from err


if __name__ == "__main__":
    main()

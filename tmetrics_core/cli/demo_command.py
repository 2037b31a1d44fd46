"""``tmetrics demo``: loaded only when the command runs or its own help is asked for (its
options come from the demo, which imports torch; ``tmetrics --help`` does not)."""

from __future__ import annotations

from typing import Any

import click

from tmetrics_core.cli.friendly import friendly
from tmetrics_core.demo.launch import demo_options

__all__ = ["demo_command"]


@click.command("demo")
@demo_options
@friendly
def demo_command(**kwargs: Any) -> None:
    """Train the demo MoE transformer on Python's standard library and fill every tracker.

    Runs on one process by default; --nproc 4 --dp 2 --tp 2 (or --ep, --fsdp, --pp) launches
    gloo ranks on 127.0.0.1. Ends by printing where the run is and how to open it.
    """
    from tmetrics_core.demo.instrument import run_instrumented_demo

    run_instrumented_demo(kwargs)

"""The ``tmetrics`` command: ``demo``, ``metrics``, ``names``, ``validate``, ``alerts``, ``replay``, and
the commands plugins register under the entry-point group ``tmetrics.commands`` (``compare``, from
``tmetrics_mlflow``).

Each command is a thin shell over a library function; errors of tmetrics (``TMetricsError``)
print as one clear line and exit with status 2, without a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from tmetrics_core.cli.friendly import friendly as _friendly
from tmetrics_core.cli.plugins import PluginGroup

__all__ = ["main"]


@click.group(cls=PluginGroup, context_settings={"help_option_names": ["-h", "--help"]},
             lazy={"demo": ("tmetrics_core.cli.demo_command:demo_command",
                            "Train the demo MoE transformer on Python's standard library and fill every tracker.")})
@click.version_option(package_name="tmetrics")
def main() -> None:
    """Training-time tensor metrics for sharded PyTorch models, per layer and per expert."""


@main.command("metrics")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_friendly
def metrics_command(as_json: bool) -> None:
    """List the metric catalogue: name, source kinds, scope, formula, healthy baseline."""
    from tmetrics_core.metrics.catalogue import describe_catalogue

    click.echo(describe_catalogue(fmt="json" if as_json else "table"))


@main.command("names")
@click.option("--hf", "hf", metavar="ARCH", help="A tiny Hugging Face model built from its config class "
              "(llama, mistral, mixtral, qwen2_moe, gpt2); nothing is downloaded.")
@click.option("--factory", metavar="MODULE:FUNCTION", help="Import FUNCTION from MODULE and call it with no "
              "arguments to get the model.")
@click.option("--run-dir", type=click.Path(exists=True, file_okay=False, path_type=Path),
              help="Print the manifest a run wrote (<run dir>/manifest.json).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@_friendly
def names_command(hf: str | None, factory: str | None, run_dir: Path | None, as_json: bool) -> None:
    """Print a model's manifest: canonical and original names, layer, expert, shape, placements.

    Without options: the demo model on one process.
    """
    from tmetrics_core.cli.model_zoo import load_model
    from tmetrics_core.cli.names_table import format_manifest

    if run_dir is not None:
        rows = json.loads((run_dir / "manifest.json").read_text())
    else:
        from tmetrics_core.topology import Topology
        from tmetrics_core.manifest.table import Manifest

        model = load_model(hf=hf, factory=factory)
        rows = Manifest.build(model, Topology.single_process()).rows()
    click.echo(format_manifest(rows, fmt="json" if as_json else "table"))


@main.command("validate")
@click.argument("config", type=click.Path(dir_okay=False, path_type=Path))
@_friendly
def validate_command(config: Path) -> None:
    """Check CONFIG (YAML, TOML or JSON) as a run would at start-up, without a model, and list
    every problem found, not only the first.

    Also lists the placements CONFIG declares (origin ``declared``) and when their Replica
    claims are verified; the other origins need the model: see ``tmetrics names --run-dir``.
    """
    from tmetrics_core.cli.names_table import format_declared
    from tmetrics_core.cli.validation import NO_SINKS, validate_file

    loaded = validate_file(config)
    click.echo(f"{config}: ok: {len(loaded.metrics)} metrics "
               f"({', '.join(f'{m.name}:{m.interval}' for m in loaded.metrics)}); "
               f"sinks {', '.join(loaded.sinks) or 'none'}; run dir {loaded.run.dir}")
    if not loaded.sinks:
        click.echo(f"tmetrics: warning: {config} {NO_SINKS}", err=True)
    click.echo(format_declared(loaded.placements, loaded.distributed.verify_replicas))


@main.command("alerts")
@click.argument("run_dir", type=click.Path(path_type=Path))
@_friendly
def alerts_command(run_dir: Path) -> None:
    """Print the alerts a run raised (RUN_DIR/alerts.jsonl, written by the jsonl sink) as a table."""
    from tmetrics_core.cli.alerts_table import format_alerts, read_alerts

    click.echo(format_alerts(read_alerts(run_dir)))


@main.command("replay")
@click.argument("spool", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--sink", "sink", required=True, help="Entry-point name of the sink to load the spool into.")
@click.option("--option", "options", multiple=True, metavar="KEY=VALUE",
              help="A sink option (repeatable), e.g. --option tracking_uri=sqlite:///runs/demo/mlflow.db")
@_friendly
def replay_command(spool: Path, sink: str, options: tuple[str, ...]) -> None:
    """Write every record of SPOOL (a sink's spool or a metrics.jsonl) to the sink NAME."""
    from tmetrics_core.errors import ConfigError
    from tmetrics_core.hub.replay import replay

    parsed: dict[str, Any] = {}
    for item in options:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--option {item!r}: need KEY=VALUE")
        parsed[key] = value
    count = replay(spool, sink, options=parsed)
    click.echo(f"replayed {count} records from {spool} into {sink}")

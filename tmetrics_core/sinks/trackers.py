"""The tracker runs a training loop already has, as the sink options that write into them.

One run by default: tmetrics' records belong beside the loss the user already logs, not in a
second run. The MLflow and W&B sinks find the process's active run by themselves
(``mlflow.active_run()``, ``wandb.run``); what they cannot find (a ``SummaryWriter``'s directory,
a Lightning ``MLFlowLogger``'s run, which is not MLflow's active run) is given as a tracker
object to ``TensorMetrics.from_config(..., trackers=[...])``, and the framework integrations
pass their own (Lightning's ``trainer.loggers``, accelerate's ``accelerator.trackers``).

============================================  ==============================================
tracker                                       sink options
============================================  ==============================================
``SummaryWriter`` (torch, tensorboardX),      ``tensorboard: {log_dir: <its directory>,
Lightning ``TensorBoardLogger``, accelerate   prefix: "tmetrics/"}``: one TensorBoard run with
``TensorBoardTracker``                        the owner's tags
Lightning ``MLFlowLogger``                    ``mlflow: {tracking_uri, run_id}``
an MLflow ``Run``, accelerate ``MLflowTracker``  ``mlflow: {tracking_uri: mlflow.get_tracking_uri(), run_id}``
a W&B ``Run``, Lightning ``WandbLogger``,     ``wandb: {reuse_run: true}``
accelerate ``WandBTracker``
============================================  ==============================================

Nothing here imports a tracker library: objects are recognized by their class's name and module.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Iterable

from tmetrics_core.errors import ConfigError

__all__ = ["SHARED_PREFIX", "known_trackers", "tracker_sinks"]

_log = logging.getLogger("tmetrics")

SHARED_PREFIX = "tmetrics/"
"""Put before tmetrics' keys in a run it shares with the run's owner."""


def tracker_sinks(trackers: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Sink name -> the options that write into each tracker's run (see the module docstring).

    Raises:
        ConfigError: an object that is not a known tracker, or two trackers of one kind
            (path ``trackers``). A framework's loggers go through :func:`known_trackers` first.
    """
    out: dict[str, dict[str, Any]] = {}
    for tracker in trackers:
        if not _recognized(tracker):
            raise ConfigError(f"{type(tracker).__module__}.{type(tracker).__qualname__} is not a tracker tmetrics "
                              "can write into; pass a SummaryWriter, an MLflow or W&B run, or a Lightning logger "
                              "or accelerate tracker of those", path="trackers")
        name, options = _sink_options(tracker)
        if name in out and out[name] != options:
            raise ConfigError(f"two {name} trackers given ({out[name]} and {options}); tmetrics writes into one",
                              path="trackers")
        out[name] = options
    return out


def known_trackers(objects: Iterable[Any]) -> list[Any]:
    """The objects tmetrics can write into (a framework's loggers or trackers); each other one is
    passed over with an INFO line (a CSV logger, a tracker of a service tmetrics has no sink for)."""
    known = []
    for tracker in objects:
        if type(tracker).__name__ == "MLflowTracker" and getattr(tracker, "active_run", None) is None:
            continue  # accelerate starts its MLflow run on the main process only; the others log nothing
        if _recognized(tracker):
            known.append(tracker)
        else:
            _log.info("tmetrics: %s is not a tracker tmetrics writes into; its run gets no tmetrics records",
                      type(tracker).__name__)
    return known


def _recognized(tracker: Any) -> bool:
    kind, module = type(tracker).__name__, type(tracker).__module__
    if kind == "SummaryWriter" or (kind in ("Run", "ActiveRun") and module.startswith(("mlflow", "wandb"))):
        return True
    lightning = module.startswith(("lightning", "pytorch_lightning"))
    return (lightning and kind in ("TensorBoardLogger", "MLFlowLogger", "WandbLogger")) or (
        module.startswith("accelerate") and kind in ("TensorBoardTracker", "MLflowTracker", "WandBTracker"))


def _sink_options(tracker: Any) -> tuple[str, dict[str, Any]]:
    kind = type(tracker).__name__
    module = type(tracker).__module__
    if kind == "SummaryWriter":
        return "tensorboard", {"log_dir": str(tracker.get_logdir()), "prefix": SHARED_PREFIX}
    if kind == "TensorBoardLogger" and module.startswith(("lightning", "pytorch_lightning")):
        return "tensorboard", {"log_dir": str(tracker.log_dir), "prefix": SHARED_PREFIX}
    if kind == "TensorBoardTracker" and module.startswith("accelerate"):  # its writer exists on the main process only
        return "tensorboard", {"log_dir": os.path.join(tracker.logging_dir_param, tracker.run_name),
                               "prefix": SHARED_PREFIX}
    if kind == "MLFlowLogger" and module.startswith(("lightning", "pytorch_lightning")):
        return "mlflow", {"tracking_uri": tracker._tracking_uri, "run_id": tracker.run_id}
    if kind == "MLflowTracker" and module.startswith("accelerate"):
        return _sink_options(tracker.active_run)
    if kind in ("Run", "ActiveRun") and module.startswith("mlflow"):
        return "mlflow", {"tracking_uri": sys.modules["mlflow"].get_tracking_uri(), "run_id": tracker.info.run_id}
    if kind == "WandbLogger" and module.startswith(("lightning", "pytorch_lightning")):
        tracker.experiment  # noqa: B018 (the logger starts its run, wandb.run, on first access)
        return "wandb", {"reuse_run": True}
    if (kind == "Run" and module.startswith("wandb")) or (kind == "WandBTracker" and module.startswith("accelerate")):
        return "wandb", {"reuse_run": True}
    raise AssertionError(f"{type(tracker)} passed _recognized but has no sink options")

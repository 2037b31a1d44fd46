"""One run by default (issue 35): inside the user's own MLflow run, W&B run or TensorBoard
directory, tmetrics writes into that run under ``tmetrics/``, beside the loss the user logs
there, and never ends it. Each test reads the user's run back from its store and compares
tmetrics' values with a float64 reference of the same gradients."""

from __future__ import annotations

import math

import pytest
import torch

from tests.reliability.layered_model import LayeredModel
from tmetrics_core.tensor_metrics import TensorMetrics

pytestmark = pytest.mark.timeout(120)

STEPS = 3
CONFIG = {"run": {"name": "mine"}, "metrics": ["global-grad-l2", "layer-grad-l2"]}


def _train(metrics: TensorMetrics, model: torch.nn.Module, log_loss) -> dict[int, tuple[float, list[float]]]:
    """Train ``STEPS`` steps; the user logs the loss with ``log_loss(step, loss)`` and the
    learning rate through ``metrics.log``. Returns per step the float64 reference: the global
    gradient norm and each layer's."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    reference = {}
    for step in range(1, STEPS + 1):
        with metrics.step(step):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            loss = model(x).pow(2).mean()
            loss.backward()
            metrics.observe_gradients()
            grads = {n: p.grad.double() for n, p in model.named_parameters()}
            layers = [math.sqrt(sum(float(g.pow(2).sum()) for n, g in grads.items() if n.startswith(f"layers.{i}.")))
                      for i in range(3)]
            reference[step] = (math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values())), layers)
            optimizer.step()
            optimizer.zero_grad()
            log_loss(step, loss.item())
            metrics.log({"lr": optimizer.param_groups[0]["lr"], "loss-tensor": loss})
    return reference


def test_the_users_mlflow_run_gets_the_layer_metrics_and_stays_open(tmp_path, monkeypatch, mlflow_uri):
    import mlflow
    from mlflow import MlflowClient

    from tests.sinks.readback_mlflow import histories

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    mlflow.set_experiment("mine")
    model = LayeredModel()
    with mlflow.start_run(run_name="my-training") as run:
        metrics = TensorMetrics.from_config({**CONFIG, "sinks": {"mlflow": {}}}, model=model, run_dir=tmp_path / "run")
        reference = _train(metrics, model, lambda step, loss: mlflow.log_metric("loss", loss, step=step))
        metrics.close()
        client = MlflowClient(tracking_uri=mlflow_uri)
        assert client.get_run(run.info.run_id).info.status == "RUNNING"  # tmetrics did not end it
        assert mlflow.active_run().info.run_id == run.info.run_id
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [run.info.run_id]  # one run: no "tmetrics" run beside it
    assert runs[0].info.status == "FINISHED" and runs[0].info.run_name == "my-training"
    got = histories(client, run.info.run_id)
    assert [s for s, _ in got["loss"]] == list(range(1, STEPS + 1))
    assert [s for s, _ in got["tmetrics/lr"]] == list(range(1, STEPS + 1))
    for step, (total, layers) in reference.items():
        assert dict(got["tmetrics/global-grad-l2"])[step] == pytest.approx(total, rel=1e-6)
        for i, norm in enumerate(layers):
            assert dict(got[f"tmetrics/layer-grad-l2/layer_{i:02d}"])[step] == pytest.approx(norm, rel=1e-6)
        assert dict(got["tmetrics/loss-tensor"])[step] == pytest.approx(dict(got["loss"])[step], rel=1e-6)
    assert not [k for k in got if k not in ("loss",) and not k.startswith("tmetrics/")]
    params = client.get_run(run.info.run_id).data.params
    assert params["tmetrics.run.name"] == "mine" and not [p for p in params if not p.startswith("tmetrics.")]


def _wandb_offline(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setenv("HOME", str(tmp_path))
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                        "WANDB_CACHE_DIR": str(tmp_path / "cache"), "WANDB_CONFIG_DIR": str(tmp_path / "config"),
                        "WANDB_DATA_DIR": str(tmp_path / "data")}.items():
        monkeypatch.setenv(name, value)
    wandb.teardown()  # W&B's process-wide settings are read once: an earlier test's would override these
    return wandb


def test_the_users_wandb_run_gets_the_layer_metrics_and_stays_open(tmp_path, monkeypatch):
    from tests.sinks.readback_wandb import find_run_file, read_run

    wandb = _wandb_offline(tmp_path, monkeypatch)
    model = LayeredModel()
    run = wandb.init(project="mine", name="my-training", settings=wandb.Settings(console="off", silent=True))
    try:
        metrics = TensorMetrics.from_config({**CONFIG, "sinks": {"wandb": {}}}, model=model, run_dir=tmp_path / "run")
        # The user sets W&B's step; tmetrics must never push it past the user's next one.
        reference = _train(metrics, model, lambda step, loss: run.log({"loss": loss}, step=step))
        metrics.close()
        assert wandb.run is run
        run.log({"loss": -1.0})  # the run is still the user's to log into
    finally:
        run.finish()
    data = read_run(find_run_file(tmp_path / "wandb"))  # one run file: the user's
    assert data.exit_code == 0 and data.run.display_name == "my-training"
    losses = [row["loss"] for row in data.history if "loss" in row]
    assert len(losses) == STEPS + 1 and losses[-1] == -1.0  # not one of the user's rows dropped
    ours = {row["tmetrics/step"]: row for row in data.history if "tmetrics/global-grad-l2" in row}
    assert sorted(ours) == list(range(1, STEPS + 1))
    lr = {row["tmetrics/step"]: row["tmetrics/lr"] for row in data.history if "tmetrics/lr" in row}
    assert lr == {step: 0.1 for step in range(1, STEPS + 1)}
    for step, (total, layers) in reference.items():
        assert ours[step]["tmetrics/global-grad-l2"] == pytest.approx(total, rel=1e-6)
        for i, norm in enumerate(layers):
            assert ours[step][f"tmetrics/layer-grad-l2/layer_{i:02d}"] == pytest.approx(norm, rel=1e-6)
    axes = {m.name or m.glob_name: m.step_metric for m in data.metrics if m.step_metric}
    assert axes["tmetrics/layer-grad-l2/*"] == axes["tmetrics/global-grad-l2"] == axes["tmetrics/lr"] == "tmetrics/step"
    assert "*" not in axes  # the user's keys keep W&B's own step
    summaries = {m.glob_name: (m.summary.last, m.summary.max) for m in data.metrics if m.glob_name}
    assert summaries["tmetrics/layer-grad-l2/*"] == (True, True)  # panels compare runs by last and max
    assert data.config["tmetrics"]["run"]["name"] == "mine"


def test_a_given_summary_writer_gets_the_layer_metrics_in_its_directory(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    from tests.sinks.readback_tensorboard import read_log

    model = LayeredModel()
    writer = SummaryWriter(str(tmp_path / "tb" / "my-training"))
    metrics = TensorMetrics.from_config({**CONFIG, "sinks": {"jsonl": {}}}, model=model, run_dir=tmp_path / "run",
                                        trackers=[writer])
    reference = _train(metrics, model, lambda step, loss: writer.add_scalar("loss", loss, step))
    metrics.close()
    writer.add_scalar("loss", -1.0, STEPS + 1)  # still the user's writer
    writer.close()
    assert len(list((tmp_path / "tb" / "my-training").glob("*tfevents*"))) == 2  # one run: one directory
    tb = read_log(tmp_path / "tb" / "my-training")
    assert [s for s, _ in tb.scalars("loss")] == list(range(1, STEPS + 2))
    for step, (total, layers) in reference.items():
        assert dict(tb.scalars("tmetrics/global-grad-l2"))[step] == pytest.approx(total, rel=1e-6)
        for i, norm in enumerate(layers):
            assert dict(tb.scalars(f"tmetrics/layer-grad-l2/layer_{i:02d}"))[step] == pytest.approx(norm, rel=1e-6)
    assert dict(tb.scalars("tmetrics/lr")) == {step: pytest.approx(0.1) for step in range(1, STEPS + 1)}
    charts = tb.layout_charts()
    assert charts["layer-grad-l2"]["layer-grad-l2 (all layers)"] == [r"^tmetrics/layer-grad-l2/layer_\d+$"]


def test_log_refuses_a_bad_value_and_a_metric_name(tmp_path):
    from tmetrics_core.errors import ConfigError

    metrics = TensorMetrics.from_config({**CONFIG, "sinks": {"jsonl": {}}}, model=LayeredModel(),
                                        run_dir=tmp_path / "run")
    with metrics.step(1):
        with pytest.raises(ConfigError, match="'layer-grad-l2' is a metric of this run"):
            metrics.log({"layer-grad-l2": 1.0})
        with pytest.raises(ConfigError, match="need a number or a one-element tensor"):
            metrics.log({"loss": torch.ones(2)})
    metrics.close()

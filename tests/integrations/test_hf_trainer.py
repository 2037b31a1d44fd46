"""``tmetrics_core.integrations.hf.TMetricsCallback`` in a real ``transformers.Trainer`` on the CPU:
a tiny Llama, gradient accumulation 2 and ``max_grad_norm`` small enough to clip every step.

References: the ``grad_norm`` the Trainer logs, and float64 norms of the gradients and
parameters copied just before the Trainer clips (its ``accelerator.clip_grad_norm_`` wrapped by
the test, not by the product)."""

from __future__ import annotations

import logging
import math

import pytest

from tmetrics_core.errors import ConfigError

pytest.importorskip("transformers")

from transformers import Trainer, TrainingArguments  # noqa: E402

from tests.integrations.tiny import by_step, config, grads64, hand_norms, params64, read_jsonl, tiny_llama, token_rows  # noqa: E402
from tmetrics_core.integrations.hf import TMetricsCallback  # noqa: E402

STEPS = 3
MAX_GRAD_NORM = 0.05


def _train(tmp_path, report_to="none", strict=True):
    model = tiny_llama()
    callback = TMetricsCallback(config(tmp_path / "run"), report_to=True if report_to != "none" and strict else None)
    args = TrainingArguments(str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_grad_norm=MAX_GRAD_NORM, learning_rate=1e-2,
                             logging_steps=1, report_to=report_to, save_strategy="no", use_cpu=True,
                             disable_tqdm=True, lr_scheduler_type="constant")
    trainer = Trainer(model=model, args=args, train_dataset=token_rows(4 * STEPS), callbacks=[callback])
    seen: list[tuple[dict, dict]] = []
    clip = trainer.accelerator.clip_grad_norm_

    def clip_and_record(parameters, max_norm, *a, **kw):
        seen.append((grads64(model), params64(model)))
        return clip(parameters, max_norm, *a, **kw)

    trainer.accelerator.clip_grad_norm_ = clip_and_record
    trainer.train()
    logged = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    return seen, logged


def test_trainer_pre_clip_norms_one_record_per_step(tmp_path):
    seen, logged = _train(tmp_path)
    steps = by_step(read_jsonl(tmp_path / "run"))
    assert sorted(steps) == list(range(1, STEPS + 1)) == sorted(logged)
    assert len(seen) == STEPS
    for step, (grads, params) in zip(range(1, STEPS + 1), seen):
        got = steps[step]
        assert logged[step] > 2 * MAX_GRAD_NORM  # the Trainer clipped: post-clip norms would differ
        assert got[("global-grad-l2", None)] == pytest.approx(logged[step], rel=1e-5)
        total, layer_grads = hand_norms(grads)
        assert got[("global-grad-l2", None)] == pytest.approx(total, rel=1e-6)
        _, layer_params = hand_norms(params)
        for layer in range(2):
            assert got[("layer-grad-l2", layer)] == pytest.approx(layer_grads[layer], rel=1e-6)
            assert got[("layer-param-l2", layer)] == pytest.approx(layer_params[layer], rel=1e-6)
        assert len(got) == 1 + 2 + 2
        assert all(math.isfinite(v) for v in got.values())


def test_report_to_writes_into_the_trainers_mlflow_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)  # the Trainer's experiment keeps artifacts under ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "trainer")
    _, logged = _train(tmp_path, report_to="mlflow")
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("trainer").experiment_id])
    assert len(runs) == 1  # one run: the Trainer's, with tmetrics' records in it
    run_id = runs[0].info.run_id
    ours = {m.step: m.value for m in client.get_metric_history(run_id, "tmetrics/global-grad-l2")}
    theirs = {m.step: m.value for m in client.get_metric_history(run_id, "grad_norm")}
    assert sorted(ours) == sorted(theirs) == sorted(logged) == list(range(1, STEPS + 1))
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-5)
    assert runs[0].info.status == "FINISHED"


def test_report_to_refuses_a_run_it_cannot_find(tmp_path, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    with pytest.raises(ConfigError, match="report_to.*TENSORBOARD_LOGGING_DIR"):
        _train(tmp_path, report_to="tensorboard")


def test_a_run_it_cannot_find_is_passed_over_in_one_info_line(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    caplog.set_level(logging.INFO, logger="tmetrics")
    _, logged = _train(tmp_path, report_to="tensorboard", strict=False)
    said = [r.getMessage() for r in caplog.records if "TENSORBOARD_LOGGING_DIR" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("tmetrics: the Trainer reports to TensorBoard in a directory")
    steps = by_step(read_jsonl(tmp_path / "run"))  # the configured sinks still write
    assert sorted(steps) == sorted(logged) == list(range(1, STEPS + 1))
    for step in steps:
        assert steps[step][("global-grad-l2", None)] == pytest.approx(logged[step], rel=1e-5)


def test_report_to_writes_into_the_trainers_tensorboard_directory(tmp_path, monkeypatch):
    from tests.sinks.readback_tensorboard import read_log

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    _, logged = _train(tmp_path, report_to="tensorboard")
    assert len(list((tmp_path / "tb").glob("*tfevents*"))) == 2  # the Trainer's and tmetrics'
    tb = read_log(tmp_path / "tb")
    ours = dict(tb.scalars("tmetrics/global-grad-l2"))
    theirs = dict(tb.scalars("train/grad_norm"))
    assert sorted(ours) == sorted(theirs) == sorted(logged) == list(range(1, STEPS + 1))
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-5)


def test_report_to_writes_into_the_trainers_wandb_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    import wandb

    from tests.sinks.readback_wandb import find_run_file, read_run

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                        "WANDB_PROJECT": "trainer", "WANDB_CACHE_DIR": str(tmp_path / "cache"),
                        "WANDB_CONFIG_DIR": str(tmp_path / "config"), "WANDB_DATA_DIR": str(tmp_path / "data")}.items():
        monkeypatch.setenv(name, value)
    wandb.teardown()  # W&B's process-wide settings are read once: an earlier test's would override these
    try:
        _, logged = _train(tmp_path, report_to="wandb")
    finally:
        wandb.finish()
    run = read_run(find_run_file(tmp_path / "wandb"))  # one run file: the Trainer's
    ours = {row["tmetrics/step"]: row["tmetrics/global-grad-l2"] for row in run.history
            if "tmetrics/global-grad-l2" in row}
    theirs = {row["train/global_step"]: row["train/grad_norm"] for row in run.history if "train/grad_norm" in row}
    assert sorted(ours) == sorted(theirs) == sorted(logged) == list(range(1, STEPS + 1))
    for step in ours:
        assert ours[step] == pytest.approx(theirs[step], rel=1e-5)
    axes = {m.name or m.glob_name: m.step_metric for m in run.metrics if m.step_metric}
    assert axes["tmetrics/global-grad-l2"] == axes["tmetrics/layer-grad-l2/*"] == "tmetrics/step"
    assert axes["*"] == "train/global_step"  # the Trainer's own keys keep the Trainer's x axis
    assert run.config["tmetrics"]["metrics"]

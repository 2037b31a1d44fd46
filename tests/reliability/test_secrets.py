"""Secrets never leave the machine through tmetrics (issue 8, item 3).

API keys, tokens and passwords placed in the config (a sink's options) and in the environment
must not appear in anything tmetrics writes: MLflow params, artifacts and store, the jsonl
file, TensorBoard events (the config text), the W&B offline run file, the spool, the manifest.
Every file the run leaves is searched byte for byte; the redacted config must still arrive.
"""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

import tmetrics_core.sinks.registry as sinks_module
from tests.reliability.layered_model import LayeredModel, train_steps
from tmetrics_core.tensor_metrics import TensorMetrics

pytestmark = pytest.mark.timeout(120)

CONFIG_SECRETS = {
    "api_key": "sk-live-4f9a8b7c6d5e4f3a2b1c0d9e",
    "endpoint": "https://alice:Hunter2Secret@api.example.com/v1?token=tok_a1b2c3d4e5f6&region=eu",
    "password": "pw-Zebra-Quartz-91",
}
LEAKS_FROM_CONFIG = ["sk-live-4f9a8b7c6d5e4f3a2b1c0d9e", "Hunter2Secret", "tok_a1b2c3d4e5f6", "pw-Zebra-Quartz-91"]
ENVIRONMENT = {
    "WANDB_API_KEY": "0123456789abcdef0123456789abcdef01234567",
    "HF_TOKEN": "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789",
    "MLFLOW_TRACKING_PASSWORD": "mlflow-Pass-Word-77",
    "AWS_SECRET_ACCESS_KEY": "aws/Secret+Key/ABCDEFGHIJKLMNOPqrst",
    "DATABASE_URL": "postgresql://bob:DbPassw0rd99@db.internal/x",
    "GITHUB_TOKEN": "ghp_ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123",
}
LEAKS_FROM_ENVIRONMENT = ["0123456789abcdef0123456789abcdef01234567", "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789",
                          "mlflow-Pass-Word-77", "aws/Secret+Key/ABCDEFGHIJKLMNOPqrst", "DbPassw0rd99",
                          "ghp_ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123"]


@pytest.fixture
def keyed_sink_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register ``tests.reliability.keyed_sink:KeyedSink`` as the sink ``keyed`` (as if a
    third-party package declared it under the ``tmetrics.sinks`` entry-point group)."""
    installed = sinks_module._entry_points()
    extra = importlib.metadata.EntryPoint("keyed", "tests.reliability.keyed_sink:KeyedSink", "tmetrics.sinks")
    monkeypatch.setattr(sinks_module, "_entry_points", lambda: [*installed, extra])


def test_no_secret_from_the_config_or_the_environment_reaches_any_output(tmp_path, monkeypatch,
                                                                           keyed_sink_installed):
    for name, value in ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    model = LayeredModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    config = {
        "run": {"name": "secrets"},
        "metrics": ["global-grad-l2", "tensor-grad-l2"],
        "sinks": {
            "jsonl": {},
            "tensorboard": {},
            "wandb": {"mode": "offline", "project": "secrets"},
            "mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "secrets"},
            "keyed": dict(CONFIG_SECRETS),
        },
    }
    metrics = TensorMetrics.from_config(config, model=model, optimizer=optimizer, run_dir=tmp_path / "run")
    produced = train_steps(metrics, model, optimizer, range(1, 4))[0]
    report = metrics.close()
    for sink in ("jsonl", "tensorboard", "wandb", "mlflow"):
        assert report[sink].written == len(produced), report
    assert report["keyed"].spooled == len(produced)

    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    outputs = {
        "mlflow store": [tmp_path / "mlflow.db"],
        "mlflow artifacts": [p for p in files if "mlartifacts" in p.parts],
        "jsonl": [tmp_path / "run" / "metrics.jsonl"],
        "tensorboard": [p for p in files if "tfevents" in p.name],
        "wandb offline run": [p for p in files if p.suffix == ".wandb"],
        "spool": [tmp_path / "run" / "spool" / "keyed.jsonl"],
        "manifest": [tmp_path / "run" / "manifest.json"],
        "third-party sink": [tmp_path / "run" / "keyed-calls.json"],
    }
    for what, paths in outputs.items():
        assert paths and all(p.exists() for p in paths), what
    # The config did arrive, redacted, wherever a config is kept.
    for what in ("mlflow store", "mlflow artifacts", "tensorboard", "wandb offline run", "spool", "third-party sink"):
        assert any(b"***" in p.read_bytes() for p in outputs[what]), what
    leaks = [(secret, str(p.relative_to(tmp_path))) for p in files
             for secret in LEAKS_FROM_CONFIG + LEAKS_FROM_ENVIRONMENT if secret.encode() in p.read_bytes()]
    assert leaks == []


def test_the_secrets_would_be_found_if_they_leaked(tmp_path):
    """The search above is not vacuous: each secret is spelled as it would appear in a file."""
    probe = tmp_path / "probe.json"
    probe.write_text(repr(CONFIG_SECRETS) + repr(ENVIRONMENT))
    data = probe.read_bytes()
    assert all(secret.encode() in data for secret in LEAKS_FROM_CONFIG + LEAKS_FROM_ENVIRONMENT)

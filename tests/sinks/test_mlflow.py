from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from tests.sinks.conftest import EXPERTS, make_records
from tests.sinks.readback_mlflow import artifact_json, histories, run_by_id
from tmetrics_core.errors import ConfigError
from tmetrics_core.sinks.keys import MLFLOW_RULES, KeyBook
from tmetrics_core.records import Histogram, Labels, MetricRecord, RunInfo
from tmetrics_mlflow import MlflowSink, check_tracking_uri, flatten_params

STEPS = (1, 2, 3)
SECRET = "0123456789abcdef0123456789abcdef01234567"


def expected_history(steps=STEPS) -> dict[str, list[tuple[int, float]]]:
    """What the sink must store for make_records(step): one metric per scalar, per vector
    element (as an expert) and three per histogram."""
    out: dict[str, list[tuple[int, float]]] = {}
    for step in steps:
        for r in make_records(step):
            if isinstance(r.value, Histogram):
                h = r.value
                pairs = [("total", h.total), ("zeros", h.zeros), ("nonfinite", h.nan + h.posinf + h.neginf)]
                for stat, count in pairs:
                    key = KeyBook(MLFLOW_RULES).add(r.metric, Labels(layer=r.layer, stat=stat))
                    out.setdefault(key, []).append((step, float(count)))
            elif isinstance(r.value, tuple):
                for e, v in enumerate(r.value):
                    key = KeyBook(MLFLOW_RULES).add(r.metric, Labels(layer=r.layer, expert=e))
                    out.setdefault(key, []).append((step, v))
            else:
                out.setdefault(KeyBook(MLFLOW_RULES).add(r.metric, r.labels), []).append((step, r.value))
    return out


def assert_same_history(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, series in want.items():
        assert [s for s, _ in got[key]] == [s for s, _ in series], key
        for (_, g), (_, w) in zip(got[key], series):
            assert (math.isnan(g) and math.isnan(w)) or g == pytest.approx(w, rel=1e-12), key


def write_run(sink: MlflowSink, run: RunInfo, *, status="finished", steps=STEPS) -> str:
    sink.open(run)
    sink.log_config({**run.config, "wandb": {"api_key": SECRET}, "notes": "x" * 7000})
    for step in steps:
        sink.write(make_records(step), step)
    sink.close(status)
    assert sink.run_id is not None
    return sink.run_id


def test_default_store_roundtrip(run_info: RunInfo, mlflow_template_db: Path) -> None:
    # The default URI is sqlite:///<run.dir>/mlflow.db; start from a migrated empty copy (speed).
    run_dir = Path(run_info.dir)
    run_dir.mkdir(parents=True)
    shutil.copyfile(mlflow_template_db, run_dir / "mlflow.db")
    run_id = write_run(MlflowSink(expert_scalars=True), run_info)

    client, run = run_by_id(f"sqlite:///{run_dir / 'mlflow.db'}", run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "demo-run"
    assert client.get_experiment(run.info.experiment_id).name == "demo-run"
    assert run.info.artifact_uri.startswith((run_dir / "mlartifacts").resolve().as_uri())
    assert {k: run.data.tags[k] for k in ("dp", "tp", "model")} == {"dp": "2", "tp": "1", "model": "TinyMoE"}

    got = histories(client, run_id)
    assert_same_history(got, expected_history())
    assert f"layer-expert-tokens/layer_02/expert_{EXPERTS - 1:03d}" in got
    assert got["layer-grad-histogram/layer_00/nonfinite"] == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert math.isnan(dict(got["output-entropy"])[2])

    params = run.data.params
    assert params["run.name"] == "demo-run"
    assert params["metrics.0"] == "layer-grad-l2:1"
    assert params["sinks.tensorboard"] == "{}"
    assert params["wandb.api_key"] == "***"
    assert len(params["notes"]) == 6000 and params["notes"].endswith("...")
    config = artifact_json(client, run_id, "tmetrics/config.json")
    assert config["notes"] == "x" * 7000 and config["wandb"]["api_key"] == "***"
    assert artifact_json(client, run_id, "tmetrics/manifest.json") == [dict(run_info.manifest[0])]
    assert not (Path.cwd() / "mlruns").exists() and not (Path.cwd() / "mlflow.db").exists()


@pytest.mark.parametrize("status, stored", [("failed", "FAILED"), ("killed", "KILLED")])
def test_small_batches_same_data_and_status(run_info: RunInfo, mlflow_uri: str, status: str, stored: str) -> None:
    sink = MlflowSink(tracking_uri=mlflow_uri, experiment="exp-a", run_name="small-batches", batch_size=7, expert_scalars=True)
    run_id = write_run(sink, run_info, status=status)
    client, run = run_by_id(mlflow_uri, run_id)
    assert run.info.status == stored and run.info.run_name == "small-batches"
    assert client.get_experiment(run.info.experiment_id).name == "exp-a"
    assert_same_history(histories(client, run_id), expected_history())
    # Artifacts of a sqlite store sit beside the database, never in the working directory.
    assert run.info.artifact_uri.startswith(Path(mlflow_uri[len("sqlite:///"):]).parent.resolve().as_uri())


def test_open_retry_reuses_the_run_and_experiment(run_info: RunInfo, mlflow_uri: str) -> None:
    sink = MlflowSink(tracking_uri=mlflow_uri, experiment="shared")
    sink.open(run_info)
    first = sink.run_id
    sink.open(run_info)  # the hub retries open after a failure
    assert sink.run_id == first
    sink.write([MetricRecord("global-grad-l2", 1, 2.5)], 1)
    sink.close("finished")
    other = MlflowSink(tracking_uri=mlflow_uri, experiment="shared")
    other.open(run_info)
    other.close("finished")
    client, run = run_by_id(mlflow_uri, first)  # type: ignore[arg-type]
    runs = client.search_runs([run.info.experiment_id])
    assert sorted(r.info.run_id for r in runs) == sorted([first, other.run_id])
    assert histories(client, first) == {"global-grad-l2": [(1, 2.5)]}  # type: ignore[arg-type]


def test_collision_raises_and_writes_nothing(run_info: RunInfo, mlflow_uri: str) -> None:
    sink = MlflowSink(tracking_uri=mlflow_uri)
    sink.open(run_info)
    sink.write([MetricRecord("tensor-grad-l2", 1, 1.0, labels=Labels(tensor="a#b"))], 1)
    with pytest.raises(ConfigError, match="tensor='a#b'.*tensor='a_b'"):
        sink.write([MetricRecord("global-grad-l2", 2, 1.0), MetricRecord("tensor-grad-l2", 2, 2.0, labels=Labels(tensor="a_b"))], 2)
    sink.close("finished")
    client, _ = run_by_id(mlflow_uri, sink.run_id)  # type: ignore[arg-type]
    assert histories(client, sink.run_id) == {"tensor-grad-l2/a_b": [(1, 1.0)]}  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "uri, ok",
    [
        ("sqlite:///runs/mlflow.db", True),
        ("sqlite:////abs/mlflow.db", True),
        ("http://127.0.0.1:5000", True),
        ("https://mlflow.example.com", True),
        ("postgresql+psycopg2://u@db/mlflow", True),
        ("databricks", True),
        ("sqlite://", False),
        ("sqlite:///", False),
        ("./mlruns", False),
        ("file:///tmp/mlruns", False),
        ("http://", False),
        ("ftp://host", False),
        ("", False),
        (5000, False),
    ],
)
def test_tracking_uri_forms(uri, ok: bool) -> None:
    if ok:
        assert check_tracking_uri(uri) == uri
        if not uri.startswith("postgresql"):  # a database URI also needs its driver: the test below
            MlflowSink(tracking_uri=uri)
    else:
        with pytest.raises(ConfigError) as info:
            MlflowSink(tracking_uri=uri)
        assert info.value.path == "sinks.mlflow.tracking_uri"
        assert "sqlite:///PATH/mlflow.db" in str(info.value) and "http://HOST:PORT" in str(info.value)


def test_options_are_validated_without_touching_backend(tmp_path: Path) -> None:
    for kwargs, option in (
        ({"uri": "x"}, "uri"),
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": 1001}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"experiment": " "}, "experiment"),
        ({"run_name": 3}, "run_name"),
    ):
        with pytest.raises(ConfigError) as info:
            MlflowSink(**kwargs)
        assert info.value.path == f"sinks.mlflow.{option}"
    MlflowSink(tracking_uri=f"sqlite:///{tmp_path}/never/mlflow.db")
    assert not (tmp_path / "never").exists()
    with pytest.raises(RuntimeError, match="not open"):
        MlflowSink().write([], 1)
    assert MlflowSink.key_rules is MLFLOW_RULES and MlflowSink.requires == ("mlflow", "matplotlib")


def test_flatten_params() -> None:
    config = {
        "run": {"name": "demo", "dir": "runs/demo"},
        "metrics": ["layer-grad-l2:100", {"name": "layer-grad-l2", "interval": 10, "select": "layers.*.mlp.*"}],
        "optimizer": {"lr": 3e-4, "betas": [0.9, 0.95], "fused": True, "clip": None},
        "empty": {},
        "none_list": [],
        "odd key#1": "v",
        "tracking": "http://user:hunter2@host/",
        "hf_token": "secret-value",
    }
    assert flatten_params(config) == {
        "run.name": "demo",
        "run.dir": "runs/demo",
        "metrics.0": "layer-grad-l2:100",
        "metrics.1.name": "layer-grad-l2",
        "metrics.1.interval": "10",
        "metrics.1.select": "layers.*.mlp.*",
        "optimizer.lr": "0.0003",
        "optimizer.betas.0": "0.9",
        "optimizer.betas.1": "0.95",
        "optimizer.fused": "true",
        "optimizer.clip": "null",
        "empty": "{}",
        "none_list": "[]",
        "odd key_1": "v",
        "tracking": "http://user:***@host/",
        "hf_token": "***",
    }
    long = flatten_params({"k" * 300: "v", "x": "y" * 10}, value_limit=8)
    (long_key,) = [k for k in long if k.startswith("kkk")]
    assert len(long_key) == 250 and long_key[-9] == "-"
    assert long["x"] == "yyyyy..."
    with pytest.raises(ConfigError, match="'a.b' and 'a.b'|both become the MLflow param 'a.b'"):
        flatten_params({"a.b": 1, "a": {"b": 2}})


def test_a_missing_database_driver_is_refused_when_the_config_is_read() -> None:
    """Issue 35: MLflow found a missing driver only when the sink opened, after training began."""
    import importlib.util

    assert importlib.util.find_spec("psycopg2") is None  # not in the test environment
    with pytest.raises(ConfigError, match=r"database driver cannot be imported .*psycopg2.*pip install psycopg2"
                       ) as info:
        MlflowSink(tracking_uri="postgresql+psycopg2://u@db/mlflow")
    assert info.value.path == "sinks.mlflow.tracking_uri"

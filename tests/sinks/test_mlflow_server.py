"""The MLflow sink and compare against a real ``mlflow server`` on 127.0.0.1 (REST, proxied artifacts)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from tests.sinks.readback_mlflow import artifact_json, histories, run_by_id
from tests.sinks.test_mlflow import assert_same_history, expected_history, write_run
from tmetrics_core.records import RunInfo
from tmetrics_mlflow import MlflowSink, compare_runs

START_TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory, mlflow_template_db: Path) -> Iterator[tuple[str, Path]]:
    """``(url, artifacts_dir)`` of a tracking server with a SQLite backend; always terminated."""
    root = tmp_path_factory.mktemp("mlflow-server")
    shutil.copyfile(mlflow_template_db, root / "backend.db")
    artifacts = root / "artifacts"
    port = _free_port()
    log = (root / "server.log").open("w")
    process = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{root / 'backend.db'}", "--artifacts-destination", str(artifacts),
         "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                pytest.fail(f"mlflow server exited with {process.returncode}:\n{(root / 'server.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not answer within {START_TIMEOUT_S} s:\n{(root / 'server.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url, artifacts
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=15)
        log.close()


def test_sink_roundtrip_through_server(server: tuple[str, Path], run_info: RunInfo) -> None:
    url, artifacts = server
    run_id = write_run(MlflowSink(tracking_uri=url, experiment="served", batch_size=50, expert_scalars=True), run_info, status="killed")
    client, run = run_by_id(url, run_id)
    assert run.info.status == "KILLED"
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")
    assert run.data.params["metrics.0"] == "layer-grad-l2:1" and run.data.params["wandb.api_key"] == "***"
    assert run.data.tags["model"] == "TinyMoE"
    assert_same_history(histories(client, run_id), expected_history())
    assert artifact_json(client, run_id, "tmetrics/manifest.json") == [dict(run_info.manifest[0])]
    assert artifact_json(client, run_id, "tmetrics/config.json")["run"] == {"name": "demo-run"}
    # The server stored the artifacts in its destination; nothing was written in the run dir.
    assert len(list(artifacts.rglob("manifest.json"))) == 1
    assert not Path(run_info.dir).exists()


def test_compare_through_server(server: tuple[str, Path], tmp_path: Path) -> None:
    url, _ = server
    from tests.sinks.test_compare import _log_run, _table

    a = _log_run(url, tmp_path, "served-a", 1.0, experiment="served-compare")
    _log_run(url, tmp_path, "served-b", 0.5, experiment="served-compare")
    text = compare_runs([a, "served-b"], tracking_uri=url, metrics=["layer-grad-l2"], out_png=tmp_path / "c.png")
    assert _table(text, "layer-grad-l2")[0] == ["layer_00", "2", "1", "0.5"]
    assert (tmp_path / "c.png").stat().st_size > 10_000

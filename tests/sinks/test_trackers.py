"""``tmetrics_core.sinks.trackers``: the framework loggers and trackers a loop already has, as the
sink options that write into their runs (real Lightning loggers and accelerate trackers)."""

from __future__ import annotations

import pytest

from tmetrics_core.errors import ConfigError
from tmetrics_core.sinks.trackers import SHARED_PREFIX, known_trackers, tracker_sinks


def test_lightning_loggers_and_accelerate_trackers_become_sink_options(tmp_path, monkeypatch, mlflow_uri):
    from accelerate.tracking import TensorBoardTracker
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, TensorBoardLogger

    monkeypatch.chdir(tmp_path)
    board = TensorBoardLogger(str(tmp_path / "lightning"), name="mine")
    flow = MLFlowLogger(experiment_name="mine", tracking_uri=mlflow_uri)
    csv = CSVLogger(str(tmp_path / "csv"))
    assert known_trackers([board, flow, csv]) == [board, flow]  # the CSV file is passed over
    assert tracker_sinks([board, flow]) == {
        "tensorboard": {"log_dir": board.log_dir, "prefix": SHARED_PREFIX},
        "mlflow": {"tracking_uri": mlflow_uri, "run_id": flow.run_id},
    }
    accelerate_board = TensorBoardTracker("mine", str(tmp_path / "accelerate"))
    accelerate_board.start()  # as accelerator.init_trackers does
    assert tracker_sinks([accelerate_board]) == {
        "tensorboard": {"log_dir": str(tmp_path / "accelerate" / "mine"), "prefix": SHARED_PREFIX}}
    accelerate_board.finish()


def test_an_object_that_is_no_tracker_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="trackers: builtins.dict is not a tracker tmetrics can write into"):
        tracker_sinks([{"log_dir": str(tmp_path)}])

"""Layer x expert heatmaps read back from the real tracker stores: TensorBoard's event file,
MLflow's artifact store on disk and a W&B offline run directory."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from tests.sinks.readback_tensorboard import read_log
from tests.sinks.test_render import EXPERTS, HOT, LAYERS, grid_records
from tmetrics_core.records import RunInfo

STEPS = (1, 2)
KEY = "layer-router-expert-bias/layer_x_expert"


def _run(tmp_path: Path) -> RunInfo:
    return RunInfo(name="grid", dir=str(tmp_path / "run"), num_layers=LAYERS, num_experts=EXPERTS)


def _check_picture(png: bytes) -> None:
    """Rows are layers, columns experts, 16 pixels a cell; HOT is the brightest cell, the NaN at
    (2, 0) magenta."""
    image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    assert image.shape == (LAYERS * 16, EXPERTS * 16, 3)
    cells = image[8::16, 8::16].astype(float)
    assert tuple(cells[2, 0]) == (255, 0, 255)
    luminance = cells @ np.array([0.2126, 0.7152, 0.0722])
    luminance[2, 0] = -1
    assert np.unravel_index(np.argmax(luminance), luminance.shape) == HOT
    assert np.sum(luminance == luminance.max()) == 1


def test_tensorboard_images(tmp_path: Path) -> None:
    from tmetrics_tb import TensorBoardSink

    sink = TensorBoardSink(expert_scalars=False)
    sink.open(_run(tmp_path))
    for step in STEPS:
        sink.write(grid_records(step), step)
    sink.close("finished")
    log = read_log(Path(tmp_path / "run" / "tb"))
    assert log.image_tags == {KEY, "layer-expert-tokens/layer_x_expert"}
    assert not any("expert_0" in tag for tag in log.scalar_tags)  # expert_scalars: false
    events = log.images(KEY)
    assert [(step, height, width) for step, height, width, _ in events] == [(s, LAYERS * 16, EXPERTS * 16) for s in STEPS]
    _check_picture(events[-1][3])


def test_mlflow_images(tmp_path: Path, mlflow_uri: str) -> None:
    from tests.sinks.readback_mlflow import histories, run_by_id
    from tmetrics_mlflow import MlflowSink

    sink = MlflowSink(tracking_uri=mlflow_uri, experiment="grid", expert_scalars=False)
    sink.open(_run(tmp_path))
    for step in STEPS:
        sink.write(grid_records(step), step)
    sink.close("finished")
    assert sink.run_id is not None
    client, _ = run_by_id(mlflow_uri, sink.run_id)
    assert histories(client, sink.run_id) == {}  # every value of these records is a heatmap cell
    store = Path(mlflow_uri.removeprefix("sqlite:///")).parent / "mlartifacts"
    pngs = sorted(store.rglob("images/layer-router-expert-bias~layer_x_expert+step+*.png"))
    assert sorted(int(p.name.split("+")[2]) for p in pngs) == list(STEPS)
    _check_picture(pngs[-1].read_bytes())


def test_wandb_images(tmp_path: Path) -> None:
    from tests.sinks.readback_wandb import find_run_file, read_run
    from tmetrics_wandb import WandbSink

    sink = WandbSink(mode="offline", heatmap_every=0, expert_scalars=False)
    sink.open(_run(tmp_path))
    for step in STEPS:
        sink.write(grid_records(step), step)
    sink.close("finished")
    run_file = find_run_file(tmp_path / "run" / "wandb")
    rows = read_run(run_file).history
    assert [row[KEY]["_type"] for row in rows] == ["image-file"] * len(STEPS)
    assert (rows[0][KEY]["height"], rows[0][KEY]["width"]) == (LAYERS * 16, EXPERTS * 16)
    assert not any("expert_0" in key for row in rows for key in row)
    pngs = sorted(run_file.parent.rglob("layer_x_expert_*.png"))
    assert len([p for p in pngs if p.parent.name == "layer-router-expert-bias"]) == len(STEPS)
    _check_picture(next(p for p in pngs if p.parent.name == "layer-router-expert-bias").read_bytes())

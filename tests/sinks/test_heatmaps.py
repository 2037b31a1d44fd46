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


def _check_picture(png: bytes, *, step: int | None = STEPS[-1]) -> None:
    """The figure a person reads (issue 35): a colour bar (one pixel column running through the
    whole viridis scale, yellow at the top, dark purple at the bottom), the cells left of it with
    HOT the brightest and the NaN at (2, 0) magenta below-left of it, and the text chunks naming
    the axes, their ticks, the colour range, the metric and the step (TensorBoard keeps our PNG;
    MLflow and W&B store the pixels again, without text: ``step=None``)."""
    picture = Image.open(io.BytesIO(png))
    text = dict(picture.text) if step is not None else {}  # type: ignore[attr-defined]
    assert step is None or text["Title"] == f"layer-router-expert-bias, step {step}"
    assert step is None or text["Description"].startswith(f"{LAYERS} layers (y axis, ticks 0..{LAYERS - 1}) x {EXPERTS} experts "
                                          f"(x axis, ticks 0..{EXPERTS - 1}); colour bar viridis from ")
    image = np.asarray(picture.convert("RGB")).astype(int)
    height, width, _ = image.shape
    assert height >= 250 and width >= 400
    bar = colour_bar_column(image)
    assert bar is not None and bar > width // 2
    cells = image[:, :bar - 20]
    magenta = np.argwhere((cells == (255, 0, 255)).all(axis=2))
    yellow = np.argwhere((np.abs(cells - (253, 231, 37)) < 12).all(axis=2))
    assert len(magenta) > 100 and len(yellow) > 100
    assert magenta[:, 1].mean() < yellow[:, 1].mean() and magenta[:, 0].mean() > yellow[:, 0].mean()


def colour_bar_column(image: np.ndarray) -> int | None:
    """The x of a pixel column holding a colour bar: over 40 distinct saturated colours, the top
    one yellow and the bottom one dark purple (viridis' ends); None when there is none."""
    for x in range(image.shape[1] - 1, -1, -1):
        column = image[:, x]
        coloured = column[(column.max(axis=1) - column.min(axis=1)) > 60]
        if len({tuple(c) for c in coloured}) > 40 and coloured[0][0] > 200 and coloured[0][2] < 100 \
                and coloured[-1][0] < 100 and coloured[-1][2] > 60:
            return x
    return None


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
    assert [step for step, _, _, _ in events] == list(STEPS)
    height, width = events[-1][1:3]
    assert Image.open(io.BytesIO(events[-1][3])).size == (width, height)
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
    _check_picture(pngs[-1].read_bytes(), step=None)


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
    assert rows[0][KEY]["height"] >= 250 and rows[0][KEY]["width"] >= 400
    assert not any("expert_0" in key for row in rows for key in row)
    pngs = sorted(run_file.parent.rglob("layer_x_expert_*.png"))
    assert len([p for p in pngs if p.parent.name == "layer-router-expert-bias"]) == len(STEPS)
    _check_picture(next(p for p in pngs if p.parent.name == "layer-router-expert-bias").read_bytes(), step=None)

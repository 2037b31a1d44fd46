from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tmetrics_core.errors import ConfigError
from tmetrics_core.records import Labels, MetricRecord, RunInfo
from tmetrics_mlflow import MlflowSink, compare_runs


def _log_run(uri: str, tmp_path: Path, name: str, scale: float, *, extra: bool = False, experiment: str = "cmp") -> str:
    """Layers 0..11 of layer-grad-l2 = scale * (layer + 1) * step, a stat table, a tensor
    metric and a global one, at steps 1 and 2."""
    sink = MlflowSink(tracking_uri=uri, experiment=experiment, run_name=name, expert_scalars=True)
    sink.open(RunInfo(name=name, dir=str(tmp_path / name), num_layers=12, num_experts=2))
    for step in (1, 2):
        records = [MetricRecord("global-grad-l2", step, scale * 10 * step)]
        for layer in range(12):
            records.append(MetricRecord("layer-grad-l2", step, scale * (layer + 1) * step, labels=Labels(layer=layer)))
            records.append(MetricRecord("layer-expert-load-imbalance", step, 1.0 + layer / 100, labels=Labels(layer=layer, stat="cv")))
        records.append(MetricRecord("layer-expert-tokens", step, (scale * 4.0, 6.0), labels=Labels(layer=0)))
        records.append(MetricRecord("tensor-grad-l2", step, scale * 0.5, labels=Labels(tensor="layers.10.attn.q.weight")))
        records.append(MetricRecord("tensor-grad-l2", step, scale * 0.25, labels=Labels(tensor="layers.9.attn.q.weight")))
        if extra:
            records.append(MetricRecord("layer-update-ratio", step, 0.01, labels=Labels(layer=0)))
        sink.write(records, step)
    sink.close("finished")
    assert sink.run_id is not None
    return sink.run_id


def _table(text: str, title: str) -> list[list[str]]:
    lines = text.splitlines()
    start = lines.index(title) + 2  # skip the title and the header row
    rows = []
    for line in lines[start:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def test_two_runs_side_by_side_with_ratio_and_plot(tmp_path: Path, mlflow_uri: str) -> None:
    base = _log_run(mlflow_uri, tmp_path, "base", 1.0)
    _log_run(mlflow_uri, tmp_path, "wide", 2.0, extra=True)
    png = tmp_path / "out" / "compare.png"
    text = compare_runs(["base", "wide"], tracking_uri=mlflow_uri, out_png=png)

    assert text.startswith("step: last value of each key\n")
    assert f"  base: run {base} " in text
    header = text.splitlines()[text.splitlines().index("layer-grad-l2") + 1].split()
    assert header == ["base", "wide", "wide/base"]
    rows = _table(text, "layer-grad-l2")
    # Last step is 2: base = 2 * (layer + 1), wide = 4 * (layer + 1); rows in layer order.
    assert rows == [[f"layer_{i:02d}", f"{2 * (i + 1):g}", f"{4 * (i + 1):g}", "2"] for i in range(12)]
    assert _table(text, "layer-expert-load-imbalance/cv")[3] == ["layer_03", "1.03", "1.03", "1"]
    assert _table(text, "layer-expert-tokens") == [["layer_00/expert_000", "4", "8", "2"],
                                                    ["layer_00/expert_001", "6", "6", "1"]]
    # Natural order: layers.9 before layers.10.
    assert _table(text, "tensor-grad-l2") == [["layers.9.attn.q.weight", "0.25", "0.5", "2"],
                                               ["layers.10.attn.q.weight", "0.5", "1", "2"]]
    assert _table(text, "global") == [["global-grad-l2", "20", "40", "2"]]
    # A metric only one run has: the other shows "-" and no ratio.
    assert _table(text, "layer-update-ratio") == [["layer_00", "-", "0.01", "-"]]

    assert f"plot: {png}: 3 per-layer tables" in text  # grad-l2, imbalance/cv, update-ratio
    import matplotlib.image

    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 800
    assert len(np.unique(image.reshape(-1, image.shape[2]), axis=0)) > 20


def test_step_ids_and_metric_filter(tmp_path: Path, mlflow_uri: str) -> None:
    a = _log_run(mlflow_uri, tmp_path, "a", 1.0)
    b = _log_run(mlflow_uri, tmp_path, "b", 3.0, experiment="other-experiment")
    text = compare_runs([a, b], tracking_uri=mlflow_uri, step=1, metrics=["layer-grad-*"])
    assert text.startswith("step: 1\n")
    tables = [line for line in text.splitlines() if line and not line.startswith(" ") and not line.startswith("step")]
    assert tables == ["layer-grad-l2"]
    assert _table(text, "layer-grad-l2")[11] == ["layer_11", "12", "36", "3"]


def test_errors_name_the_problem(tmp_path: Path, mlflow_uri: str) -> None:
    _log_run(mlflow_uri, tmp_path, "twin", 1.0)
    _log_run(mlflow_uri, tmp_path, "twin", 2.0)
    with pytest.raises(ConfigError, match="2 runs are named 'twin'.*pass one run id"):
        compare_runs(["twin"], tracking_uri=mlflow_uri)
    with pytest.raises(ConfigError, match="no run with id or name 'ghost'"):
        compare_runs(["ghost"], tracking_uri=mlflow_uri)
    with pytest.raises(ConfigError, match="no metric of these runs matches"):
        run_id = _log_run(mlflow_uri, tmp_path, "single", 1.0)
        compare_runs([run_id], tracking_uri=mlflow_uri, metrics=["nothing-*"])
    with pytest.raises(ConfigError) as info:
        compare_runs(["x"], tracking_uri="./mlruns")
    assert info.value.path == "compare.tracking_uri"
    with pytest.raises(ConfigError):
        compare_runs([], tracking_uri=mlflow_uri)


def test_the_plot_has_integer_layer_ticks_and_names_the_step(tmp_path: Path, mlflow_uri: str, monkeypatch) -> None:
    """Issue 35: layer ticks fell at 0.5, 1.5 and the plot did not say which step it shows."""
    from matplotlib.figure import Figure

    _log_run(mlflow_uri, tmp_path, "base", 1.0)
    saved: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: saved.append(self))
    compare_runs(["base"], tracking_uri=mlflow_uri, out_png=tmp_path / "p.png", step=1)
    (figure,) = saved
    ticks = [t for t in figure.axes[0].get_xticks() if 0 <= t <= 11]
    assert len(ticks) > 2 and all(float(t).is_integer() for t in ticks)
    assert figure._suptitle.get_text() == "base: step 1"

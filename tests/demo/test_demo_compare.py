"""``tmetrics compare`` on two demo runs with different learning rates: the per-layer table
shows both runs side by side with their ratio, and the plot is written."""

from __future__ import annotations

import functools
import json

import pytest
from click.testing import CliRunner

from tmetrics_core.cli.main import main
from tmetrics_core.demo.instrument import make_metrics
from tmetrics_core.demo.launch import DemoArgs, run_demo


@pytest.mark.timeout(600)
def test_compare_two_demo_runs(tmp_path):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    values = {}
    for name, lr in (("lr-small", 1e-3), ("lr-large", 3e-2)):
        config = tmp_path / f"{name}.yaml"
        config.write_text(
            f"run: {{name: {name}}}\nmetrics: [layer-update-ratio:1, layer-param-l2:1]\n"
            f"sinks:\n  mlflow: {{tracking_uri: '{store}', experiment: compare-test}}\n  jsonl: {{}}\n")
        args = DemoArgs(steps=3, lr=lr, config=config, run_dir=tmp_path / name)
        run_demo(args, metrics=functools.partial(make_metrics, args))
        lines = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        values[name] = {r["labels"]["layer"]: r["value"] for r in lines
                        if r["metric"] == "layer-update-ratio" and r["step"] == 3}
    out_png = tmp_path / "compare.png"
    result = CliRunner().invoke(main, ["compare", "lr-small", "lr-large", "--tracking-uri", store,
                                       "--metric", "layer-update-ratio", "--out", str(out_png)])
    assert result.exit_code == 0, result.output
    assert "lr-small" in result.output and "lr-large" in result.output
    rows = [line for line in result.output.splitlines() if line.lstrip().startswith("layer_")]
    assert len(rows) == 4
    for layer, row in enumerate(rows):
        small, large = values["lr-small"][layer], values["lr-large"][layer]
        label, a, b, ratio = row.split()
        assert label == f"layer_{layer:02d}"
        assert float(a) == pytest.approx(small, rel=1e-4)
        assert float(b) == pytest.approx(large, rel=1e-4)
        assert float(ratio) == pytest.approx(large / small, rel=1e-3)
        assert large > small  # the larger learning rate moves the weights more
    assert out_png.stat().st_size > 10_000

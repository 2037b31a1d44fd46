"""The layer x expert heatmap as a person sees it in TensorBoard (issue 35): headless Chromium.

A tiny Mixtral (2 layers x 4 experts) trains two steps with ``layer-expert-tokens`` into the
TensorBoard sink; a real TensorBoard server reads the logdir. Its image endpoint serves the figure
the sink drew (axes, ticks, colour bar; the colour range is the step's token counts), and a
screenshot of its Images dashboard holds that figure, scaled to the card and found by its colour
bar: the whole figure, ticks and labels included, matches the screenshot's pixels there.

Needs the ``chromium`` binary (``.ci/setup`` installs it: ``apt-get install -y chromium``).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.integrations.tiny import SEQ, VOCAB
from tmetrics_core.tensor_metrics import TensorMetrics

pytestmark = pytest.mark.timeout(120)

TAG = "layer-expert-tokens/layer_x_expert"
LAYERS, EXPERTS = 2, 4


def _train(run_dir: Path) -> dict[int, list[float]]:
    """Two steps of a tiny Mixtral; returns each step's token counts (all layers' cells)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=SEQ, num_local_experts=EXPERTS, num_experts_per_tok=2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = {"run": {"name": "shot"}, "metrics": ["layer-expert-tokens:1"], "sinks": {"tensorboard": {}}}
    counts = {}
    with TensorMetrics.from_config(config, model=model, optimizer=optimizer, run_dir=run_dir) as metrics:
        for step in (1, 2):
            ids = torch.randint(VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(step))
            with metrics.step(step):
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            counts[step] = [float(v) for r in metrics.last_records if r.metric == "layer-expert-tokens"
                            for v in np.atleast_1d(r.value)]
    return counts


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _bar_run(column: np.ndarray) -> tuple[int, int] | None:
    """The first and last row of the topmost run of saturated pixels in ``column`` that runs
    through viridis (over 40 distinct colours, yellow on top, dark purple at the bottom)."""
    rows = np.nonzero(np.ptp(column, axis=1) > 60)[0]
    for run in np.split(rows, np.nonzero(np.diff(rows) != 1)[0] + 1):
        colours = column[run]
        if len(run) > 40 and len({tuple(c) for c in colours}) > 40 and colours[0][0] > 200 \
                and colours[0][2] < 100 and colours[-1][0] < 100 and colours[-1][2] > 60:
            return int(run[0]), int(run[-1])
    return None


def _bar(image: np.ndarray) -> tuple[float, int, int]:
    """The colour bar of the topmost figure: its middle column (x), first and last row."""
    found = [(x, run) for x in range(image.shape[1]) if (run := _bar_run(image[:, x])) is not None]
    assert found, "no colour bar (a column through viridis, yellow on top)"
    top = min(run[0] for _, run in found)
    xs = [x for x, run in found if abs(run[0] - top) <= 2]
    bottom = max(run[1] for x, run in found if x in xs)
    return (min(xs) + max(xs)) / 2, top, bottom


def test_the_heatmap_in_tensorboards_images_dashboard_shows_axes_ticks_and_a_colour_bar(tmp_path):
    chromium = shutil.which(os.environ.get("CHROMIUM") or "chromium")
    if chromium is None:
        pytest.fail("this test needs headless Chromium: no executable `chromium` on PATH or at $CHROMIUM "
                    "(install it: `apt-get install -y chromium`, which .ci/setup runs)")
    counts = _train(tmp_path)
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path / "tb"),
                               "--host", "127.0.0.1", "--port", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if TAG in json.loads(_get(f"{base}/data/plugin/images/tags")).get("shot", {}):
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "TensorBoard did not serve the heatmap"
            time.sleep(0.5)
        events = json.loads(_get(f"{base}/data/plugin/images/images?run=shot&tag={TAG}&sample=0"))
        assert [e["step"] for e in events] == [1, 2]
        served = Image.open(io.BytesIO(_get(f"{base}/data/plugin/images/individualImage?{events[-1]['query']}")))
        low, high = min(counts[2]), max(counts[2])
        assert served.text["Title"] == "layer-expert-tokens, step 2"  # type: ignore[attr-defined]
        assert served.text["Description"].startswith(  # type: ignore[attr-defined]
            f"{LAYERS} layers (y axis, ticks 0..{LAYERS - 1}) x {EXPERTS} experts (x axis, ticks 0..{EXPERTS - 1}); "
            f"colour bar viridis from {low:.6g} to {high:.6g}")
        figure = np.asarray(served.convert("RGB")).astype(float)

        shot = tmp_path / "images.png"
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=1200,900", "--virtual-time-budget=10000", f"--screenshot={shot}",
                        f"{base}/#images&tagFilter=layer_x_expert"],
                       check=True, capture_output=True, timeout=60)
        page = np.asarray(Image.open(shot).convert("RGB")).astype(float)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=10)

    # The figure's colour bar in the page gives the scale and the place of the whole figure.
    fx, ftop, fbottom = _bar(figure.astype(int))
    px, ptop, pbottom = _bar(page.astype(int))
    scale = (pbottom - ptop) / (fbottom - ftop)
    height, width = round(figure.shape[0] * scale), round(figure.shape[1] * scale)
    assert width >= 300, f"the heatmap is shown {width} px wide"
    expected = np.asarray(Image.fromarray(figure.astype(np.uint8)).resize((width, height), Image.BILINEAR)).astype(float)
    # Where the bar puts the figure, within a pixel (the bar's ends blend into the page when scaled).
    left, top = min(((round(px - fx * scale) + dx, round(ptop - ftop * scale) + dy) for dx in (-1, 0, 1) for dy in (-1, 0, 1)),
                    key=lambda at: float(np.abs(page[at[1]:at[1] + height, at[0]:at[0] + width] - expected).mean()))
    assert left >= 0 and top >= 0 and left + width <= page.shape[1] and top + height <= page.shape[0]
    region = page[top:top + height, left:left + width]
    assert np.abs(region - expected).mean() < 8, "the page's pixels there are not the figure"  # 2.7 when it is
    # Ticks and labels: dark text left of the cells (layer ticks) and below them (expert ticks).
    dark = (region.max(axis=2) < 110)
    cells = np.ptp(region, axis=2) > 60
    rows, columns = np.nonzero(cells[:, : round((fx - 10) * scale)])
    assert dark[rows.min():rows.max(), : columns.min() - 5].sum() > 20, "no layer ticks left of the cells"
    assert dark[rows.max() + 5:, columns.min():columns.max()].sum() > 20, "no expert ticks below the cells"

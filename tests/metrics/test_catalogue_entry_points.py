"""A metric from an installed package: one module and one entry point in ``tmetrics.metrics``.

The package is built in the test as an installer leaves it (a module and its ``.dist-info``
with ``entry_points.txt``) on ``sys.path``; a config names its metric with its own option, the
run writes the records, and the values match a float64 reference."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.catalogue import build_metric, describe_catalogue, resolve_metric
from tmetrics_core.tensor_metrics import TensorMetrics

# The whole of a third-party metric family: one file.
FAMILY = '''
"""layer-grad-rms-db: each layer's gradient RMS in decibels relative to a reference RMS."""

import math

from tmetrics_core.config.metric_options import MetricOption
from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.entry import SELECT, CatalogueEntry, made
from tmetrics_core.metrics.norms import Rms

REFERENCE = MetricOption("reference", "float", 1.0, "the gradient RMS that reads 0 dB, > 0 (gradient units)")


class RmsDb(Rms):
    formula = "20 log10(sqrt(sum_i g_i^2 / N) / reference)"

    def __init__(self, *, reference, **kwargs):
        if reference <= 0:
            raise ConfigError(f"got {reference}; need a reference RMS > 0", path="reference")
        self.reference = reference
        super().__init__(**kwargs)

    def finalize(self, stats):
        rms = super().finalize(stats)
        return None if rms is None else 20 * math.log10(rms / self.reference)


def entries():
    return [CatalogueEntry(
        "layer-grad-rms-db", made(RmsDb, ["grad"], "layer"), ("grad",), ("layer",), RmsDb.formula, "dB",
        "steady across steps; falls as training converges", "as layer-grad-rms", options=(SELECT, REFERENCE))]
'''


# An entry that does not build from its declared defaults (its option has none): left out.
NEEDS_AN_OPTION = '''
from tmetrics_core.metrics.entry import CatalogueEntry
from tmetrics_core.metrics.norms import Rms


def entries():
    return [CatalogueEntry("layer-grad-needs", lambda *, name, window: Rms(name=name), ("grad",), ("layer",),
                           "f", "u", "b", "p")]
'''


def _install(site: Path, dist: str, module: str | None, source: str, points: str) -> None:
    """What an installer leaves on ``site``: the module and its distribution's metadata."""
    if module is not None:
        (site / f"{module}.py").write_text(textwrap.dedent(source))
    info = site / f"{dist.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[tmetrics.metrics]\n{points}\n")


@pytest.fixture
def installed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    _install(site, "tmx-rms-db", "tmx_rms_db", FAMILY, "rms-db = tmx_rms_db:entries")
    _install(site, "tmx-broken", None, "", "broken = tmx_missing_module:entries")
    _install(site, "tmx-needs", "tmx_needs", NEEDS_AN_OPTION, "needs = tmx_needs:entries")
    monkeypatch.syspath_prepend(str(site))
    return tmp_path


class _Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.tanh(self.layers[0](x)))


def test_a_config_names_an_installed_metric_with_its_option_and_the_run_writes_its_values(installed: Path):
    torch.manual_seed(0)
    model = _Blocks()
    config = {"metrics": [{"name": "layer-grad-rms-db", "reference": 0.01, "interval": 1}], "sinks": ["jsonl"],
              "run": {"name": "plugin", "dir": str(installed / "run")}}
    metrics = TensorMetrics.from_config(config, model=model)
    for step in (1, 2):
        with metrics.step(step):
            model.zero_grad()
            model(torch.randn(6, 5)).pow(2).mean().backward()
            grads = {i: [p.grad.detach().double() for p in layer.parameters()] for i, layer in enumerate(model.layers)}
    metrics.close()
    lines = [json.loads(x) for x in (installed / "run" / "metrics.jsonl").read_text().splitlines()]
    got = {r["labels"]["layer"]: r["value"] for r in lines if r.get("metric") == "layer-grad-rms-db" and r["step"] == 2}
    want = {}
    for i, gs in grads.items():
        rms = math.sqrt(sum(float(g.pow(2).sum()) for g in gs) / sum(g.numel() for g in gs))
        want[i] = 20 * math.log10(rms / 0.01)
    assert got == {i: pytest.approx(v, rel=1e-12, abs=1e-12) for i, v in want.items()}
    assert sorted(r["step"] for r in lines if r.get("metric") == "layer-grad-rms-db") == [1, 1, 2, 2]


def test_an_undeclared_option_or_a_wrong_type_is_refused_with_the_declared_options(installed: Path):
    model = _Blocks()
    with pytest.raises(ConfigError) as err:
        TensorMetrics.from_config({"metrics": [{"name": "layer-grad-rms-db", "refrence": 0.01}]}, model=model)
    assert err.value.path == "metrics[0].refrence"
    assert ("metric 'layer-grad-rms-db' takes no 'refrence' option (did you mean 'reference'?) "
            "(it takes: reference, select)") in str(err.value)
    with pytest.raises(ConfigError) as err:
        TensorMetrics.from_config({"metrics": [{"name": "layer-grad-rms-db", "reference": "loud"}]}, model=model)
    assert err.value.path == "metrics[0].reference"
    assert "got 'loud' (a string); need a number (the gradient RMS that reads 0 dB" in str(err.value)
    with pytest.raises(ConfigError, match="takes no 'reference' option"):
        TensorMetrics.from_config({"metrics": [{"name": "layer-grad-rms", "reference": 0.01}]}, model=model)
    with pytest.raises(ConfigError, match="need a reference RMS > 0"):
        build_metric("layer-grad-rms-db", reference=-1.0)
    assert build_metric("layer-grad-rms-db").reference == 1.0  # the declared default


def test_tmetrics_metrics_lists_installed_entries_and_the_family_that_failed(installed: Path):
    table = describe_catalogue()
    assert "layer-grad-rms-db [rms-db (tmx-rms-db)]" in table
    assert "left out: broken (tmx-broken), tmx_missing_module:entries: ModuleNotFoundError" in table
    assert "left out: needs (tmx-needs), tmx_needs:entries: TypeError" in table and "layer-grad-needs" not in table
    entry = next(m for m in json.loads(describe_catalogue("json"))["metrics"] if m["name"] == "layer-grad-rms-db")
    assert entry["options"] == [
        {"name": "select", "type": "strings", "default": None,
         "meaning": "fnmatch globs on canonical tensor names narrowing the sites (omitted: every site it reads)"},
        {"name": "reference", "type": "float", "default": 1.0,
         "meaning": "the gradient RMS that reads 0 dB, > 0 (gradient units)"}]
    with pytest.raises(KeyError, match="failed to load: broken"):
        resolve_metric("layer-grad-rms-dB")

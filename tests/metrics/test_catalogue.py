"""The catalogue: every DESIGN section 4 name, every Megatron-LM tensor-metrics name with the
same meaning, options checked, and the text `tmetrics metrics` prints."""

from __future__ import annotations

import json

import pytest

from tmetrics_core.config.names import check_names
from tmetrics_core.config.schema import load_config
from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.base import TensorMetric
from tmetrics_core.metrics.catalogue import (
    ALIASES,
    build_metric,
    catalogue_entries,
    describe_catalogue,
    metric_names,
    metric_options,
    resolve_metric,
)
from tmetrics_core.site import Site

DESIGN_NAMES = [f"{scope}-{kind}-l2" for scope in ("global", "layer", "tensor") for kind in ("param", "grad")] + [
    "layer-param-absmax", "layer-grad-absmax", "layer-param-rms", "layer-grad-rms", "global-param-mean-row-l2",
    "global-param-mean-column-l2", "layer-grad-nonfinite", "layer-grad-zero-fraction", "layer-update-ratio",
    "layer-optimizer-state-rms", "layer-param-histogram", "layer-grad-histogram", "dp-replica-drift",
    "layer-residual-accumulator-l2", "layer-residual-contribution-l2", "layer-residual-accumulator-rms",
    "layer-residual-contribution-rms", "global-output-logits-l2", "output-logits-max", "output-entropy",
    "layer-activation-rms", "layer-router-logits-l2", "layer-router-logits-max", "layer-router-logits-median",
    "layer-router-decision-entropy", "layer-expert-tokens", "layer-expert-load-imbalance", "layer-dead-experts",
    "layer-router-z-loss", "layer-router-health", "layer-router-routing-balance",
    "layer-router-seq-aux-decomposition", "layer-router-expert-bias",
]

# Megatron-LM name -> (our canonical name, the source kinds Megatron reads, mapped to ours).
MEGATRON = {
    "global-param-l2": ("global-param-l2", {"param"}),
    "layer-param-l2": ("layer-param-l2", {"param"}),
    "global-param-mean-row-l2": ("global-param-mean-row-l2", {"param"}),
    "global-param-mean-column-l2": ("global-param-mean-column-l2", {"param"}),
    "global-wgrad-l2": ("global-grad-l2", {"grad"}),
    "layer-wgrad-l2": ("layer-grad-l2", {"grad"}),
    "layer-residual-accumulator-l2": ("layer-residual-accumulator-l2", {"residual_accumulator"}),
    "layer-residual-contribution-l2": ("layer-residual-contribution-l2", {"residual_contribution"}),
    "global-output-logits-l2": ("global-output-logits-l2", {"logits"}),
    "layer-router-logits-l2": ("layer-router-logits-l2", {"router_logits"}),
    "layer-router-logits-max": ("layer-router-logits-max", {"router_logits"}),
    "layer-router-logits-sampled-median": ("layer-router-logits-median", {"router_logits"}),
    "layer-router-decision-entropy": ("layer-router-decision-entropy", {"router_scores", "router_logits"}),
    "layer-router-health": ("layer-router-health", None),
    "layer-router-routing-balance": ("layer-router-routing-balance", None),
    "layer-router-seq-aux-decomposition": ("layer-router-seq-aux-decomposition", None),
    "layer-router-expert-bias": ("layer-router-expert-bias", None),
}


def test_every_design_name_is_in_the_catalogue():
    names = {e.name for e in catalogue_entries()}
    assert set(DESIGN_NAMES) <= names
    assert {"family-param-l2", "family-grad-l2"} <= names  # the family scope


@pytest.mark.parametrize("megatron", sorted(MEGATRON))
def test_megatron_names_have_the_same_meaning(megatron):
    canonical, kinds = MEGATRON[megatron]
    assert resolve_metric(megatron) == canonical
    metric = build_metric(megatron)
    assert metric.name == canonical
    if kinds is not None:
        assert set(metric.source_kinds) == kinds
    assert megatron in metric_names()


def test_entries_build_metrics_that_match_their_description():
    for entry in catalogue_entries():
        metric = build_metric(entry.name)
        assert isinstance(metric, TensorMetric)
        assert metric.name == entry.name
        assert set(metric.source_kinds) == set(entry.source_kinds), entry.name
        assert entry.formula and entry.unit and entry.baseline and entry.placements and entry.scopes
    assert set(ALIASES.values()) <= {e.name for e in catalogue_entries()}


def test_unknown_names_suggest_close_matches():
    with pytest.raises(KeyError, match="layer-grad-l2"):
        resolve_metric("layer-grad-l3")
    with pytest.raises(ConfigError, match="did you mean") as info:
        build_metric("layr-grad-l2")
    assert info.value.path == "name"


def test_options_are_checked_per_metric():
    with pytest.raises(ConfigError, match="takes no 'bins'") as info:
        build_metric("layer-grad-l2", bins=8)
    assert info.value.path == "bins"
    with pytest.raises(ConfigError, match="modules"):
        build_metric("layer-grad-rms", modules=["layers.*"])
    with pytest.raises(ConfigError, match="sample"):
        build_metric("layer-param-histogram", sample=3)
    assert build_metric("layer-grad-histogram", bins=16).log_bins.bins == 16
    assert build_metric("layer-router-logits-median", bins=64).log_bins.bins == 64
    assert build_metric("dp-replica-drift", sample=5).sample == 5
    assert build_metric("layer-activation-rms", modules="layers.*.mlp").modules == ("layers.*.mlp",)
    metric = build_metric("layer-grad-l2", select="layers.1.*")
    site = Site("layers.1.mlp.up.weight", "grad", (4, 4), layer=1)
    assert metric.accepts(site)
    assert not metric.accepts(Site("layers.2.mlp.up.weight", "grad", (4, 4), layer=2))
    assert build_metric("layer-grad-l2", select=()).select == ()


def test_activation_rms_observes_only_chosen_modules():
    metric = build_metric("layer-activation-rms")
    assert metric.accepts(Site("layers.3.mlp", "activation", (-1, 8), layer=3))
    assert not metric.accepts(Site("layers.3.mlp.up", "activation", (-1, 8), layer=3))
    assert not metric.accepts(Site("layers.3.mlp", "grad", (8, 8), layer=3))


def test_config_aliases_resolve_to_canonical_names():
    config = load_config({"metrics": "global-wgrad-l2:10 layer-router-logits-sampled-median:5"})
    checked = check_names(config, resolve_metric=resolve_metric, metric_names=metric_names(), sink_names=[],
                          metric_options=metric_options)
    assert [m.name for m in checked.metrics] == ["global-grad-l2", "layer-router-logits-median"]
    with pytest.raises(ConfigError, match="repeats"):
        check_names(load_config({"metrics": ["global-wgrad-l2", "global-grad-l2"]}), resolve_metric=resolve_metric,
                    metric_names=metric_names(), sink_names=[], metric_options=metric_options)


def test_describe_catalogue_table_and_json():
    table = describe_catalogue()
    for entry in catalogue_entries():
        assert entry.name in table
    assert "global-wgrad-l2 -> global-grad-l2" in table
    assert table.splitlines()[0].split()[:2] == ["name", "source"]
    data = json.loads(describe_catalogue("json"))
    assert [m["name"] for m in data["metrics"]] == [e.name for e in catalogue_entries()]
    assert data["aliases"]["layer-wgrad-l2"] == "layer-grad-l2"
    first = data["metrics"][0]
    assert set(first) == {"name", "aliases", "source_kinds", "scopes", "formula", "unit", "baseline", "placements",
                          "options", "cost"}
    with pytest.raises(ConfigError, match="'table' or 'json'"):
        describe_catalogue("yaml")  # type: ignore[arg-type]


def test_every_entry_shows_its_cost_class():
    """Issue 35: the histogram's cost was nowhere; each entry names its class, and the table
    says what each class costs."""
    from tmetrics_core.metrics.catalogue import catalogue_entries, describe_catalogue
    from tmetrics_core.metrics.cost import COST_CLASSES

    costs = {e.name: e.cost for e in catalogue_entries()}
    assert set(costs.values()) <= set(COST_CLASSES)
    assert costs["layer-grad-histogram"] == costs["layer-router-logits-median"] == "binning"
    assert costs["layer-grad-l2"] == costs["layer-grad-rms"] == "shared-read"
    assert costs["layer-update-ratio"] == "snapshot" and costs["dp-replica-drift"] == "sampled"
    assert costs["layer-expert-tokens"] == "own-pass"
    table = describe_catalogue()
    assert all(f"  {name}: {meaning}" in table for name, meaning in COST_CLASSES.items())
    assert '"cost": "binning"' in describe_catalogue("json")

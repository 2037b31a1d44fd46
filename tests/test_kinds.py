"""The source-kind records: the sets the sources test against, the catalogue's kinds all declared,
and the sentence said for a metric that found nothing."""

from __future__ import annotations

import pytest

from tmetrics_core import kinds
from tmetrics_core.kinds import KINDS, Reader, kinds_where, what_feeds
from tmetrics_core.metrics.catalogue import catalogue_entries
from tmetrics_core.sources.flat import FLAT_KINDS

ROUTER = {"router_logits", "router_topk", "router_scores"}
COTANGENTS = {"residual_grad", "residual_input_grad", "logits_grad", "activation_grad"}


def test_the_queries_give_the_sources_sets() -> None:
    assert kinds.TOKEN_KINDS == {"residual_accumulator", "residual_contribution", "logits", "activation",
                                 "attn_qk"} | ROUTER | COTANGENTS
    assert kinds.OBSERVED_KINDS == kinds.TOKEN_KINDS | {"token_mask", "expert_bias"}
    assert kinds.GRAD_KINDS == COTANGENTS
    assert kinds.RESIDUAL_KINDS == {"residual_accumulator", "residual_contribution", "residual_grad",
                                    "residual_input_grad"}
    assert kinds.SEQUENCE_CHECKED == kinds.RESIDUAL_KINDS | {"activation_grad"}
    assert kinds.KEPT_KINDS == kinds.ROUTER_OUTPUT_KINDS == ROUTER
    assert kinds.MODULE_GLOB_KINDS == {"activation", "activation_grad"}
    assert kinds.EXPERT_COLUMN_KINDS == {"router_logits", "router_scores"}
    assert kinds_where(token_rows=True, kept=False, cotangent=False) == {
        "residual_accumulator", "residual_contribution", "logits", "activation", "attn_qk"}


def test_every_kind_is_declared_once_with_a_reader() -> None:
    names = [k.name for k in KINDS]
    assert len(names) == len(set(names))
    assert all(k.read and all(isinstance(r, Reader) for r in k.read) for k in KINDS)
    assert {k.name for k in KINDS if not k.observed} == {"grad", "exp_avg", "exp_avg_sq", "param", "update"}
    with pytest.raises(AttributeError):
        kinds_where(no_such_property=True)


def test_every_kind_the_catalogue_reads_is_declared() -> None:
    read = {kind for entry in catalogue_entries() for kind in entry.source_kinds}
    assert read and read <= {k.name for k in KINDS}, read - {k.name for k in KINDS}


def test_what_feeds_says_one_sentence_per_group() -> None:
    said = what_feeds({"router_topk", "router_logits", "residual_accumulator", "residual_contribution"})
    assert said.startswith("router_logits, router_topk sites come only from tm.observe(")
    assert said.count("sites come only from") == 1
    assert said.endswith("; residual sites are the outputs of transformer blocks under layers, h, blocks or "
                         "decoder.layers; no block ran in the step scope")
    assert "modules matching ['layers.*.mlp']" in what_feeds({"activation"}, ["layers.*.mlp"])
    # The parameter sentence only where no other kind said one.
    assert what_feeds({"param", "update"}) == "no rank holds a parameter it selects"
    assert "no rank holds" not in what_feeds({"param", "grad"})
    assert what_feeds({"expert_bias"}) == "no rank produced a site of kinds ['expert_bias']"


def test_the_parameter_side_sets_are_queries_too() -> None:
    assert kinds.PARAM_KINDS == {"param", "grad"}  # read before the optimizer step
    assert kinds.OPTIMIZER_KINDS == {"exp_avg", "exp_avg_sq", "update"}  # only after it
    assert kinds.AFTER_STEP_KINDS == {"param", "update", "exp_avg", "exp_avg_sq"}
    assert kinds.STATE_KINDS == {"exp_avg", "exp_avg_sq"}
    assert FLAT_KINDS == {"grad", "param", "exp_avg", "exp_avg_sq", "update"}
    # The update is the parameter's change over the step: read after it, from a snapshot taken before.
    assert next(k for k in KINDS if k.name == "update").read == (Reader.OPTIMIZER_POST,)

"""The source-kind records: the sets the sources test against, the catalogue's kinds all declared,
the sentence said for a metric that found nothing, the installers the records name, and a kind
registered from outside (its hooks reaching a metric: tests/distributed/test_new_kind_gloo.py)."""

from __future__ import annotations

import pytest

from tmetrics_core import kinds
from tmetrics_core.kinds import (INSTALL_ORDER, KINDS, Reader, SourceKind, installers_of, kinds_where, register_kind,
                                 what_feeds)
from tmetrics_core.metrics.catalogue import catalogue_entries
from tmetrics_core.scope.observation_hooks import resolve_installer
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
    assert kinds.kinds_where(after_step=True) == {"param", "update", "exp_avg", "exp_avg_sq"}
    assert kinds.STATE_KINDS == {"exp_avg", "exp_avg_sq"}
    assert FLAT_KINDS == {"grad", "param", "exp_avg", "exp_avg_sq", "update"}
    # The update is the parameter's change over the step: read after it, from a snapshot taken before.
    assert next(k for k in KINDS if k.name == "update").read == (Reader.OPTIMIZER_POST,)


def test_a_kind_has_installers_exactly_where_a_hook_reads_it() -> None:
    hooked = {Reader.FORWARD, Reader.BACKWARD}
    assert [k.name for k in KINDS if bool(k.installers) != bool(hooked & set(k.read))] == []
    # Fed by tm.observe alone (a model observes its bias buffer, kind="expert_bias"); cotangents
    # of tm.observe(..., grad=True) too.
    assert next(k for k in KINDS if k.name == "expert_bias").read == (Reader.OBSERVE,)
    assert {k.name for k in KINDS if k.cotangent and Reader.OBSERVE in k.read} == {"activation_grad", "logits_grad"}


def test_every_installer_is_ordered_and_resolves() -> None:
    named = {i for k in KINDS for i in k.installers}
    assert named == set(INSTALL_ORDER)
    for path in INSTALL_ORDER:
        assert callable(resolve_installer(path)), path
    # All of them, in the declared order; token kinds bring the padding mask's installer.
    assert installers_of(k.name for k in KINDS) == list(INSTALL_ORDER)
    assert [i.rpartition(":")[0].rpartition(".")[2] for i in installers_of({"router_topk"})] == ["padding", "routers"]
    assert installers_of({"grad", "expert_bias"}) == []
    with pytest.raises(ImportError, match=r"'tests.no_such_module:install'.*Spell it"):
        resolve_installer("tests.no_such_module:install")


def test_a_registered_kind_joins_the_sets_until_undone() -> None:
    kind = SourceKind("test_cotangent", (Reader.BACKWARD,), ("tests.test_kinds:nothing",), token_rows=True,
                      sequence_checked=True)
    undo = register_kind(kind)
    try:
        assert {"test_cotangent"} <= kinds.TOKEN_KINDS & kinds.GRAD_KINDS & kinds.SEQUENCE_CHECKED
        assert "test_cotangent" not in kinds.KEPT_KINDS
        assert kinds.declared()[-1] is kind
        assert installers_of({"test_cotangent"})[-1] == "tests.test_kinds:nothing"
        with pytest.raises(ValueError, match="declared already"):
            register_kind(kind)
    finally:
        undo()
    assert "test_cotangent" not in kinds.TOKEN_KINDS | kinds.GRAD_KINDS
    assert kinds.declared() == KINDS and installers_of(k.name for k in KINDS) == list(INSTALL_ORDER)
    with pytest.raises(ValueError, match="read by the optimizer"):
        register_kind(SourceKind("master_param", (Reader.OPTIMIZER_POST,)))
    with pytest.raises(ValueError, match="not spelled 'package.module:function'"):
        register_kind(SourceKind("x", (Reader.FORWARD,), ("tests/test_kinds.py",)))

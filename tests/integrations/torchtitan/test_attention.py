"""torchtitan's llama3 with no user code: its SDPA inner attention is observed by a pre-hook, and
the [layers x heads] table equals the float64 materialised causal softmax of the q and k that
inner attention received; its FlexAttention (block masks tmetrics cannot read) is refused at
start-up with the way to observe it."""

from __future__ import annotations

import pytest
import torch

from tests.attention_model import attention_metrics, table
from tests.integrations.torchtitan import titan_run
from tests.metrics.attention_reference import reference_table, structured_visible
from tmetrics_core.errors import ConfigError


def test_sdpa_inner_attention_is_observed_with_no_user_code():
    model, _, _ = titan_run.build("llama3", 1)
    seen = []
    for layer in model.layers.values():
        layer.attention.inner_attention.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append((args[0].transpose(1, 2).detach(), args[1].transpose(1, 2).detach(),
                                                 kwargs.get("scale"))), with_kwargs=True)
    metrics = attention_metrics(model)
    tokens = torch.randint(model.tok_embeddings.weight.shape[0], (titan_run.BATCH, titan_run.SEQ),
                           generator=torch.Generator().manual_seed(0))
    with metrics.step(1), torch.no_grad():
        model(tokens)
    got = table(metrics.last_records)
    metrics.close()
    assert len(seen) == 2 and len(got) == 2 * (2 + 3 * 4)
    batch, _, seq, dim = seen[0][0].shape
    visible, sink, counted = structured_visible(batch, seq, seq, causal=True)
    for layer, (q, k, scale) in enumerate(seen):
        want = reference_table(q, k, visible, sink, scale=scale if scale is not None else dim ** -0.5, counted=counted)
        assert got[("layer-attn-logit-max", layer, "heads")] == pytest.approx(tuple(want["max"].tolist()), rel=1e-12)
        for metric, name in (("layer-attn-entropy", "entropy"), ("layer-attn-sink", "sink"), ("layer-attn-lse", "lse")):
            torch.testing.assert_close(torch.tensor(got[(metric, layer, "heads")], dtype=torch.float64), want[name],
                                       rtol=1e-5, atol=1e-12)


def test_flex_inner_attention_is_refused_at_start_up():
    from torchtitan.models.common.attention import FlexAttention

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].inner_attention = FlexAttention.__new__(FlexAttention)
    torch.nn.Module.__init__(model.layers[0].inner_attention)
    with pytest.raises(ConfigError, match=r"FlexAttention.*tm.observe\(self, 'qk'"):
        attention_metrics(model)

"""Attention observation under ``torch.compile(fullgraph=True)``: ``tm.observe(..., kind="attn_qk")``
and the Hugging Face attention wrapper are one ``tmetrics::observe_attention`` operator in the
graph, so the graph count is the baseline's, nothing breaks the graph, a cadence that goes due
and idle recompiles nothing, and the records equal the uncompiled run's."""

from __future__ import annotations

import pytest
import torch

import tmetrics_core as tm
from tests.attention_model import attention_metrics, table

B, T, WIDTH, HEADS, DIM = 2, 7, 16, 2, 8


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(WIDTH, HEADS * DIM, bias=False)
        self.k = torch.nn.Linear(WIDTH, HEADS * DIM, bias=False)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = self.q(h).view(B, T, HEADS, DIM).transpose(1, 2)
        k = self.k(h).view(B, T, HEADS, DIM).transpose(1, 2)
        tm.observe(self, "qk", (q, k), kind="attn_qk", attention=tm.AttentionSpec(causal=True, token_mask=mask))
        return torch.nn.functional.scaled_dot_product_attention(q, k, k, is_causal=True).transpose(1, 2).reshape(h.shape)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([_Attention(), _Attention()])

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = h + layer(h, mask)
        return h


def _counting() -> tuple[list[int], object]:
    graphs: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    return graphs, backend


def _inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, :2] = False
    return torch.randn(B, T, WIDTH, generator=g), mask


def _run(compiled: bool, measured: bool, steps: int = 4) -> tuple[int, dict[int, dict]]:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = _Model()
    graphs, backend = _counting()
    forward = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
    metrics = attention_metrics(model) if measured else None
    if metrics is not None:
        metrics.metrics = [(m, 2) for m, _ in metrics.metrics]  # due at steps 1, 2, 4; idle at 3
    records = {}
    for step in range(1, steps + 1):
        if metrics is None:
            forward(*_inputs(step))
            continue
        with metrics.step(step):
            forward(*_inputs(step))
        records[step] = table(r for r in metrics.last_records if r.step == step)
    if metrics is not None:
        metrics.close()
    return len(graphs), records


def test_observed_attention_compiles_into_one_graph_without_recompiles():
    baseline, _ = _run(True, False)
    torch._dynamo.utils.counters.clear()
    graphs, records = _run(True, True)
    assert graphs == baseline == 1
    assert not torch._dynamo.utils.counters["recompiles"] and not torch._dynamo.utils.counters["graph_break"]
    _, reference = _run(False, True)
    assert [s for s, r in records.items() if r] == [1, 2, 4]
    assert records == reference


def test_hf_sdpa_attention_compiles_without_break():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).eval()
    ids = torch.randint(64, (B, T), generator=torch.Generator().manual_seed(1))
    metrics = attention_metrics(model)
    with metrics.step(1), torch.no_grad():
        model(input_ids=ids)
    reference = table(metrics.last_records)
    metrics.close()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs, backend = _counting()
    metrics = attention_metrics(model)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with metrics.step(1), torch.no_grad():
        compiled(input_ids=ids)
    got = table(metrics.last_records)
    metrics.close()
    assert len(graphs) == 1 and not torch._dynamo.utils.counters["graph_break"]
    assert got.keys() == reference.keys()
    for key, value in reference.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key

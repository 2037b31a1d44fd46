"""Shared pieces of the framework tests: a tiny Llama from a config, token batches, hand norms
(float64) of gradients grouped by layer, and the records read back from a run's jsonl file."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from pathlib import Path
from typing import Iterable

import torch

VOCAB = 64
SEQ = 8
LAYERS = 2
METRICS = ["global-grad-l2:1", "layer-grad-l2:1", "layer-param-l2:1"]
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    """A 2-layer ``LlamaForCausalLM`` (hidden 16, vocab 64), built from a config on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=LAYERS,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)
    return LlamaForCausalLM(config)


def token_rows(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """``n`` examples of ``SEQ`` random tokens, labels equal to the inputs."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(VOCAB, (n, SEQ), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def config(run_dir: Path, metrics: Iterable[str] = METRICS) -> dict:
    return {"run": {"name": "integration", "dir": str(run_dir)}, "metrics": list(metrics), "sinks": {"jsonl": {}}}


def grads64(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient as a float64 copy, by parameter name."""
    return {n: p.grad.detach().to(torch.float64).clone() for n, p in model.named_parameters() if p.grad is not None}


def params64(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().to(torch.float64).clone() for n, p in model.named_parameters()}


def hand_norms(tensors: dict[str, torch.Tensor]) -> tuple[float, dict[int, float]]:
    """The L2 norm of all tensors together and per layer (``layers.{i}.`` in the name)."""
    total = 0.0
    layers: dict[int, float] = {}
    for name, t in tensors.items():
        sq = float(t.square().sum())
        total += sq
        m = _LAYER.search(name)
        if m:
            layers[int(m.group(1))] = layers.get(int(m.group(1)), 0.0) + sq
    return math.sqrt(total), {i: math.sqrt(v) for i, v in layers.items()}


def read_jsonl(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def by_step(lines: list[dict]) -> dict[int, dict[tuple, float]]:
    """``{step: {(metric, layer): value}}``, checking each (metric, labels, step) occurs once."""
    counts = Counter((r["step"], r["metric"], json.dumps(r["labels"], sort_keys=True)) for r in lines)
    repeated = [k for k, c in counts.items() if c > 1]
    assert not repeated, f"records written more than once: {repeated}"
    out: dict[int, dict[tuple, float]] = {}
    for r in lines:
        out.setdefault(r["step"], {})[(r["metric"], r["labels"].get("layer"))] = r["value"]
    return out

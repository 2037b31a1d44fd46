"""A tiny residual language model, its global batch, and the float64 autograd reference of the
cotangent metrics (tests of ``tmetrics_core.sources.cotangents`` on one and several ranks).

The reference runs the whole global batch in one float64 process with the mean cross-entropy
over all its tokens; ``expected`` gives every record the cotangent metrics should write."""
from __future__ import annotations

import functools
import math

import torch
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

V, D, F, L = 16, 8, 12, 3
BATCH, SEQ = 8, 6

METRICS = ("layer-residual-accumulator-l2", "layer-residual-grad-l2", "layer-residual-grad-rms", "layer-residual-grad-absmax",
           "layer-residual-grad-nonfinite", "layer-residual-grad-histogram", "layer-activation-grad-rms",
           "output-logits-grad-l2", "layer-backward-gain")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D, F), torch.nn.Tanh(), torch.nn.Linear(F, D))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(h)


class Net(torch.nn.Module):
    """``ckpt``: activation checkpointing of each block: None, ``"reentrant"`` or
    ``"non-reentrant"`` (torch.utils.checkpoint), ``"wrapper"`` (torch's checkpoint_wrapper, as
    torchtitan applies it), ``"selective"`` (matmul outputs saved, the rest recomputed)."""

    def __init__(self, ckpt: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(V, D)
        self.layers = torch.nn.ModuleList([Block() for _ in range(L)])
        self.head = torch.nn.Linear(D, V, bias=False)
        self.ckpt = ckpt
        if ckpt == "wrapper":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
            self.layers = torch.nn.ModuleList([checkpoint_wrapper(b) for b in self.layers])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.layers:
            if self.ckpt in (None, "wrapper"):
                h = block(h)
            elif self.ckpt == "selective":
                h = checkpoint(block, h, use_reentrant=False, context_fn=functools.partial(
                    create_selective_checkpoint_contexts, [torch.ops.aten.mm.default, torch.ops.aten.addmm.default]))
            else:
                h = checkpoint(block, h, use_reentrant=self.ckpt == "reentrant")
        return self.head(h)


def batch(step: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: tokens and targets ``[BATCH, SEQ]``."""
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, V, (BATCH, SEQ), generator=g), torch.randint(0, V, (BATCH, SEQ), generator=g)


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1))


def expected(step: int = 1) -> dict[tuple[str, int | None, str | None], float]:
    """``(metric, layer, stat or tensor)`` -> value, from float64 autograd over the global batch."""
    model = Net().double()
    tokens, targets = batch(step)
    outs, ins, acts = {}, {}, {}

    def keep(store, i):
        def hook(m, args, out):
            (args[0] if store is ins else out).retain_grad()
            store[i] = args[0] if store is ins else out
        return hook
    for i, block in enumerate(model.layers):
        block.register_forward_hook(keep(outs, i))
        block.register_forward_hook(keep(ins, i))
        block.mlp.register_forward_hook(keep(acts, i))
    logits = model(tokens)
    logits.retain_grad()
    loss_of(logits, targets).backward()
    out: dict[tuple[str, int | None, str | None], float] = {}
    for i in range(L):
        g, gi, ga = outs[i].grad, ins[i].grad, acts[i].grad
        n = g.numel()
        out[("layer-residual-accumulator-l2", i, None)] = outs[i].norm().item()  # the forward's, once
        out[("layer-residual-grad-l2", i, None)] = g.norm().item()
        out[("layer-residual-grad-rms", i, None)] = math.sqrt(g.square().sum().item() / n)
        out[("layer-residual-grad-absmax", i, None)] = g.abs().max().item()
        out[("layer-residual-grad-nonfinite", i, "total")] = 0.0
        out[("layer-activation-grad-rms", i, f"layers.{i}.mlp")] = math.sqrt(ga.square().sum().item() / ga.numel())
        out[("layer-backward-gain", i, None)] = (math.sqrt(gi.square().sum().item() / gi.numel())
                                                 / math.sqrt(g.square().sum().item() / n))
        out[("layer-residual-grad-histogram", i, "count")] = float(n)
    out[("output-logits-grad-l2", None, None)] = logits.grad.norm().item()
    return out


def observed(records) -> dict[tuple[str, int | None, str | None], float]:
    """The same keys from a step's records (a histogram as its element count)."""
    out: dict[tuple[str, int | None, str | None], float] = {}
    for r in records:
        if r.metric == "layer-residual-grad-histogram":
            h = r.value
            out[(r.metric, r.layer, "count")] = float(sum(h.counts) + h.zeros + h.nan + h.posinf + h.neginf)
        elif r.metric == "layer-activation-grad-rms":
            out[(r.metric, r.layer, r.labels.tensor)] = float(r.value)
        elif r.metric == "layer-residual-grad-nonfinite":
            if r.labels.stat == "total":
                out[(r.metric, r.layer, "total")] = float(r.value)
        elif r.metric in METRICS:
            out[(r.metric, r.layer, r.labels.stat)] = float(r.value)
    return out


def assert_close(got: dict, want: dict, rel: float = 1e-5) -> None:
    assert set(got) == set(want), (sorted(set(want) - set(got)), sorted(set(got) - set(want)))
    for key, value in want.items():
        assert math.isclose(got[key], value, rel_tol=rel, abs_tol=1e-12), (key, got[key], value)

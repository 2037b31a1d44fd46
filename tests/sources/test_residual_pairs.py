"""Residual pairs with tuple outputs, blocks called twice, padded micro-batches,
checkpointing, accumulator and contribution metrics due at different intervals; vs float64."""
from __future__ import annotations


import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.observe import observe
from tmetrics_core.tensor_metrics import TensorMetrics

D = 4


class Block(torch.nn.Module):
    def __init__(self, tuple_out):
        super().__init__()
        self.mlp = torch.nn.Linear(D, D)
        self.tuple_out = tuple_out

    def forward(self, h):
        out = h + torch.tanh(self.mlp(h))
        return (out, out.sum()) if self.tuple_out else out


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.layers = torch.nn.ModuleList([Block(i == 1) for i in range(3)])

    def forward(self, x, mask=None, ckpt=False):
        if mask is not None:
            observe(self, "token_mask", mask, kind="token_mask")
        x = self.layers[0](x)
        x = self.layers[0](x)  # called twice
        x = checkpoint(lambda t: self.layers[1](t)[0], x, use_reentrant=False) if ckpt else self.layers[1](x)[0]
        return self.layers[2](x)


def test_pairs_intervals_tuple_twice_padding():
    model = Net()
    tm = TensorMetrics(model, metrics=[(build_metric("layer-residual-accumulator-rms"), 2),
                                       (build_metric("layer-residual-accumulator-l2"), 2),
                                       (build_metric("layer-residual-contribution-l2"), 3),
                                       (build_metric("layer-residual-contribution-rms"), 3)])
    for step in range(1, 10):
        seen_h, seen_c, mask_now = {}, {}, [None]

        def spy_hook(i):
            def hook(m, a, o):
                if torch._C._current_graph_task_id() != -1:
                    return
                o = o[0] if isinstance(o, tuple) else o
                rows = o.detach().double().reshape(-1, D)
                c = (o.detach().double() - a[0].detach().double()).reshape(-1, D)
                if mask_now[0] is not None:
                    rows, c = rows[mask_now[0]], c[mask_now[0]]
                seen_h.setdefault(i, []).append(rows)
                seen_c.setdefault(i, []).append(c)
            return hook
        hooks = [b.register_forward_hook(spy_hook(i)) for i, b in enumerate(model.layers)]
        g = torch.Generator().manual_seed(step)
        with tm.step(step):
            for k in range(3):
                x = torch.randn(2, 3, D, generator=g).requires_grad_(True)
                mask = None
                if step % 4 == 0 and k == 1:
                    mask = torch.rand(2, 3, generator=g) > 0.3
                    mask[0, 0] = False
                if mask is not None:
                    mask_now[0] = mask.reshape(-1)
                y = model(x, mask, ckpt=step % 3 == 1)
                y.sum().backward()
        for h in hooks:
            h.remove()
        assert tm.failures == []
        got = {(r.metric, r.layer): r.value for r in tm.last_records}
        acc_due, con_due = step % 2 == 0 or step == 1, step % 3 == 0 or step == 1
        want = {}
        for i in range(3):
            h, c = torch.cat(seen_h[i]), torch.cat(seen_c[i])
            if acc_due:
                want[("layer-residual-accumulator-rms", i)] = h.pow(2).mean().sqrt().item()
                want[("layer-residual-accumulator-l2", i)] = h.norm().item()
            if con_due:
                want[("layer-residual-contribution-l2", i)] = c.norm().item()
                want[("layer-residual-contribution-rms", i)] = c.pow(2).mean().sqrt().item()
        if not (acc_due or con_due):
            continue
        assert got.keys() == want.keys(), step
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-6), (step, key, got[key], value)

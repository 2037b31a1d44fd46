"""``ParamReads.read`` of updates and of the parameters before the step: exact values, and no
Python frame per tensor on a due step (the Python calls of a read do not grow with the number of
tensors; they were 2 per tensor in the first version of the one path: 412 calls per due step of
the demo bundle, 185 after, main's two paths 152)."""

from __future__ import annotations

import gc
import sys

import torch

from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.sources.snapshot import snapshot
from tmetrics_core.tensor_metrics import TensorMetrics


def _reads(layers: int, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(layers)]).to(dtype)
    metrics = TensorMetrics(model, metrics=[(build_metric("layer-update-ratio"), 1)],
                            optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return model, metrics


def _calls(fn) -> int:
    count = 0

    def profile(frame, event, arg):
        nonlocal count
        count += event == "call"
    # A collection inside the read would run finalizers of earlier tests' objects (Python
    # calls that are not the read's): collect first, and none during the count.
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return count


def _read_calls(layers: int, held: slice) -> tuple[int, int]:
    model, metrics = _reads(layers)
    reads = metrics.params.reads
    names = [e.name for e in reads.manifest.entries]
    before = snapshot(reads.manifest, names[held])
    entries = list(range(len(names)))
    counts = (_calls(lambda: reads.read("update", entries, before)),
              _calls(lambda: reads.read("before", entries, before)))
    metrics.close()
    return counts


def test_update_and_before_reads_make_no_python_call_per_tensor():
    _read_calls(4, slice(None))  # first reads of the process (lazy imports, caches) not counted
    for held in (slice(None), slice(0, None, 2)):  # every parameter copied, or every other one
        assert _read_calls(4, held) == _read_calls(32, held)


def test_updates_and_before_values_with_some_parameters_not_copied():
    """A parameter without a copy reads None (no update, nothing before); the others read their
    exact update (a bfloat16 one widened to float32 first) and their copy."""
    for dtype in (torch.float32, torch.bfloat16):
        model, metrics = _reads(3, dtype)
        reads = metrics.params.reads
        names = [e.name for e in reads.manifest.entries]
        before = snapshot(reads.manifest, names[::2])
        then = {n: p.detach().clone() for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        updates = reads.read("update", range(len(names)), before)
        copies = reads.read("before", range(len(names)), before)
        params = dict(model.named_parameters())
        for k, name in enumerate(names):
            if k % 2:
                assert updates[k] is None and copies[k] is None
                continue
            assert updates[k].dtype == torch.float32
            assert torch.equal(updates[k], params[name].detach().float() - then[name].float())
            assert torch.equal(copies[k], then[name])
        metrics.close()

"""A flat buffer read by the due set's program (one process, a ``dp`` axis of one rank): its
parts of the gradients, with padding between parameters and a parameter it does not hold,
give the numbers of the same gradients read from ``.grad``; a buffer given other memory is
read from there; the views of its parts are made once, not per due step (also the per-parameter
parts of Megatron's distributed optimizer)."""

from __future__ import annotations

import math

import pytest
import torch

from tmetrics_core.integrations.megatron_shards import OwnedRanges
from tmetrics_core.metrics.catalogue import build_metric
from tmetrics_core.sources.flat import FlatBuffer, FlatSource, Memory, _Split, kept
from tmetrics_core.tensor_metrics import TensorMetrics
from tmetrics_core.topology import Axis, Topology

METRICS = ("global-grad-l2", "layer-grad-l2", "layer-grad-absmax")
PAD = 5
"""Elements between two parameters in the buffer (Megatron aligns each start to 64)."""


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(torch.nn.ModuleDict({"up": torch.nn.Linear(4, 3), "down": torch.nn.Linear(3, 4)})
                                       for _ in range(2))
    return model


class _Padded(FlatBuffer):
    """A flat buffer whose parameters start ``PAD`` elements apart (its own layout)."""

    def layout(self, manifest, topology_axes):
        sites, _ = super().layout(manifest, topology_axes)
        spans, cursor = [], 0
        starts = {}
        for p in self.params:
            starts[id(p)] = cursor
            cursor += p.numel() + PAD
        for entry in manifest.entries:
            p = manifest.local.get(entry.name)
            spans.append((starts[id(p)], starts[id(p)] + p.numel()) if id(p) in starts else None)
        return sites, _Split(self.buffer, spans, "the padded test buffer")


def _run(with_buffer: bool, rebind: bool = False) -> tuple[list[dict], list[float]]:
    model = _model()
    params = list(model.parameters())
    held = params[:-1]  # the last bias is not in the buffer: read from .grad
    buffer = torch.full((sum(p.numel() + PAD for p in held),), float("nan"))
    buffers = [_Padded("grad", "dp", held, buffer, 0)] if with_buffer else []
    metrics = TensorMetrics(model, metrics=[(build_metric(n), 1) for n in METRICS],
                            topology=Topology([Axis("dp", 1, 0, None, (0,))], global_rank=0, world_size=1),
                            flat_buffers=buffers)
    records, norms = [], []
    for step in (1, 2, 3):
        with metrics.step(step):
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
            h = x
            for block in model.layers:
                h = block["down"](torch.tanh(block["up"](h)))
            h.pow(2).sum().backward()
            if rebind and step == 3:
                buffer.data = torch.full_like(buffer, float("nan"))  # other memory, as a resharded buffer
            cursor = 0
            for p in held:
                buffer[cursor:cursor + p.numel()] = p.grad.reshape(-1)
                cursor += p.numel() + PAD
            norms.append(math.sqrt(sum(p.grad.double().pow(2).sum().item() for p in params)))
            for p in held if with_buffer else ():
                p.grad = p.grad * 0.5  # the buffer, not .grad, is read
        assert metrics.failures == []
        records.append({(r.metric, r.layer): r.value for r in metrics.last_records})
        model.zero_grad()
    metrics.close()
    return records, norms


@pytest.mark.parametrize("rebind", [False, True], ids=["in-place", "new-memory"])
def test_flat_buffer_parts_equal_the_gradients(rebind: bool) -> None:
    flat, norms = _run(True, rebind)
    plain, _ = _run(False)
    for mine, want in zip(flat, plain):
        assert mine == pytest.approx(want, rel=1e-12)
    assert [r[("global-grad-l2", None)] for r in flat] == pytest.approx(norms, rel=1e-12)


def test_parts_are_viewed_once_while_the_buffer_keeps_its_memory() -> None:
    model = _model()
    params = list(model.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params))
    metrics = TensorMetrics(model, metrics=[(build_metric("global-grad-l2"), 1)],
                            topology=Topology([Axis("dp", 1, 0, None, (0,))], global_rank=0, world_size=1))
    source = FlatSource([FlatBuffer("grad", "dp", params, buffer, 0)], metrics.manifest, ("dp",))
    first, second = source.tensors(), source.tensors()
    assert all(a is b for a, b in zip(first, second))
    assert [t.numel() for t in first] == [metrics.manifest.local[e.name].numel() for e in metrics.manifest.entries]
    buffer.data = torch.arange(buffer.numel(), dtype=buffer.dtype)
    third = source.tensors()
    assert third[0] is not first[0]
    assert sorted(t.data_ptr() for t in third)[0] == buffer.data_ptr()  # views of the new memory
    metrics.close()


def test_owned_ranges_view_each_part_once_while_its_holder_stays() -> None:
    """Megatron's distributed optimizer: each part is a view of its holder (``main_grad`` at
    the rank's start, an Adam state tensor at 0), made again when the holder is another tensor
    (state loaded from a checkpoint) and absent while the holder is None; a rank that owns
    nothing of a parameter reads an empty part."""
    model = _model()
    params = list(model.parameters())
    owner = params[0]
    holders: dict[int, torch.Tensor | None] = {id(p): torch.arange(float(p.numel() + 2)) for p in params}
    holders[id(params[1])] = None  # no value yet
    ranges = {id(p): (1, p.numel() - 1) for p in params if p is not params[2]}  # params[2]: owned elsewhere
    metrics = TensorMetrics(model, metrics=[(build_metric("global-grad-l2"), 1)],
                            topology=Topology([Axis("dp", 1, 0, None, (0,))], global_rank=0, world_size=1))

    def fetch(p):
        holder = holders[id(p)]
        return None if holder is None else (holder, 2)

    source = FlatSource([OwnedRanges("grad", "dp", params, torch.empty(0), 0, ranges=ranges, fetch=fetch)],
                        metrics.manifest, ("dp",))
    index = {id(metrics.manifest.local[e.name]): i for i, e in enumerate(metrics.manifest.entries)}
    first, second = source.tensors(), source.tensors()
    assert second[index[id(owner)]] is first[index[id(owner)]]
    assert torch.equal(first[index[id(owner)]], torch.arange(2.0, owner.numel()))  # [at + 0, at + numel - 2)
    assert first[index[id(params[1])]] is None and first[index[id(params[2])]].numel() == 0
    holders[id(owner)] = torch.full((owner.numel() + 2,), 7.0)
    third = source.tensors()[index[id(owner)]]
    assert torch.equal(third, torch.full((owner.numel() - 2,), 7.0))
    metrics.close()


@pytest.mark.parametrize("case", ["kind", "axis", "foreign", "twice"])
def test_a_flat_buffer_that_does_not_fit_is_refused_when_configured(case: str) -> None:
    """A wrong kind, an axis the topology lacks, a parameter of another model or one listed in
    two buffers of a kind: a ConfigError from the constructor, before any step."""
    from tmetrics_core.errors import ConfigError

    model = _model()
    params = list(model.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params))
    buffers = {
        "kind": [FlatBuffer("grads", "dp", params, buffer, 0)],
        "axis": [FlatBuffer("grad", "fsdp", params, buffer, 0)],
        "foreign": [FlatBuffer("grad", "dp", [torch.nn.Parameter(torch.zeros(3))], torch.zeros(3), 0)],
        "twice": [FlatBuffer("grad", "dp", params, buffer, 0), FlatBuffer("grad", "dp", params[:1], buffer, 0)],
    }[case]
    words = {"kind": "of kind ['grads']", "axis": "'fsdp' is not an axis", "foreign": "not in the model",
             "twice": "in two flat buffers"}[case]
    with pytest.raises(ConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
        TensorMetrics(model, metrics=[(build_metric("global-grad-l2"), 1)], flat_buffers=buffers,
                      topology=Topology([Axis("dp", 1, 0, None, (0,))], global_rank=0, world_size=1))


def test_views_are_kept_only_while_the_memory_is() -> None:
    """``kept``: the same memory keeps the views; new memory, a storage freed in place (FSDP's
    ``resize_(0)``) or the same bytes read as another dtype does not."""
    buffer = torch.arange(8.0, dtype=torch.float16)
    memory = Memory.of(buffer)
    assert kept(memory, buffer)
    buffer.add_(1)  # updated in place: still the same memory
    assert kept(memory, buffer)
    assert not kept(memory, buffer.view(torch.bfloat16))
    moved = torch.arange(8.0, dtype=torch.float16)
    old = buffer.data
    buffer.data = moved
    assert not kept(memory, buffer)
    buffer.data = old
    assert kept(memory, buffer)
    buffer.untyped_storage().resize_(0)
    assert not kept(memory, buffer)


def test_a_resized_buffer_fails_its_metrics_with_what_to_do_and_a_reinterpreted_one_is_read_anew() -> None:
    model = _model()
    params = list(model.parameters())
    buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float16)
    metrics = TensorMetrics(model, metrics=[(build_metric("global-grad-l2"), 1)], flat_buffers=[
        FlatBuffer("grad", "dp", params, buffer, 0)],
        topology=Topology([Axis("dp", 1, 0, None, (0,))], global_rank=0, world_size=1))
    for step, change in ((1, None), (2, "dtype"), (3, "size")):
        with metrics.step(step):
            if change == "dtype":
                buffer.data = buffer.data.view(torch.bfloat16)  # the same bytes, another dtype
            if change == "size":
                buffer.resize_(buffer.numel() - 3)
            values = torch.randn(buffer.numel(), generator=torch.Generator().manual_seed(step))
            buffer.copy_(values)
            want = buffer.double().norm().item()
        if change == "size":
            assert [f.metric for f in metrics.failures] == ["global-grad-l2"]
            assert "has 59 elements, not the 62 it had when TensorMetrics was built" in metrics.failures[0].error
        else:
            assert metrics.failures == []
            assert metrics.last_records[0].value == pytest.approx(want, rel=1e-6)
    metrics.close()


def test_a_rank_owning_nothing_of_a_parameter_reads_an_empty_part_of_any_layout() -> None:
    """Megatron's ranges on a rank that owns none of a (here transposed, not contiguous)
    parameter: an empty part, not a view of the parameter (which would raise)."""
    model = _model()
    params = list(model.parameters())
    weight = params[0]
    weight.data = weight.data.t().contiguous().t()  # same shape and values, not contiguous
    ranges = {id(p): (0, p.numel()) for p in params if p is not weight}
    metrics = TensorMetrics(model, metrics=[(build_metric("global-grad-l2"), 1)],
                            topology=Topology([Axis("dp", 1, 0, None, (0,))], global_rank=0, world_size=1))
    source = FlatSource([OwnedRanges("grad", "dp", params, torch.empty(0), 0, ranges=ranges,
                                     fetch=lambda p: (torch.ones(p.numel()), 0))], metrics.manifest, ("dp",))
    index = {id(metrics.manifest.local[e.name]): i for i, e in enumerate(metrics.manifest.entries)}
    part = source.tensors()[index[id(weight)]]
    assert part.numel() == 0 and part.dtype == weight.dtype
    metrics.close()

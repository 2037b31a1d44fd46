"""Every private torch name of `tmetrics_core.torch_private` exists in the pinned torch and does
what tmetrics relies on; a torch upgrade that moves one fails here, naming it."""

from __future__ import annotations

import torch
import torch.distributed.pipelining.stage as stage

from tmetrics_core import torch_private


def test_in_backward_is_true_only_inside_the_engine() -> None:
    seen: list[bool] = []
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(torch_private.in_backward()) or g)
    assert torch_private.in_backward() is False
    y.sum().backward()
    assert seen == [True]
    assert torch_private.in_backward() is False


def test_foreach_kernels_match_their_per_tensor_forms() -> None:
    a = [torch.tensor([3.0, -4.0]), torch.tensor([1.0, 0.0, -2.0])]
    b = [torch.tensor([1.0, 1.0]), torch.tensor([2.0, 2.0, 2.0])]
    assert [float(t) for t in torch_private.foreach_norm(a)] == [5.0, float(torch.tensor(5.0).sqrt())]
    assert [float(t) for t in torch_private.foreach_norm(a, 0)] == [2.0, 2.0]
    assert [float(t) for t in torch_private.foreach_powsum(a, 2)] == [25.0, 5.0]
    assert [float(t) for t in torch_private.foreach_max(a)] == [3.0, 1.0]
    assert torch.equal(torch_private.foreach_abs(a)[0], a[0].abs())
    assert torch.equal(torch_private.foreach_neg(a)[0], -a[0])
    assert torch.equal(torch_private.foreach_sub(a, b)[1], a[1] - b[1])
    assert torch.equal(torch_private.foreach_mul(a, 2.0)[0], a[0] * 2)
    assert torch.equal(torch_private.foreach_clamp_min(a, 0.0)[0], a[0].clamp_min(0))
    assert torch.equal(torch_private.foreach_clamp_max(a, 0.0)[1], a[1].clamp_max(0))
    c = [t.clone() for t in a]
    torch_private.foreach_add_(c, b)
    torch_private.foreach_sub_(c, b)
    torch_private.foreach_mul_(c, 1.0)
    torch_private.foreach_neg_(c)
    torch_private.foreach_neg_(c)
    assert all(torch.equal(x, y) for x, y in zip(c, a))


def test_effect_registration_exists() -> None:
    assert torch_private.EffectType.ORDERED.name == "ORDERED"
    assert callable(torch_private.register_effectful_op)


def test_pipelining_stage_has_a_shape_inference_method() -> None:
    methods = {name for cls in vars(stage).values() if isinstance(cls, type)
               for name in torch_private.PIPELINE_SHAPE_INFERENCE if name in cls.__dict__}
    assert methods, "torch.distributed.pipelining.stage has none of " + str(torch_private.PIPELINE_SHAPE_INFERENCE)


def test_replicate_with_fsdp_is_importable() -> None:
    assert callable(torch_private.replicate_with_fsdp())


def test_dtensor_internals() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    assert torch_private.strided_shard().__name__ == "_StridedShard"
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
        t = distribute_tensor(torch.arange(4.0), mesh, [Replicate()])
        assert torch.equal(torch_private.held_local(t), torch.arange(4.0))
        assert torch_private.held_local(torch.ones(2)) is None
        spec = torch_private.dtensor_spec(t)
        assert spec.mesh is mesh and tuple(spec.placements) == (Replicate(),)
    finally:
        if created:
            dist.destroy_process_group()


def test_child_modules_lists_a_repeated_child_under_each_key() -> None:
    block = torch.nn.Linear(2, 2)
    stack = torch.nn.Sequential(block, block)
    assert list(torch_private.child_modules(stack).items()) == [("0", block), ("1", block)]
    assert torch_private.version(torch.ones(1).add_(1)) == 1

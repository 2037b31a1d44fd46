"""The Megatron optimizer adapter and the refusals, in one process on Megatron's real classes.

``FP32Optimizer`` is built and stepped for real (its loss-scale tensor made on the CPU by the
test shim). The cases here that need only a few attributes of ``Float16OptimizerWithFloat16Params``
or ``DistributedOptimizer`` make them with ``object.__new__``; both are built and stepped for
real in ``test_megatron_gloo.py`` and ``test_megatron_bf16_gloo.py``.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.optimizer import (  # noqa: E402
    DistributedOptimizer,
    FP32Optimizer,
    Float16OptimizerWithFloat16Params,
    OptimizerConfig,
)

from tests.integrations.megatron import cpu_shims  # noqa: E402
from tmetrics_core.errors import ConfigError  # noqa: E402
from tmetrics_core.integrations import megatron  # noqa: E402
from tmetrics_core.integrations.megatron_shards import owned_ranges  # noqa: E402
from tmetrics_core.topology import Topology  # noqa: E402


def test_fp32_optimizer_hooks_see_main_grad_before_and_the_update_after():
    cpu_shims.cuda_tensors_on_cpu()
    p = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    p.main_grad = torch.tensor([1.0, -2.0])  # where Megatron's DDP leaves the gradient
    optimizer = FP32Optimizer(torch.optim.Adam([p], lr=0.5), OptimizerConfig(lr=0.5, clip_grad=0.0), None)
    steps = megatron.MegatronSteps(optimizer)
    seen = []
    pre = steps.register_step_pre_hook(lambda o, a, k: seen.append(("pre", p.grad, p.detach().clone())))
    steps.register_step_post_hook(lambda o, a, k: seen.append(("post", None, p.detach().clone())))
    assert "betas" in steps.defaults
    assert steps.state.get(p) is None  # no Adam state before the first step
    optimizer.step()
    assert [s[0] for s in seen] == ["pre", "post"]
    assert seen[0][1] is None and torch.equal(seen[0][2], torch.tensor([3.0, 4.0]))  # before Megatron copies main_grad
    assert torch.allclose(seen[1][2], torch.tensor([2.5, 4.5]))  # Adam's first step: lr * sign(grad)
    assert torch.equal(steps.state.get(p)["exp_avg"], 0.1 * p.main_grad)
    pre.remove()
    optimizer.step()
    assert [s[0] for s in seen] == ["pre", "post", "post"]


def test_float16_optimizer_state_is_read_through_the_fp32_main_copy():
    model_param = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.bfloat16))
    main_param = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    main_param.grad = torch.tensor([0.5, 0.5])
    inner = torch.optim.Adam([main_param], lr=0.1)
    inner.step()
    optimizer = object.__new__(Float16OptimizerWithFloat16Params)
    optimizer.optimizer = inner
    optimizer.grad_scaler = None  # bf16: no loss scaling
    optimizer.float16_groups = [[model_param]]
    optimizer.fp32_from_float16_groups = [[main_param]]
    optimizer.step = lambda: None
    steps = megatron.MegatronSteps(optimizer)
    assert steps.state.get(model_param) is inner.state[main_param]


def test_distributed_optimizer_with_overlapped_param_gather_is_refused_clearly():
    from megatron.core.distributed import DistributedDataParallelConfig

    optimizer = object.__new__(DistributedOptimizer)  # only the configs are read before refusing
    optimizer.config = OptimizerConfig(use_distributed_optimizer=True)
    optimizer.ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                                         overlap_param_gather=True)
    with pytest.raises(ConfigError, match="overlap_param_gather"):
        owned_ranges(optimizer, Topology.single_process())


def test_virtual_pipeline_chunks_holding_one_child_twice_are_refused_clearly():
    chunks = [torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Sequential(torch.nn.Linear(2, 2))]
    with pytest.raises(ConfigError, match="two virtual pipeline chunks hold parameters under '0'"):
        megatron.setup(chunks, None, Topology.single_process())


def test_fp16_loss_scaling_is_refused_clearly():
    optimizer = object.__new__(Float16OptimizerWithFloat16Params)
    optimizer.optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])
    optimizer.grad_scaler = object()
    with pytest.raises(ConfigError, match="loss scaling"):
        megatron.MegatronSteps(optimizer)


def test_tensor_metrics_keeps_the_adapter_around_megatrons_whole_step():
    from tmetrics_core.sources.optimizers import unwrap_optimizer

    cpu_shims.cuda_tensors_on_cpu()
    p = torch.nn.Parameter(torch.ones(2))
    steps = megatron.MegatronSteps(FP32Optimizer(torch.optim.Adam([p]), OptimizerConfig(clip_grad=0.0), None))
    assert unwrap_optimizer(steps) is steps

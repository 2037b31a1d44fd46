"""``tmetrics_core.integrations.accelerate.attach`` in an accelerate loop on 2 gloo ranks (DDP):
gradient accumulation 2 and ``clip_grad_norm_`` small enough to clip every step.

References: the total norm ``accelerator.clip_grad_norm_`` returns (pre-clip), and float64
norms of the gradients and parameters copied in the loop right before that call."""

from __future__ import annotations

import pytest

pytest.importorskip("accelerate")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.integrations.tiny import by_step, config, grads64, hand_norms, params64, read_jsonl  # noqa: E402

STEPS = 3
CLIP = 0.05
WORLD = 2


def _loop(rank: int, world_size: int, run_dir: str) -> dict:
    import torch
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from tests.integrations.tiny import tiny_llama, token_rows
    from tmetrics_core.integrations.accelerate import attach

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, log_with="tensorboard",
                              project_dir=f"{run_dir}-accelerate")
    accelerator.init_trackers("mine")  # the loop's own TensorBoard run: tmetrics joins it (issue 35)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(token_rows(4 * STEPS * world_size), batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    attached = attach(accelerator, model, optimizer, config(run_dir))
    seen = []
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                inner = accelerator.unwrap_model(model)
                grads, params = grads64(inner), params64(inner)
                norm = float(accelerator.clip_grad_norm_(model.parameters(), CLIP))
                seen.append((norm, hand_norms(grads), hand_norms(params)[1]))
                accelerator.log({"grad_norm": norm}, step=len(seen))
            optimizer.step()
            optimizer.zero_grad()
    attached.close()
    accelerator.end_training()
    joined = None
    if rank == 0:
        from tests.sinks.readback_tensorboard import read_log

        board = read_log(f"{run_dir}-accelerate/mine")
        joined = {tag: dict(board.scalars(tag)) for tag in ("grad_norm", "tmetrics/global-grad-l2")}
    return {"seen": seen, "lines": read_jsonl(run_dir) if rank == 0 else None,
            "distributed": str(accelerator.distributed_type), "joined": joined}


def test_accelerate_ddp_accumulation_and_clipping(tmp_path):
    ranks = run_distributed(_loop, WORLD, str(tmp_path / "run"), timeout=240)
    assert ranks[0]["distributed"].endswith("MULTI_CPU")
    assert ranks[0]["seen"] == ranks[1]["seen"]  # all-reduced gradients, replicated parameters
    steps = by_step(ranks[0]["lines"])
    assert sorted(steps) == list(range(1, STEPS + 1))
    joined = ranks[0]["joined"]  # one TensorBoard run: the loop's grad_norm beside tmetrics' keys
    assert sorted(joined["grad_norm"]) == sorted(joined["tmetrics/global-grad-l2"]) == list(range(1, STEPS + 1))
    for step, value in joined["grad_norm"].items():
        assert joined["tmetrics/global-grad-l2"][step] == pytest.approx(value, rel=1e-5)
    for step, (norm, (total, layer_grads), layer_params) in zip(range(1, STEPS + 1), ranks[0]["seen"]):
        got = steps[step]
        assert norm > 2 * CLIP  # clipped: post-clip norms would differ
        assert got[("global-grad-l2", None)] == pytest.approx(norm, rel=1e-5)
        assert got[("global-grad-l2", None)] == pytest.approx(total, rel=1e-6)
        for layer in range(2):
            assert got[("layer-grad-l2", layer)] == pytest.approx(layer_grads[layer], rel=1e-6)
            assert got[("layer-param-l2", layer)] == pytest.approx(layer_params[layer], rel=1e-6)
        assert len(got) == 1 + 2 + 2

"""``tmetrics_core.integrations.lightning.TMetricsCallback`` under a real Lightning ``Trainer``:
``strategy="ddp"`` on 2 gloo processes, ``accumulate_grad_batches=2``, gradient clipping.

Reference: float64 copies of the gradients and parameters taken by a second callback in
``on_before_optimizer_step`` (after the closure's backward and DDP's all-reduce, before clipping),
on every rank; the jsonl file written by rank 0 is read back."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.integrations.tiny import by_step, config, grads64, hand_norms, params64, read_jsonl  # noqa: E402

STEPS = 2
CLIP = 0.05
WORLD = 2


def _fit(rank: int, world_size: int, run_dir: str) -> dict:
    import lightning
    import torch
    from torch.utils.data import DataLoader

    from tests.integrations.tiny import tiny_llama, token_rows
    from tmetrics_core.integrations.lightning import TMetricsCallback

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = tiny_llama()

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            loss = self.net(**batch).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    class Reference(lightning.Callback):
        def __init__(self) -> None:
            self.seen: list[tuple[dict, dict]] = []

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.seen.append((grads64(pl_module), params64(pl_module)))

    reference = Reference()
    # The loop's own TensorBoard run: tmetrics writes into it too (issue 35: one run by default).
    logger = lightning.pytorch.loggers.TensorBoardLogger(f"{run_dir}-lightning", name="mine", version=0)
    trainer = lightning.Trainer(accelerator="cpu", devices=world_size, strategy="ddp", max_steps=STEPS,
                                accumulate_grad_batches=2, gradient_clip_val=CLIP, logger=logger, log_every_n_steps=1,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[reference, TMetricsCallback(config(run_dir))])
    loader = DataLoader(token_rows(4 * STEPS * world_size), batch_size=2)
    trainer.fit(Module(), loader)
    norms = [(hand_norms(g), hand_norms(p)[1]) for g, p in reference.seen]
    joined = None
    if rank == 0:
        from tests.sinks.readback_tensorboard import read_log

        board = read_log(logger.log_dir)
        joined = {"tags": sorted(board.scalar_tags), "ours": dict(board.scalars("tmetrics/global-grad-l2"))}
    return {"norms": norms, "lines": read_jsonl(run_dir) if rank == 0 else None, "global_step": trainer.global_step,
            "joined": joined}


def test_lightning_ddp_accumulation_and_clipping(tmp_path):
    ranks = run_distributed(_fit, WORLD, str(tmp_path / "run"), timeout=240)
    assert [r["global_step"] for r in ranks] == [STEPS] * WORLD
    assert ranks[0]["norms"] == ranks[1]["norms"]  # all-reduced gradients, replicated parameters
    steps = by_step(ranks[0]["lines"])
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, ((total, layer_grads), layer_params) in zip(range(1, STEPS + 1), ranks[0]["norms"]):
        got = steps[step]
        assert total > 2 * CLIP  # Lightning clipped: post-clip norms would differ
        assert got[("global-grad-l2", None)] == pytest.approx(total, rel=1e-6)
        for layer in range(2):
            assert got[("layer-grad-l2", layer)] == pytest.approx(layer_grads[layer], rel=1e-6)
            assert got[("layer-param-l2", layer)] == pytest.approx(layer_params[layer], rel=1e-6)
        assert len(got) == 1 + 2 + 2
        assert ranks[0]["joined"]["ours"][step] == pytest.approx(total, rel=1e-6)
    assert "train_loss" in ranks[0]["joined"]["tags"]  # the module's own scalar, in the same TensorBoard run

"""``TMetricsCallback`` under Lightning's manual optimization (``automatic_optimization =
False``): two micro-batches accumulated with ``manual_backward``, ``self.clip_gradients`` before
``opt.step()``. The gradients are read before the user's clipping: ``global-grad-l2`` equals the
float64 norm of the accumulated gradients taken in ``training_step`` right before the clip.
Before, it read the clipped norm (``CLIP`` at every step, 0.0100 where the pre-clip norm was
13.15 in the issue's run)."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from tests.integrations.tiny import by_step, config, grads64, hand_norms, read_jsonl  # noqa: E402

STEPS = 2
CLIP = 0.01
ACCUMULATE = 2


def test_manual_optimization_reads_gradients_before_the_users_clipping(tmp_path):
    import lightning
    import torch
    from torch.utils.data import DataLoader

    from tests.integrations.tiny import tiny_llama, token_rows
    from tmetrics_core.integrations.lightning import TMetricsCallback

    class Module(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            self.net = tiny_llama()
            self.seen: list[tuple[float, dict[int, float]]] = []

        def training_step(self, batch: dict, batch_idx: int) -> None:
            opt = self.optimizers()
            self.manual_backward(self.net(**batch).loss / ACCUMULATE)
            if (batch_idx + 1) % ACCUMULATE == 0:
                self.seen.append(hand_norms(grads64(self)))
                self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
                opt.step()
                opt.zero_grad()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    module = Module()
    run_dir = tmp_path / "run"
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                callbacks=[TMetricsCallback(config(run_dir, ["global-grad-l2:1", "layer-grad-l2:1"]))])
    trainer.fit(module, DataLoader(token_rows(ACCUMULATE * STEPS * 2), batch_size=2))
    steps = by_step(read_jsonl(run_dir))
    assert sorted(steps) == list(range(1, STEPS + 1))
    for step, (total, layers) in zip(range(1, STEPS + 1), module.seen):
        assert total > 100 * CLIP  # the clip changed the gradients: a post-clip read would give CLIP
        assert steps[step][("global-grad-l2", None)] == pytest.approx(total, rel=1e-6)
        for layer in range(2):
            assert steps[step][("layer-grad-l2", layer)] == pytest.approx(layers[layer], rel=1e-6)

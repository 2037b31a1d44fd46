"""``tmetrics_core.integrations.hf.TMetricsCallback`` in a real ``transformers.Trainer`` under DDP:
2 gloo processes (the Trainer takes DDP from the environment the harness sets: RANK, WORLD_SIZE,
an initialized process group), gradient accumulation 2 and a ``max_grad_norm`` small enough to
clip every step.

References: the pre-clip ``grad_norm`` the Trainer logs on each rank, and float64 norms of the
all-reduced gradients copied just before the Trainer clips (its ``accelerator.clip_grad_norm_``
wrapped by the test, not by the product); the jsonl file written by rank 0 is read back."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.distributed.harness import run_distributed  # noqa: E402
from tests.integrations.tiny import by_step, config, grads64, hand_norms, params64, read_jsonl  # noqa: E402

STEPS = 2
MAX_GRAD_NORM = 0.05
WORLD = 2


def _train(rank: int, world_size: int, root: str) -> dict:
    from transformers import Trainer, TrainingArguments

    from tests.integrations.tiny import tiny_llama, token_rows
    from tmetrics_core.integrations.hf import TMetricsCallback

    model = tiny_llama()
    callback = TMetricsCallback(config(f"{root}/run"))
    args = TrainingArguments(f"{root}/out", max_steps=STEPS, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_grad_norm=MAX_GRAD_NORM, learning_rate=1e-2,
                             logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
                             disable_tqdm=True, lr_scheduler_type="constant", ddp_backend="gloo",
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=token_rows(4 * STEPS * world_size), callbacks=[callback])
    seen: list[tuple[dict, dict]] = []
    clip = trainer.accelerator.clip_grad_norm_

    def clip_and_record(parameters, max_norm, *a, **kw):
        seen.append((grads64(model), params64(model)))
        return clip(parameters, max_norm, *a, **kw)

    trainer.accelerator.clip_grad_norm_ = clip_and_record
    trainer.train()
    wrapped = type(trainer.model_wrapped).__name__
    logged = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    norms = [(hand_norms(g), hand_norms(p)[1]) for g, p in seen]
    return {"logged": logged, "norms": norms, "wrapped": wrapped, "world": trainer.args.world_size,
            "lines": read_jsonl(f"{root}/run") if rank == 0 else None}


def test_trainer_ddp_pre_clip_norms_one_record_per_step(tmp_path):
    ranks = run_distributed(_train, WORLD, str(tmp_path), timeout=240)
    assert [(r["world"], r["wrapped"]) for r in ranks] == [(WORLD, "DistributedDataParallel")] * WORLD
    assert ranks[0]["norms"] == ranks[1]["norms"]  # all-reduced gradients, replicated parameters
    steps = by_step(ranks[0]["lines"])
    logged = ranks[0]["logged"]
    assert sorted(steps) == list(range(1, STEPS + 1)) == sorted(logged)
    for step, ((total, layer_grads), layer_params) in zip(range(1, STEPS + 1), ranks[0]["norms"]):
        got = steps[step]
        assert logged[step] > 2 * MAX_GRAD_NORM  # the Trainer clipped: post-clip norms would differ
        assert got[("global-grad-l2", None)] == pytest.approx(logged[step], rel=1e-5)
        assert got[("global-grad-l2", None)] == pytest.approx(total, rel=1e-6)
        for layer in range(2):
            assert got[("layer-grad-l2", layer)] == pytest.approx(layer_grads[layer], rel=1e-6)
            assert got[("layer-param-l2", layer)] == pytest.approx(layer_params[layer], rel=1e-6)
        assert len(got) == 1 + 2 + 2  # one record per metric (and layer) per optimizer step
    lines = ranks[0]["lines"]
    assert len(lines) == STEPS * (1 + 2 + 2)

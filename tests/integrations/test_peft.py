"""PEFT with no configuration: a ``PeftModel`` (LoRA; DoRA and IA3 names) on a tiny Llama, in a
plain loop and under the Hugging Face Trainer. Base weights keep the unwrapped model's canonical
names, adapters are named below the module they adapt (``select: "*.lora_*"`` finds them), the
update ratio reads the trainable tensors only. Values against float64 references."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from peft import IA3Config, LoraConfig, get_peft_model  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from tests.integrations.tiny import (VOCAB, by_step, config, grads64, hand_norms, read_jsonl,  # noqa: E402
                                     tiny_llama, token_rows)
from tmetrics_core.integrations.hf import TMetricsCallback  # noqa: E402
from tmetrics_core.metrics.catalogue import build_metric  # noqa: E402
from tmetrics_core.naming.canonical import canonicalize  # noqa: E402
from tmetrics_core.tensor_metrics import TensorMetrics  # noqa: E402

LORA = dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights="gaussian")


def _lora(**extra) -> torch.nn.Module:
    torch.manual_seed(0)
    return get_peft_model(tiny_llama(), LoraConfig(**LORA, **extra))


@pytest.mark.parametrize("kind", ["lora", "dora", "ia3"])
def test_names(kind):
    model = (_lora(modules_to_save=["lm_head"]) if kind == "lora" else _lora(use_dora=True) if kind == "dora" else
             get_peft_model(tiny_llama(), IA3Config(target_modules=["k_proj", "down_proj"],
                                                    feedforward_modules=["down_proj"])))
    names = {cn.original: cn for cn in canonicalize(model.named_parameters())}
    if kind == "lora":  # the trained copy of a module saved whole, beside its frozen original
        assert names["base_model.model.lm_head.original_module.weight"].name == "head.weight"
        assert names["base_model.model.lm_head.modules_to_save.default.weight"].name == "head.trained_copy.weight"
    prefix = "base_model.model.model.layers.1."
    if kind == "ia3":
        assert names[prefix + "self_attn.k_proj.base_layer.weight"].name == "layers.1.attn.k.weight"
        assert names[prefix + "mlp.down_proj.ia3_l.default"].name == "layers.1.mlp.down.ia3"
        return
    assert names[prefix + "self_attn.q_proj.base_layer.weight"].name == "layers.1.attn.q.weight"
    a = names[prefix + "self_attn.q_proj.lora_A.default.weight"]
    assert (a.name, a.layer, a.component, a.family) == (
        "layers.1.attn.q.lora_A.weight", 1, "attn.q.lora_A", "layers.*.attn.q.lora_A.weight")
    assert names[prefix + "self_attn.v_proj.lora_B.default.weight"].name == "layers.1.attn.v.lora_B.weight"
    if kind == "dora":
        assert names["base_model.model.lm_head.weight"].name == "head.weight"
        magnitude = names[prefix + "self_attn.q_proj.lora_magnitude_vector.default.weight"]
        assert magnitude.name == "layers.1.attn.q.lora_magnitude.weight"


def test_plain_loop_lora_values():
    model = _lora()
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    optimizer = torch.optim.AdamW(trainable.values(), lr=1e-2)
    tm = TensorMetrics(model, optimizer=optimizer, metrics=[
        (build_metric("layer-grad-l2"), 1), (build_metric("layer-update-ratio"), 1),
        (build_metric("tensor-grad-l2", select="*.lora_*"), 1)])
    g = torch.Generator().manual_seed(1)
    for step in (1, 2):
        ids = torch.randint(VOCAB, (2, 6), generator=g)
        with tm.step(step):
            model(input_ids=ids, labels=ids).loss.backward()
            grads = grads64(model)
            before = {n: p.detach().double().clone() for n, p in trainable.items()}
            optimizer.step()
            optimizer.zero_grad()
        got = {(r.metric, r.labels.layer, r.labels.tensor): r.value for r in tm.last_records}
        assert set(grads) == set(trainable)
        _, layer_grads = hand_norms(grads)
        for layer in (0, 1):
            assert got[("layer-grad-l2", layer, None)] == pytest.approx(layer_grads[layer], rel=1e-6)
            mine = [n for n in trainable if f".layers.{layer}." in n]
            delta = math.sqrt(sum((trainable[n].double() - before[n]).square().sum().item() for n in mine))
            norm = math.sqrt(sum(trainable[n].double().square().sum().item() for n in mine))
            assert got[("layer-update-ratio", layer, None)] == pytest.approx(delta / norm, rel=1e-6)
        tensors = {t: v for (m, _, t), v in got.items() if m == "tensor-grad-l2"}
        assert len(tensors) == 8  # 2 layers x (q, v) x (lora_A, lora_B)
        original = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.default.weight"
        assert tensors["layers.1.attn.v.lora_B.weight"] == pytest.approx(grads[original].norm().item(), rel=1e-6)
    tm.close()


def test_trainer_lora(tmp_path):
    model = _lora()
    callback = TMetricsCallback(config(tmp_path / "run", ["global-grad-l2:1", "layer-grad-l2:1",
                                                          "layer-update-ratio:1"]))
    args = TrainingArguments(str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2,
                             logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
                             lr_scheduler_type="constant")
    trainer = Trainer(model=model, args=args, train_dataset=token_rows(4), callbacks=[callback])
    seen: list[dict] = []
    clip = trainer.accelerator.clip_grad_norm_

    def clip_and_record(parameters, max_norm, *a, **kw):
        seen.append(grads64(model))
        return clip(parameters, max_norm, *a, **kw)

    trainer.accelerator.clip_grad_norm_ = clip_and_record
    trainer.train()
    logged = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    steps = by_step(read_jsonl(tmp_path / "run"))
    assert sorted(steps) == [1, 2] and len(seen) == 2
    for step, grads in zip((1, 2), seen):
        assert all(".lora_" in n for n in grads)
        total, layers = hand_norms(grads)
        got = steps[step]
        assert got[("global-grad-l2", None)] == pytest.approx(total, rel=1e-6)
        assert got[("global-grad-l2", None)] == pytest.approx(logged[step], rel=1e-5)
        for layer in (0, 1):
            assert got[("layer-grad-l2", layer)] == pytest.approx(layers[layer], rel=1e-6)
            assert 0 < got[("layer-update-ratio", layer)] < 1


def test_merged_adapter_is_said_once(caplog):
    model = _lora()
    tm = TensorMetrics(model, metrics=[(build_metric("layer-param-l2"), 1)])
    ids = torch.randint(VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    with caplog.at_level("WARNING", logger="tmetrics"):
        for step in (1, 2, 3):
            if step == 2:
                model.merge_adapter()
            with tm.step(step):
                loss = model(input_ids=ids, labels=ids).loss
                if step == 1:  # merged, the adapters are out of the graph: nothing requires a gradient
                    loss.backward()
    said = [r.message for r in caplog.records if "PEFT adapters" in r.message]
    assert len(said) == 1 and "at step 2" in said[0] and "merged into its base weight" in said[0]
    # the merged base weight is what layer-param-l2 reads from step 2 on
    base = [p for n, p in model.named_parameters() if ".layers.0." in n]
    assert {r.labels.layer: r.value for r in tm.last_records}[0] == pytest.approx(
        math.sqrt(sum(p.double().square().sum().item() for p in base)), rel=1e-6)
    tm.close()

"""Models that ``tmetrics names`` can build without weights: the demo model, tiny Hugging Face
models from their config classes, or any zero-argument factory the user names."""

from __future__ import annotations

import importlib
import os
import sys

import torch

from tmetrics_core.errors import ConfigError

__all__ = ["HF_ARCHITECTURES", "load_model"]

HF_ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 32}),
    "gpt2": ("GPT2Config", {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64}),
}
"""Tiny configurations (2 layers, hidden size 32) of the Hugging Face layouts tmetrics knows."""


def load_model(*, hf: str | None = None, factory: str | None = None) -> torch.nn.Module:
    """The demo model (default), a tiny Hugging Face model ``hf``, or ``factory()``.

    Raises ``ConfigError`` for an unknown architecture, a missing ``transformers`` package, or
    a factory that cannot be imported.
    """
    if hf is not None and factory is not None:
        raise ConfigError("pass --hf or --factory, not both")
    if factory is not None:
        module_name, _, attr = factory.partition(":")
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # a script's own module in the working directory, as `python -m` finds it
        try:
            return getattr(importlib.import_module(module_name), attr)()
        except (ImportError, AttributeError, ValueError) as exc:
            raise ConfigError(f"--factory {factory!r}: cannot import {attr!r} from {module_name!r} ({exc}); "
                              "use the form package.module:function") from exc
    if hf is not None:
        if hf not in HF_ARCHITECTURES:
            raise ConfigError(f"--hf {hf!r}: unknown; choose one of {sorted(HF_ARCHITECTURES)}")
        try:
            import transformers
        except ImportError as exc:
            raise ConfigError("--hf needs the transformers package: pip install transformers") from exc
        config_class, extra = HF_ARCHITECTURES[hf]
        base = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                "num_key_value_heads": 2, "vocab_size": 128}
        config = getattr(transformers, config_class)(**(extra if hf == "gpt2" else {**base, **extra}))
        return transformers.AutoModelForCausalLM.from_config(config)
    from tmetrics_core.demo.model import ModelConfig, Transformer

    return Transformer(ModelConfig())

"""PEFT adapters merged or unloaded during the run, said once.

``merge_adapter()`` folds each LoRA product into its base weight in place and leaves the adapter
tensors in the model, unused; ``merge_and_unload()`` and ``unload()`` put the base modules back
in place of the adapter wrappers. Either way the adapter tensors tmetrics found at start-up get
no gradient and no update from then on, and the base weights hold the merged values. Nothing
of that is an error; it changes what the records describe, so the logging rank says it once, at
the first due step that finds it. Modules are recognised by PEFT's own attributes
(``base_layer`` and ``merged_adapters``): PEFT is not imported.
"""

from __future__ import annotations

import logging

import torch

from tmetrics_core import torch_private

from tmetrics_core.naming.canonical import strip_wrappers

__all__ = ["AdapterWatch"]

log = logging.getLogger("tmetrics")


class AdapterWatch:
    """The adapter wrappers of ``model`` found at start-up, with the parent holding each.

    `check` reads one attribute and one dict entry per wrapper: called on due steps only.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._wrappers: list[tuple[str, torch.nn.Module, str, torch.nn.Module]] = []
        for name, module in model.named_modules():
            if name and hasattr(module, "base_layer") and hasattr(module, "merged_adapters"):
                parent, _, key = name.rpartition(".")
                self._wrappers.append((strip_wrappers(name), model.get_submodule(parent), key, module))
        self._said = False

    def check(self, step: int, *, say: bool) -> None:
        """Warn once (when ``say``: the logging rank) if some adapter is merged or unloaded."""
        if self._said or not self._wrappers:
            return
        merged = [name for name, _, _, module in self._wrappers if getattr(module, "merged_adapters", None)]
        gone = [name for name, parent, key, module in self._wrappers
                if torch_private.child_modules(parent).get(key) is not module]
        if not (merged or gone):
            return
        self._said = True
        if say:
            what = "merged into its base weight" if merged else "unloaded from the model"
            log.warning("tmetrics: at step %d, PEFT adapters were %s (%d of %d modules, e.g. %s): from now on "
                        "their tensors (lora_A, lora_B, ...) get no gradient and no update, so their records "
                        "stop, and the base weights hold the merged values. Said once.", step,
                        what if not (merged and gone) else "merged or unloaded", len(set(merged) | set(gone)),
                        len(self._wrappers), (merged or gone)[0])

"""Per-framework naming tables applied by `tmetrics_core.naming.canonical`, in detection order."""

from __future__ import annotations

from tmetrics_core.naming.layouts.canonical import CANONICAL
from tmetrics_core.naming.layouts.hf import HF, HF_GPT2, HF_GPT_OSS, HF_SWITCH
from tmetrics_core.naming.layouts.layout import Layout, Rule, RuleMatch, component_of
from tmetrics_core.naming.layouts.megatron import MEGATRON
from tmetrics_core.naming.layouts.torchtitan import TORCHTITAN

__all__ = [
    "LAYOUTS",
    "Layout",
    "Rule",
    "RuleMatch",
    "component_of",
]

LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (HF, HF_GPT2, HF_GPT_OSS, HF_SWITCH, MEGATRON, TORCHTITAN, CANONICAL)}
"""Every known layout by name; when detection scores tie, the earlier one wins."""


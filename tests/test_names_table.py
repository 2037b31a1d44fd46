"""The manifest printed by `tmetrics names`: aligned table and JSON on a hand-made list."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from tmetrics_core.errors import ConfigError
from tmetrics_core.cli.names_table import MANIFEST_KEYS, format_declared, format_manifest

ROWS: list[dict[str, Any]] = [
    {
        "name": "embed.weight",
        "original": "module.model.embed_tokens.weight",
        "layer": None,
        "expert": None,
        "component": "embed",
        "shape": (64, 32),
        "dtype": torch.bfloat16,
        "numel": 2048,
        "placements": {"fsdp": "S(0)", "dp": "R"},
        "owners": "all",
        "origins": {"fsdp": "dtensor", "dp": "inferred"},
        "verified": {"dp": ["param", "grad"]},
    },
    {
        "name": "layers.11.moe.experts.17.up.weight",
        "original": "model.layers.11.mlp.experts.gate_up_proj",
        "layer": 11,
        "expert": 17,
        "component": "moe.experts.up",
        "shape": [48, 32],
        "dtype": "float32",
        "numel": 1536,
        "placements": {"ep": "O3"},
        "owners": [6, 7, 0, 1, 2, 3],
        "origins": {"ep": "declared"},
        "verified": {},
    },
    {
        "name": "layers.0.attn_norm.scale",
        "original": "h.0.ln.scale",
        "layer": 0,
        "expert": None,
        "component": "attn_norm",
        "shape": (),
        "dtype": "torch.float32",
        "numel": 1,
        "placements": {},
        "owners": [5],
    },  # a manifest written before origins and verification: those keys are absent
]

TABLE = """\
canonical                           original                                  layer  expert  component       shape  dtype     numel  placements      owners   origin
embed.weight                        module.model.embed_tokens.weight              -       -  embed           64x32  bfloat16   2048  fsdp=S(0) dp=R  all      fsdp=S(0):dtensor dp=R:inferred+param,grad
layers.11.moe.experts.17.up.weight  model.layers.11.mlp.experts.gate_up_proj     11      17  moe.experts.up  48x32  float32    1536  ep=O3           0-3,6-7  ep=O3:declared
layers.0.attn_norm.scale            h.0.ln.scale                                  0       -  attn_norm       ()     float32       1  -               5        -"""


def test_table_is_aligned_with_one_line_per_row() -> None:
    assert format_manifest(ROWS) == TABLE
    assert format_manifest(ROWS, fmt="table") == TABLE


def test_empty_manifest_is_the_header() -> None:
    assert format_manifest([]).split() == [
        "canonical", "original", "layer", "expert", "component", "shape", "dtype", "numel", "placements", "owners", "origin"
    ]


def test_json_round_trips_with_plain_values() -> None:
    parsed = json.loads(format_manifest(ROWS, fmt="json"))
    assert [list(row) for row in parsed] == [list(MANIFEST_KEYS)] * 3
    assert parsed[0] == {
        "name": "embed.weight",
        "original": "module.model.embed_tokens.weight",
        "layer": None,
        "expert": None,
        "component": "embed",
        "shape": [64, 32],
        "dtype": "bfloat16",
        "numel": 2048,
        "placements": {"fsdp": "S(0)", "dp": "R"},
        "owners": "all",
        "origins": {"fsdp": "dtensor", "dp": "inferred"},
        "verified": {"dp": ["param", "grad"]},
    }
    assert (parsed[1]["origins"], parsed[2]["origins"], parsed[2]["verified"]) == ({"ep": "declared"}, {}, {})
    assert parsed[1]["owners"] == [6, 7, 0, 1, 2, 3]
    assert (parsed[2]["shape"], parsed[2]["dtype"], parsed[2]["placements"]) == ([], "float32", {})


def test_rows_need_exactly_the_manifest_keys() -> None:
    bad = dict(ROWS[0])
    del bad["owners"]
    bad["rank"] = 0
    with pytest.raises(ConfigError, match=r"missing \['owners'\], unexpected \['rank'\]") as raised:
        format_manifest([ROWS[1], bad])
    assert raised.value.path == "entries[1]"


def test_unknown_format() -> None:
    with pytest.raises(ConfigError, match="valid: 'table', 'json'") as raised:
        format_manifest(ROWS, fmt="yaml")  # type: ignore[arg-type]
    assert raised.value.path == "fmt"


def test_declared_placements_say_which_claims_a_run_verifies() -> None:
    declared = {"layers.*.attn.q.weight": {"tp": "S0"}, "layers.*.attn_norm.weight": {"tp": "R", "dp": "Replica()"}}
    assert format_declared(declared, "first").splitlines() == [
        "glob                       axis  placement  origin    verified in a run",
        "layers.*.attn.q.weight     tp    S0         declared  no (taken as declared)",
        "layers.*.attn_norm.weight  tp    R          declared  yes (verify_replicas: first)",
        "layers.*.attn_norm.weight  dp    Replica()  declared  yes (verify_replicas: first)",
    ]
    assert "no (verify_replicas: never)" in format_declared(declared, "never")
    assert format_declared({}, "always") == ("placements: none declared; every placement comes from a framework, "
                                             "DTensor or inference (Replica claims verified: always)")

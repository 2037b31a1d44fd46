from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from tmetrics_core.config.names import check_names
from tmetrics_core.config.schema import Config, load_config, override_sinks
from tmetrics_core.config.sections import DistributedConfig, MetricConfig, RunConfig, parse_metric_spec
from tmetrics_core.errors import ConfigError
from tmetrics_core.metrics.entry import MODULES, SELECT

# The same configuration in every accepted form.
EXPECTED = Config(
    run=RunConfig(name="demo", dir="runs/demo"),
    metrics=(
        MetricConfig(name="layer-param-l2", interval=100),
        MetricConfig(name="layer-grad-l2", interval=10, select=("layers.*.mlp.*",)),
        MetricConfig(name="layer-activation-rms", interval=10, modules=("layers.*.mlp", "layers.*.attn")),
        MetricConfig(name="layer-grad-histogram", interval=50, bins=64),
        MetricConfig(name="dp-replica-drift", interval=500, sample=1024),
        MetricConfig(name="global-grad-l2"),
    ),
    sinks={
        "tensorboard": {},
        "mlflow": {"tracking_uri": "sqlite:///runs/mlflow.db", "experiment": "demo"},
    },
    placements={"layers.*.attn.q.weight": {"tp": "Shard(0)"}},
    distributed=DistributedConfig(collective_timeout_s=30.0, check_plan="always", log_rank=1),
)

YAML_TEXT = """\
run: {name: demo, dir: runs/demo}
metrics:
  - layer-param-l2:100
  - {name: layer-grad-l2, interval: 10, select: "layers.*.mlp.*"}
  - {name: layer-activation-rms, interval: 10, modules: ["layers.*.mlp", "layers.*.attn"]}
  - {name: layer-grad-histogram, interval: 50, bins: 64}
  - {name: dp-replica-drift, interval: 500, sample: 1024}
  - global-grad-l2
sinks:
  tensorboard:
  mlflow: {tracking_uri: "sqlite:///runs/mlflow.db", experiment: demo}
placements:
  "layers.*.attn.q.weight": {tp: "Shard(0)"}
distributed: {collective_timeout_s: 30, check_plan: always, log_rank: 1}
"""

TOML_TEXT = """\
metrics = [
  "layer-param-l2:100",
  {name = "layer-grad-l2", interval = 10, select = "layers.*.mlp.*"},
  {name = "layer-activation-rms", interval = 10, modules = ["layers.*.mlp", "layers.*.attn"]},
  {name = "layer-grad-histogram", interval = 50, bins = 64},
  {name = "dp-replica-drift", interval = 500, sample = 1024},
  "global-grad-l2",
]

[run]
name = "demo"

[sinks.tensorboard]
[sinks.mlflow]
tracking_uri = "sqlite:///runs/mlflow.db"
experiment = "demo"

[placements."layers.*.attn.q.weight"]
tp = "Shard(0)"

[distributed]
collective_timeout_s = 30.0
check_plan = "always"
log_rank = 1
"""

JSON_TEXT = """\
{
  "run": {"name": "demo"},
  "metrics": [
    "layer-param-l2:100",
    {"name": "layer-grad-l2", "interval": 10, "select": ["layers.*.mlp.*"]},
    {"name": "layer-activation-rms", "interval": 10, "modules": ["layers.*.mlp", "layers.*.attn"]},
    {"name": "layer-grad-histogram", "interval": 50, "bins": 64},
    {"name": "dp-replica-drift", "interval": 500, "sample": 1024},
    {"name": "global-grad-l2"}
  ],
  "sinks": {"tensorboard": {}, "mlflow": {"tracking_uri": "sqlite:///runs/mlflow.db", "experiment": "demo"}},
  "placements": {"layers.*.attn.q.weight": {"tp": "Shard(0)"}},
  "distributed": {"collective_timeout_s": 30, "check_plan": "always", "log_rank": 1}
}
"""


@pytest.mark.parametrize(
    ("filename", "text"),
    [("c.yaml", YAML_TEXT), ("c.YML", YAML_TEXT), ("c.toml", TOML_TEXT), ("c.json", JSON_TEXT)],
)
def test_each_file_format_gives_the_same_config(tmp_path: Path, filename: str, text: str) -> None:
    file = tmp_path / filename
    file.write_text(text, encoding="utf-8")
    assert load_config(file) == EXPECTED
    assert load_config(str(file)) == EXPECTED
    assert list(load_config(file).sinks) == ["tensorboard", "mlflow"]  # order kept


def test_dict_form_and_round_trip_through_to_dict() -> None:
    data = yaml.safe_load(YAML_TEXT)
    config = load_config(data)
    assert config == EXPECTED
    plain = config.to_dict()
    assert plain["metrics"][1] == {
        "name": "layer-grad-l2",
        "interval": 10,
        "select": ["layers.*.mlp.*"],
        "modules": [],
        "bins": None,
        "sample": None,
        "recipe": [],
        "format": None,
        "scale_mode": None,
        "moments": [],
        "optional": False,
    }
    assert plain["run"] == {"name": "demo", "dir": "runs/demo", "read_results": "now", "close_timeout_s": 30.0,
                            "interrupt_timeout_s": 2.0}
    assert plain["distributed"] == {"collective_timeout_s": 30.0, "check_plan": "always", "verify_replicas": "first",
                                   "log_rank": 1}
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain  # plain data only
    assert load_config(plain) == config
    plain["sinks"]["mlflow"]["experiment"] = "changed"
    assert config.sinks["mlflow"]["experiment"] == "demo"  # to_dict is a copy


def test_the_config_copies_its_input() -> None:
    options = {"experiment": "demo"}
    config = load_config({"sinks": {"mlflow": options}})
    options["experiment"] = "changed"
    assert config.sinks == {"mlflow": {"experiment": "demo"}}


def test_defaults() -> None:
    config = load_config({})
    assert config == Config()
    assert config.run == RunConfig(name="tmetrics", dir="runs/tmetrics")
    assert config.metrics == () and config.sinks == {} and config.placements == {}
    assert config.distributed == DistributedConfig(collective_timeout_s=60.0, check_plan="first",
                                                   verify_replicas="first", log_rank=0)
    assert load_config({"run": {"name": "exp7"}}).run.dir == "runs/exp7"
    assert load_config({"run": None, "metrics": None, "sinks": None, "distributed": None}) == Config()


def test_megatron_string_form() -> None:
    config = load_config({"metrics": "global-param-l2:10 layer-grad-l2:100,  layer-param-rms ,global-wgrad-l2:5\n"})
    assert config.metrics == (
        MetricConfig(name="global-param-l2", interval=10),
        MetricConfig(name="layer-grad-l2", interval=100),
        MetricConfig(name="layer-param-rms", interval=1),
        MetricConfig(name="global-wgrad-l2", interval=5),
    )
    with pytest.raises(ConfigError) as err:
        load_config({"metrics": "global-param-l2:10 layer-grad-l2:0"})
    assert err.value.path == "metrics[1].interval"


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("layer-grad-l2", MetricConfig(name="layer-grad-l2", interval=1)),
        ("layer-grad-l2:7", MetricConfig(name="layer-grad-l2", interval=7)),
        ("  layer-grad-l2:7 ", MetricConfig(name="layer-grad-l2", interval=7)),
        (
            {"name": "layer-grad-l2", "select": ["a.*", "b.*"]},
            MetricConfig(name="layer-grad-l2", select=("a.*", "b.*")),
        ),
        ({"name": "x", "select": None, "bins": None}, MetricConfig(name="x")),
    ],
)
def test_parse_metric_spec(spec: Any, expected: MetricConfig) -> None:
    assert parse_metric_spec(spec, path="metrics[0]") == expected


def test_override_sinks_keeps_options_of_configured_sinks() -> None:
    config = load_config({"sinks": {"mlflow": {"experiment": "demo"}, "wandb": {"project": "p"}}})
    chosen = override_sinks(config, "tensorboard, mlflow")
    assert chosen.sinks == {"tensorboard": {}, "mlflow": {"experiment": "demo"}}
    assert list(chosen.sinks) == ["tensorboard", "mlflow"]
    assert override_sinks(config, "jsonl").sinks == {"jsonl": {}}
    assert override_sinks(config, ["tensorboard", "mlflow"]).sinks == chosen.sinks  # a list from Python
    assert config.sinks == {"mlflow": {"experiment": "demo"}, "wandb": {"project": "p"}}  # unchanged
    assert chosen.metrics == config.metrics and chosen.run == config.run


@pytest.mark.parametrize(
    ("names", "fragment"),
    [
        ("", "need sink names, e.g. 'tensorboard,mlflow' or ['tensorboard', 'mlflow']"),
        ([1, 2], "need sink names"),
        ("tensorboard,,mlflow", "need a sink name such as 'tensorboard' (no empty entries)"),
        ("mlflow,mlflow", "sink 'mlflow' is given twice in 'mlflow,mlflow'; list each sink once"),
        ("ml flow", "got 'ml flow' (a string); need a sink name"),
    ],
)
def test_override_sinks_errors(names: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        override_sinks(Config(), names)
    assert err.value.path == "--sink"
    assert fragment in str(err.value)


ALIASES = {"global-wgrad-l2": "global-grad-l2"}
METRICS = ("global-grad-l2", "layer-grad-l2", "layer-grad-rms", "layer-param-l2", "layer-activation-rms")
SINKS = ("console", "jsonl", "mlflow", "tensorboard", "wandb")


def resolve(name: str) -> str:
    canonical = ALIASES.get(name, name)
    if canonical not in METRICS:
        raise KeyError(name)
    return canonical


def checked(data: dict[str, Any]) -> Config:
    return check_names(load_config(data), resolve_metric=resolve, metric_names=METRICS, sink_names=SINKS,
                       metric_options=lambda name: (SELECT, MODULES))


def test_check_names_resolves_aliases() -> None:
    config = checked(
        {"metrics": ["global-wgrad-l2:10", {"name": "layer-grad-l2", "select": "layers.0.*"}], "sinks": {"mlflow": {}}}
    )
    assert config.metrics == (
        MetricConfig(name="global-grad-l2", interval=10),
        MetricConfig(name="layer-grad-l2", select=("layers.0.*",)),
    )


def test_check_names_wants_one_entry_per_metric() -> None:
    # Records are labelled by metric name: two entries of one metric on different tensors would
    # collide (a per-layer record of each), so their patterns go into one list.
    with pytest.raises(ConfigError) as err:
        checked({"metrics": [{"name": "layer-grad-l2", "select": "layers.*.mlp.*"},
                             {"name": "layer-grad-l2", "select": "layers.*.attn.*"}]})
    assert err.value.path == "metrics[1]"
    assert "merge their select/modules patterns into one list" in str(err.value)
    config = checked({"metrics": [{"name": "layer-grad-l2", "select": ["layers.*.mlp.*", "layers.*.attn.*"]}]})
    assert config.metrics[0].select == ("layers.*.mlp.*", "layers.*.attn.*")


# (config, error path, message fragment)
CHECK_NAME_ERRORS = [
    (
        {"metrics": ["layer-grad-l3:10"]},
        "metrics[0].name",
        "unknown metric 'layer-grad-l3' (did you mean 'layer-grad-l2' or ",
    ),
    (
        {"metrics": ["layer-grad-l2", "zzzz"]},
        "metrics[1].name",
        "unknown metric 'zzzz'; `tmetrics metrics` lists all 5 metrics with their formulas",
    ),
    (
        {"metrics": ["global-grad-l2:10", "global-wgrad-l2:100"]},
        "metrics[1]",
        "'global-wgrad-l2' (= global-grad-l2) [interval 100, select all tensors] repeats metrics[0] "
        "'global-grad-l2' [interval 10, select all tensors]: the same metric on the same tensors; "
        "remove one entry",
    ),
    (
        {
            "metrics": [
                {"name": "layer-grad-l2", "select": ["a", "b"]},
                "layer-param-l2",
                {"name": "layer-grad-l2", "select": ["b", "a"], "interval": 3},
            ]
        },
        "metrics[2]",
        "repeats metrics[0] 'layer-grad-l2' [interval 1, select a, b]",
    ),
    (
        {"sinks": {"tensorbord": {}}},
        "sinks.tensorbord",
        "unknown sink 'tensorbord' (did you mean 'tensorboard'?); installed sinks: console, jsonl, mlflow, "
        "tensorboard, wandb; fix the name, or install the package that provides it",
    ),
]


@pytest.mark.parametrize(("data", "path", "fragment"), CHECK_NAME_ERRORS)
def test_check_names_errors(data: dict[str, Any], path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        checked(data)
    assert err.value.path == path
    assert fragment in str(err.value)
    assert str(err.value).startswith(f"{path}: ")


# (config mapping, error path, message fragment): every bad input a user can write in the mapping.
BAD_MAPPINGS = [
    (
        {"runn": {}},
        "runn",
        "unknown key 'runn' (did you mean 'run'?); valid keys: run, metrics, sinks, placements, distributed, alerts",
    ),
    ({"run": {"nmae": "x"}}, "run.nmae", "unknown key 'nmae' (did you mean 'name'?); valid keys: name, dir, read_results"),
    ({"run": "demo"}, "run", "the run section must be a mapping with keys name, dir, read_results, close_timeout_s, interrupt_timeout_s; got 'demo' (a string)"),
    ({"run": {"name": ""}}, "run.name", "got '' (a string); need a non-empty string (the run name)"),
    ({"run": {"name": 7}}, "run.name", "got 7 (an integer); need a non-empty string"),
    ({"run": {"name": "a/b"}}, "run.name", "a run name cannot contain '/' or '\\' or be '.' or '..'"),
    ({"run": {"dir": ["x"]}}, "run.dir", "got a list; need a directory path string"),
    ({"metrics": {"name": "x"}}, "metrics", "got a mapping; need a list of entries ('NAME:INTERVAL' or a mapping)"),
    ({"metrics": 5}, "metrics", "got 5 (an integer); need a list of entries"),
    (
        {"metrics": ["layer-grad-l2:0"]},
        "metrics[0].interval",
        "got 0; need an integer >= 1 (steps between two computations)",
    ),
    ({"metrics": ["a", "b", "layer-grad-l2:-3"]}, "metrics[2].interval", "got -3; need an integer >= 1"),
    (
        {"metrics": ["layer-grad-l2:ten"]},
        "metrics[0]",
        "got 'layer-grad-l2:ten'; write NAME or NAME:INTERVAL with INTERVAL a whole number of steps >= 1, e.g. "
        "'layer-grad-l2:100'",
    ),
    ({"metrics": ["layer-grad-l2:1.5"]}, "metrics[0]", "write NAME or NAME:INTERVAL"),
    ({"metrics": ["layer-grad-l2:"]}, "metrics[0]", "got 'layer-grad-l2:'; write NAME or NAME:INTERVAL"),
    ({"metrics": ["a:1:2"]}, "metrics[0]", "got 'a:1:2'; write NAME or NAME:INTERVAL"),
    ({"metrics": [":10"]}, "metrics[0].name", "got '' (a string); need a metric name such as 'layer-grad-l2'"),
    ({"metrics": [""]}, "metrics[0].name", "got '' (a string); need a metric name"),
    (
        {"metrics": ["layer-grad-l2:1 layer-param-l2:2"]},
        "metrics[0]",
        "one entry holds one metric: put each in its own list entry",
    ),
    (
        {"metrics": [7]},
        "metrics[0]",
        "got 7 (an integer); need 'NAME:INTERVAL' (e.g. 'layer-grad-l2:10') or a mapping with keys name, "
        "interval, select, modules, bins, sample, recipe, format, scale_mode, moments, optional",
    ),
    ({"metrics": [["a"]]}, "metrics[0]", "got a list; need 'NAME:INTERVAL'"),
    ({"metrics": [{"interval": 3}]}, "metrics[0]", "missing key 'name'"),
    (
        {"metrics": [{"name": "x", "options": {"bins": 3}}]},
        "metrics[0].options",
        "unknown key 'options' (did you mean 'optional'?); valid keys: name, interval, select, modules, bins, sample, recipe, format, scale_mode, "
        "moments, optional",
    ),
    (
        {"metrics": [{"name": "x", "intervall": 3}]},
        "metrics[0].intervall",
        "unknown key 'intervall' (did you mean 'interval'?)",
    ),
    (
        {"metrics": [{"name": "x", "interval": 0}]},
        "metrics[0].interval",
        "got 0; need an integer >= 1 (steps between two computations)",
    ),
    (
        {"metrics": ["a", {"name": "x", "interval": "10"}]},
        "metrics[1].interval",
        "got '10' (a string); need an integer >= 1 (steps between two computations); write it without quotes",
    ),
    ({"metrics": [{"name": "x", "interval": 2.5}]}, "metrics[0].interval", "got 2.5 (a number); need an integer >= 1"),
    (
        {"metrics": [{"name": "x", "interval": True}]},
        "metrics[0].interval",
        "got True (a boolean); need an integer >= 1",
    ),
    ({"metrics": [{"name": "x", "interval": None}]}, "metrics[0].interval", "got null; need an integer >= 1"),
    (
        {"metrics": [{"name": "x y"}]},
        "metrics[0].name",
        "got 'x y' (a string); need a metric name such as 'layer-grad-l2' (letters, digits, '-', '_', '.')",
    ),
    ({"metrics": [{"name": 3}]}, "metrics[0].name", "got 3 (an integer); need a metric name"),
    (
        {"metrics": [{"name": "x", "select": 3}]},
        "metrics[0].select",
        "got 3 (an integer); need a glob on canonical tensor names or a list of globs",
    ),
    (
        {"metrics": [{"name": "x", "select": ["a.*", ""]}]},
        "metrics[0].select[1]",
        "got '' (a string); need a non-empty glob on canonical tensor names",
    ),
    (
        {"metrics": [{"name": "x", "modules": {"a": 1}}]},
        "metrics[0].modules",
        "got a mapping; need a glob on canonical module names",
    ),
    (
        {"metrics": [{"name": "x", "bins": 0}]},
        "metrics[0].bins",
        "got 0; need an integer >= 1 (number of histogram bins)",
    ),
    (
        {"metrics": [{"name": "x", "sample": -1}]},
        "metrics[0].sample",
        "got -1; need an integer >= 1 (elements sampled per tensor)",
    ),
    ({"sinks": "tensorboard"}, "sinks", "got 'tensorboard' (a string); need a mapping from sink name to its options"),
    (
        {"sinks": {"mlflow": "sqlite:///x.db"}},
        "sinks.mlflow",
        "got 'sqlite:///x.db' (a string); need a mapping of option names to values, or nothing for the defaults",
    ),
    ({"sinks": {"mlflow": {1: "x"}}}, "sinks.mlflow", "option name 1 (an integer) is not a string; write it in quotes"),
    (
        {"sinks": {"bad name": {}}},
        "sinks['bad name']",
        "got 'bad name' (a string); need a sink name such as 'tensorboard'",
    ),
    ({"sinks": ["tensorboard", "tensorboard"]}, "sinks[1]", "sink 'tensorboard' is listed twice; list each sink once"),
    (
        {"placements": ["x"]},
        "placements",
        "got a list; need a mapping from a glob on canonical tensor names to {axis: placement}",
    ),
    (
        {"placements": {"layers.*.q.weight": "Shard(0)"}},
        "placements['layers.*.q.weight']",
        "got 'Shard(0)' (a string); need a non-empty mapping {axis: placement}",
    ),
    (
        {"placements": {"layers.*.q.weight": {}}},
        "placements['layers.*.q.weight']",
        "got a mapping; need a non-empty mapping {axis: placement}",
    ),
    (
        {"placements": {"layers.*.q.weight": {"t p": "S0"}}},
        "placements['layers.*.q.weight']",
        "axis 't p' (a string) is not an axis name (letters, digits, '_'), e.g. tp, dp, ep",
    ),
    (
        {"placements": {"w": {"tp": "Shard(x)"}}},
        "placements.w.tp",
        "cannot read placement 'Shard(x)'; use one of: 'R' or 'Replica()', 'S0' or 'Shard(0)'",
    ),
    ({"placements": {"w": {"tp": "Chunk(0)"}}}, "placements.w.tp", "cannot read placement 'Chunk(0)'"),
    (
        {"placements": {"w": {"tp": "F[0:8)"}}},
        "placements.w.tp",
        "a FlatShard tag needs the tensor's logical_shape; overrides take 'R', 'S0', 'S*', 'O1', 'P(sum)' or "
        "their long forms ('Shard(0)', ...), not FlatShard (it depends on each tensor's shape)",
    ),
    (
        {"placements": {"w": {"tp": 0}}},
        "placements.w.tp",
        "got 0 (an integer); need a placement string; overrides take 'R'",
    ),
    (
        {"distributed": {"collective_timeout_s": 0}},
        "distributed.collective_timeout_s",
        "got 0; need a number of seconds > 0 (how long one collective may take)",
    ),
    (
        {"distributed": {"collective_timeout_s": float("inf")}},
        "distributed.collective_timeout_s",
        "got inf; need a number of seconds > 0",
    ),
    (
        {"distributed": {"collective_timeout_s": "60s"}},
        "distributed.collective_timeout_s",
        "got '60s' (a string); need a number of seconds > 0",
    ),
    (
        {"distributed": {"check_plan": "frist"}},
        "distributed.check_plan",
        "got 'frist' (a string) (did you mean 'first'?); need one of first, always, never",
    ),
    (
        {"distributed": {"verify_replicas": "start-up"}},
        "distributed.verify_replicas",
        "got 'start-up' (a string) (did you mean 'startup'?); need one of startup, first, always, never",
    ),
    (
        {"run": {"read_results": "next_step"}},
        "run.read_results",
        "got 'next_step' (a string) (did you mean 'next-step'?); need one of now, next-step",
    ),
    (
        {"distributed": {"log_rank": -1}},
        "distributed.log_rank",
        "got -1; need an integer >= 0 (the global rank that writes to the sinks)",
    ),
    (
        {"distributed": {"timeout": 5}},
        "distributed.timeout",
        "unknown key 'timeout'; valid keys: collective_timeout_s, check_plan, verify_replicas, log_rank",
    ),
    ({1: "x"}, "", "key 1 is not a string; valid keys: run, metrics"),
]


@pytest.mark.parametrize(("data", "path", "fragment"), BAD_MAPPINGS, ids=[c[1] or "top" for c in BAD_MAPPINGS])
def test_bad_mapping(data: dict[Any, Any], path: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(data)
    assert err.value.path == path
    assert fragment in str(err.value)
    assert str(err.value).startswith(f"{path}: " if path else fragment[:10])


def test_bad_value_in_a_file_names_the_file(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    file.write_text("metrics:\n  - layer-grad-l2:0\n")
    with pytest.raises(ConfigError) as err:
        load_config(file)
    assert err.value.path == "metrics[0].interval"
    assert str(err.value) == (
        f"metrics[0].interval: got 0; need an integer >= 1 (steps between two computations) (in {file})"
    )


# (file name, bytes, message fragment after "<file>: ")
BAD_FILES = [
    ("c.yaml", b"metrics: [a, b\nsinks: {}\n", "line 2, column 6: malformed YAML: expected ',' or ']', but got ':'"),
    (
        "c.yaml",
        b"run:\n  name: x\n    dir: y\n",
        "line 3, column 8: malformed YAML: mapping values are not allowed here",
    ),
    (
        "c.yaml",
        b"run: {name: a}\nrun: {name: b}\n",
        "line 2, column 1: malformed YAML: duplicate key 'run' (first at line 1); keep one",
    ),
    ("c.yaml", b"sinks:\n  mlflow: {}\n  mlflow: {}\n", "line 3, column 3: malformed YAML: duplicate key 'mlflow'"),
    (
        "c.yaml",
        b"run: !!python/object/apply:os.system ['touch pwned']\n",
        "line 1, column 6: malformed YAML: tag 'tag:yaml.org,2002:python/object/apply:os.system' is not "
        "allowed: a tmetrics config holds plain data only and no code runs from it",
    ),
    ("c.yaml", b"run: !custom {name: x}\n", "line 1, column 6: malformed YAML: tag '!custom' is not allowed"),
    ("c.yaml", b"", "the config is empty; need a mapping with keys run, metrics, sinks, placements, distributed, alerts"),
    (
        "c.yaml",
        b"- layer-grad-l2\n",
        "the config must be a mapping with keys run, metrics, sinks, placements, distributed, alerts; got a list",
    ),
    ("c.yaml", b"run: {name: \xff}\n", "line 1: the file is not UTF-8 text (byte 0xff); save it as UTF-8"),
    ("c.toml", b"[run]\nname = demo\n", "line 2, column 8: malformed TOML: Invalid value"),
    ("c.toml", b"[run]\nname = 'a'\nname = 'b'\n", "line 3, column 11: malformed TOML:"),
    (
        "c.json",
        b'{"run": {"name": "x",}}',
        "line 1, column 22: malformed JSON: Expecting property name enclosed in double quotes",
    ),
    ("c.json", b'{"run": {}, "run": {}}', "malformed JSON: duplicate key 'run' in one object; keep one"),
    ("c.ini", b"[run]\n", "unknown config file type '.ini'; valid suffixes: .yaml, .yml, .toml, .json"),
    ("config", b"run: {}\n", "unknown config file type '(no suffix)'"),
]


@pytest.mark.parametrize(("name", "content", "fragment"), BAD_FILES)
def test_bad_file(tmp_path: Path, name: str, content: bytes, fragment: str) -> None:
    file = tmp_path / name
    file.write_bytes(content)
    with pytest.raises(ConfigError) as err:
        load_config(file)
    assert err.value.path == str(file)
    assert str(err.value).startswith(f"{file}: {fragment}")


def test_yaml_tags_run_no_code(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    file = tmp_path / "c.yaml"
    file.write_text(f"run: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError):
        load_config(file)
    assert not marker.exists()


def test_yaml_merge_keys_may_override(tmp_path: Path) -> None:
    file = tmp_path / "c.yaml"
    text = "metrics:\n  - &b {name: layer-grad-l2, interval: 5}\n  - {<<: *b, interval: 7, select: 'a.*'}\n"
    file.write_text(text)
    assert load_config(file).metrics == (
        MetricConfig(name="layer-grad-l2", interval=5),
        MetricConfig(name="layer-grad-l2", interval=7, select=("a.*",)),
    )


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_unreadable_file(tmp_path: Path, kind: str) -> None:
    file = tmp_path / "nope.yaml"
    if kind == "directory":
        file.mkdir()
    with pytest.raises(ConfigError) as err:
        load_config(file)
    assert err.value.path == str(file)
    reason = "No such file or directory" if kind == "missing" else "Is a directory"
    assert str(err.value) == (
        f"{file}: cannot read the config file ({reason}); check that the path exists, is a file and "
        f"is readable by this process"
    )


PERMISSION_CHECK = textwrap.dedent("""
    import sys
    from tmetrics_core.config.schema import load_config
    from tmetrics_core.errors import ConfigError
    try:
        load_config(sys.argv[1])
    except ConfigError as err:
        print(err.path)
        print(err)
    """)


def test_file_without_read_permission(tmp_path: Path) -> None:
    file = tmp_path / "secret.yaml"
    file.write_text("run: {name: x}\n")
    file.chmod(0o000)
    command = [sys.executable, "-c", PERMISSION_CHECK, str(file)]
    if os.geteuid() == 0:  # root reads any file: run the check without the capabilities that allow it
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without util-linux setpriv: cannot drop CAP_DAC_OVERRIDE")
        command = [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-all", "--", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    path, message = done.stdout.splitlines()
    assert path == str(file)
    assert message == (
        f"{file}: cannot read the config file (Permission denied); check that the path exists, is a file "
        f"and is readable by this process"
    )


def test_load_config_rejects_other_sources() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(42)  # type: ignore[arg-type]
    assert str(err.value) == "got 42 (an integer); need a path to a .yaml/.yml/.toml/.json file or a mapping"


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError) as err:
        MetricConfig(name="layer-grad-l2", interval=0)
    assert err.value.path == "interval"
    with pytest.raises(ConfigError) as err:
        Config(metrics=("layer-grad-l2:10",))  # type: ignore[arg-type]
    assert err.value.path == "metrics"
    assert "build entries with parse_metric_spec or use load_config" in str(err.value)
    assert MetricConfig(name="x", select="a.*").select == ("a.*",)
    assert RunConfig(name="x", dir=Path("out/x")).dir == "out/x"


def test_sinks_as_a_list_of_names() -> None:
    assert load_config({"sinks": ["tensorboard", "jsonl"]}).sinks == {"tensorboard": {}, "jsonl": {}}


def test_config_pickles_for_spawned_ranks() -> None:
    assert pickle.loads(pickle.dumps(EXPECTED)) == EXPECTED


def test_braces_in_globs_list_alternatives_and_bad_braces_are_refused_with_the_place() -> None:
    metric = load_config({"metrics": [{"name": "layer-grad-l2", "select": ["layers.*.{mlp,moe}.*", "embed.*"],
                                       "optional": True}]}).metrics[0]
    assert metric.select == ("layers.*.mlp.*", "layers.*.moe.*", "embed.*")
    assert metric.optional is True
    for bad, why in (("l.{mlp}", "two or more alternatives"), ("l.{a,b", "never closed"), ("l.a}", "no '{'")):
        with pytest.raises(ConfigError, match=re.escape(why)) as caught:
            load_config({"metrics": [{"name": "layer-grad-l2", "select": ["x.*", bad]}]})
        assert caught.value.path == "metrics[0].select[1]"
    with pytest.raises(ConfigError, match="true or false"):
        load_config({"metrics": [{"name": "layer-grad-l2", "optional": "yes"}]})

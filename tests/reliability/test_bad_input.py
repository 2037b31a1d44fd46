"""Bad input fails at start-up, through the public entry points, with a message that says what is
wrong and how to fix it (issue 8, item 1).

One table: each case goes in through ``TensorMetrics.from_config`` (a dict or a file),
``load_config`` or the ``tmetrics validate`` command, and must raise ``ConfigError`` with the
expected ``path`` and a message containing the expected fragment. The ~70 cases of
``tests/test_config.py`` check the parser itself; these check that the same mistakes, and the
ones that need a model, an optimizer, installed sinks or a topology, reach the user intact.

A case that goes through ``from_config`` must also fail before anything starts: no optimizer
hook, no SIGTERM handler, no sink or spool thread, no file in the run directory.
"""

from __future__ import annotations

import importlib.util
import logging
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner

from tmetrics_core.cli.main import main
from tmetrics_core.config.schema import load_config
from tmetrics_core.demo.model import ModelConfig, Transformer
from tmetrics_core.errors import ConfigError
from tmetrics_core.tensor_metrics import TensorMetrics

pytestmark = pytest.mark.timeout(120)

TINY: dict[str, Any] = {"d_model": 16, "n_layers": 2, "n_heads": 2, "d_ff": 12, "n_experts": 4, "top_k": 2,
                        "seq_len": 16}
DENSE: dict[str, Any] = {**TINY, "n_experts": 1, "top_k": 1, "dense_layers": (0, 1)}


@dataclass(frozen=True)
class Case:
    """One bad input. ``entry``: ``dict`` (``from_config`` of ``source``), ``file``
    (``from_config`` of a file holding ``source``), ``load`` (``load_config`` of that file) or
    ``cli`` (``tmetrics validate`` of that file). ``suffix`` names the file's format. ``{file}``
    in ``path`` and ``fragment`` stands for the file's path."""

    id: str
    entry: str
    source: Any
    path: str
    fragment: str
    suffix: str = ".yaml"
    model: str = "moe"
    optimizer: str = "adamw"
    dp_axis: bool = False
    hidden_module: str | None = None
    sinks: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


CASES = [
    # -- names -------------------------------------------------------------------------------
    Case("unknown-metric", "dict", {"metrics": ["layer-grad-l3:10"]}, "metrics[0].name",
         "unknown metric 'layer-grad-l3' (did you mean 'layer-grad-l2'"),
    Case("unknown-metric-cli", "cli", "metrics:\n  - global-param-l2\n  - layer-gard-rms:5\n", "metrics[1].name",
         "unknown metric 'layer-gard-rms' (did you mean 'layer-grad-rms'"),
    Case("unknown-megatron-alias", "file", "metrics: 'global-wgrad-l3:10'\n", "metrics[0].name",
         "unknown metric 'global-wgrad-l3' (did you mean 'global-wgrad-l2'"),
    # -- intervals -----------------------------------------------------------------------------
    Case("zero-interval", "dict", {"metrics": ["layer-grad-l2:0"]}, "metrics[0].interval",
         "got 0; need an integer >= 1 (steps between two computations)"),
    Case("negative-interval", "dict", {"metrics": [{"name": "layer-grad-l2", "interval": -5}]},
         "metrics[0].interval", "got -5; need an integer >= 1"),
    Case("negative-interval-spec", "cli", "metrics: 'global-grad-l2:-10 layer-grad-l2:10'\n", "metrics[0].interval",
         "got -10; need an integer >= 1 (steps between two computations) (in {file})"),
    Case("quoted-interval-in-file", "file", "metrics:\n  - {name: layer-grad-l2, interval: '10'}\n",
         "metrics[0].interval", "got '10' (a string); need an integer >= 1 (steps between two computations); "
         "write it without quotes (in {file})"),
    Case("fractional-interval-toml", "load", '[[metrics]]\nname = "layer-grad-l2"\ninterval = 2.5\n',
         "metrics[0].interval", "got 2.5 (a number); need an integer >= 1", suffix=".toml"),
    # -- duplicates ----------------------------------------------------------------------------
    Case("duplicate-metric", "dict", {"metrics": ["layer-grad-l2:10", "layer-grad-l2:100"]}, "metrics[1]",
         "'layer-grad-l2' [interval 100, select all tensors] repeats metrics[0] 'layer-grad-l2' [interval 10, "
         "select all tensors]: the same metric on the same tensors; remove one entry"),
    Case("duplicate-through-alias", "cli", "metrics: [global-grad-l2, 'global-wgrad-l2:5']\n", "metrics[1]",
         "'global-wgrad-l2' (= global-grad-l2) [interval 5, select all tensors] repeats metrics[0]"),
    # -- sinks ---------------------------------------------------------------------------------
    Case("unknown-sink", "dict", {"sinks": {"tensorbord": {}}}, "sinks.tensorbord",
         "unknown sink 'tensorbord' (did you mean 'tensorboard'?); installed sinks: console, jsonl, mlflow, "
         "tensorboard, wandb"),
    Case("unknown-sink-flag", "dict", {"metrics": ["global-grad-l2"]}, "sinks.mlfow",
         "unknown sink 'mlfow' (did you mean 'mlflow'?)", sinks="jsonl,mlfow"),
    Case("missing-backend-mlflow", "dict", {"sinks": {"jsonl": {}, "mlflow": {}}}, "sinks.mlflow",
         "sink 'mlflow' needs the Python package 'mlflow', which is not installed; install it with: "
         'pip install "tmetrics[mlflow]"', hidden_module="mlflow"),
    Case("missing-backend-wandb-cli", "cli", "sinks: {wandb: {project: demo}}\n", "sinks.wandb",
         'sink \'wandb\' needs the Python package \'wandb\', which is not installed; install it with: '
         'pip install "tmetrics[wandb]"', hidden_module="wandb"),
    Case("unknown-sink-option", "dict", {"sinks": {"tensorboard": {"logdir": "tb"}}}, "sinks.tensorboard.logdir",
         "unknown option 'logdir'; valid options are log_dir, flush_secs"),
    Case("wandb-bad-mode", "file", "sinks:\n  wandb: {mode: onlin}\n", "sinks.wandb.mode",
         "got 'onlin'; valid modes are online, offline, disabled"),
    # -- MLflow URIs ---------------------------------------------------------------------------
    Case("mlflow-uri-plain-path", "dict", {"sinks": {"mlflow": {"tracking_uri": "mlruns"}}},
         "sinks.mlflow.tracking_uri", "got 'mlruns' (a path or file: URI is MLflow's deprecated file store; use "
         "sqlite:///PATH/mlflow.db)"),
    Case("mlflow-uri-two-slashes", "cli", "sinks:\n  mlflow: {tracking_uri: 'sqlite://runs/mlflow.db'}\n",
         "sinks.mlflow.tracking_uri", "a SQLite URI needs a file path after three slashes"),
    Case("mlflow-uri-no-host", "dict", {"sinks": {"mlflow": {"tracking_uri": "http://:5000"}}},
         "sinks.mlflow.tracking_uri", "got 'http://:5000'; an HTTP tracking URI needs a host"),
    Case("mlflow-uri-unknown-scheme", "cli", '{"sinks": {"mlflow": {"tracking_uri": "ftp://host/x"}}}',
         "sinks.mlflow.tracking_uri", "got 'ftp://host/x'; accepted forms: sqlite:///PATH/mlflow.db", suffix=".json"),
    # -- files ---------------------------------------------------------------------------------
    Case("malformed-yaml", "file", "metrics:\n  - layer-grad-l2\n sinks: {}\n", "{file}",
         "line 3, column 2: malformed YAML:"),
    Case("malformed-toml-cli", "cli", "[run]\nname = demo\n", "{file}",
         "line 2, column 8: malformed TOML: Invalid value",
         suffix=".toml"),
    Case("malformed-json", "file", '{"metrics": ["layer-grad-l2",]}', "{file}",
         "line 1, column 30: malformed JSON: Expecting value", suffix=".json"),
    Case("yaml-python-tag", "file", "run: !!python/object/apply:os.system ['touch {dir}/pwned']\n", "{file}",
         "line 1, column 6: malformed YAML: tag 'tag:yaml.org,2002:python/object/apply:os.system' is not allowed: "
         "a tmetrics config holds plain data only and no code runs from it"),
    Case("yaml-python-name-cli", "cli", "sinks: !!python/name:os.system\n", "{file}",
         "tag 'tag:yaml.org,2002:python/name:os.system' is not allowed"),
    Case("missing-file-cli", "cli", None, "{file}", "cannot read the config file (No such file or directory)"),
    # -- unknown keys --------------------------------------------------------------------------
    Case("unknown-top-key", "dict", {"metric": ["layer-grad-l2"]}, "metric",
         "unknown key 'metric' (did you mean 'metrics'?); valid keys: run, metrics, sinks, placements, distributed, alerts"),
    Case("unknown-metric-key", "file", "metrics:\n  - {name: layer-grad-l2, intervall: 10}\n",
         "metrics[0].intervall", "unknown key 'intervall' (did you mean 'interval'?)"),
    Case("unknown-run-key-toml-cli", "cli", '[run]\nnmae = "x"\n', "run.nmae",
         "unknown key 'nmae' (did you mean 'name'?); valid keys: name, dir", suffix=".toml"),
    Case("unknown-distributed-key", "dict", {"distributed": {"collective_timeout": 5}},
         "distributed.collective_timeout", "(did you mean 'collective_timeout_s'?)"),
    Case("zero-collective-timeout", "dict", {"distributed": {"collective_timeout_s": 0}},
         "distributed.collective_timeout_s", "got 0; need a number of seconds > 0"),
    # -- against the model and optimizer -------------------------------------------------------
    Case("select-matches-nothing", "dict", {"metrics": [{"name": "layer-grad-l2", "select": "layers.*.mlpp.*"}]},
         "metrics[0]", "metric 'layer-grad-l2': select ['layers.*.mlpp.*'] matches no tensor. select: globs take "
         "canonical tensor names (see `tmetrics names`), e.g. ['embed.weight', 'final_norm.weight', 'head.weight']; "
         "nearest: 'layers.*.moe.*'"),
    Case("modules-match-nothing", "file", "metrics:\n  - {name: layer-activation-rms, modules: 'layers.*.ffn'}\n",
         "metrics[0]", "metric 'layer-activation-rms': modules ['layers.*.ffn'] match no module. modules: globs take "
         "canonical module names"),
    Case("router-metric-dense-model", "dict", {"metrics": ["global-grad-l2", "layer-router-logits-l2:10"]},
         "metrics[1]", "metric 'layer-router-logits-l2' needs MoE router outputs, but the model has no router "
         "parameter (canonical component moe.router); drop it for a dense model", model="dense"),
    Case("expert-metric-dense-model", "dict", {"metrics": ["layer-expert-tokens"]}, "metrics[0]",
         "metric 'layer-expert-tokens' needs MoE router outputs", model="dense"),
    Case("adam-state-with-sgd", "dict", {"metrics": ["layer-optimizer-state-rms:100"]}, "metrics[0]",
         "metric 'layer-optimizer-state-rms' reads the optimizer's first moment (exp_avg), but SGD has momentum 0 in "
         "some parameter group: it keeps no first moment; drop the metric", optimizer="sgd"),
    Case("update-ratio-without-optimizer", "dict", {"metrics": ["layer-update-ratio"]}, "metrics[0]",
         "metric 'layer-update-ratio' measures optimizer updates; pass optimizer=", optimizer="none"),
    Case("row-metric-on-vectors", "dict",
         {"metrics": [{"name": "global-param-mean-row-l2", "select": "layers.*_norm.weight"}]}, "metrics[0]",
         "metric 'global-param-mean-row-l2' can use none of the 4 tensors its select ['layers.*_norm.weight'] "
         "matches, e.g. layers.0.attn_norm.weight [param] (16,) replicated; it supports: "),
    Case("drift-on-sharded-tensors", "dict", {"metrics": ["dp-replica-drift"], "placements": {"*": {"dp": "S0"}}},
         "metrics[0]", "metric 'dp-replica-drift' can use none of the 41 tensors the model has, e.g. embed.weight "
         "[param] (256, 16) dp=S0; it supports: sites Replica on dp", dp_axis=True),
    Case("placement-dim-out-of-range", "dict",
         {"metrics": ["layer-grad-l2"], "placements": {"layers.*.attn.q.weight": {"dp": "Shard(2)"}}},
         "placements.layers.*.attn.q.weight.dp", "S2 on tensor 'layers.0.attn.q.weight' of shape (16, 16): a 2-dim "
         "tensor has dims 0..1", dp_axis=True),
    Case("placement-owner-out-of-range", "dict",
         {"metrics": ["layer-grad-l2"], "placements": {"layers.1.*": {"dp": "O3"}}},
         "placements.layers.1.*.dp", "axis 'dp' has 1 rank(s), 0..0; fix the rank or the glob", dp_axis=True),
    Case("placement-axis-not-in-topology", "dict",
         {"metrics": ["layer-grad-l2"], "placements": {"head.*": {"tp": "S0"}}},
         "placements.head.*", "axis 'tp' is not in the topology ['dp']", dp_axis=True),
    Case("placement-glob-matching-nothing", "dict",
         {"metrics": ["layer-grad-l2"], "placements": {"layers.*.attn.q.wieght": {"dp": "S0"}}},
         "placements.layers.*.attn.q.wieght", "'layers.*.attn.q.wieght' matches no tensor of the model on any rank; "
         "placements: globs take canonical names (see `tmetrics names`); nearest: 'layers.*.attn.q.weight'",
         dp_axis=True),
    Case("key-collision-after-rendering", "dict", {"metrics": ["tensor-grad-l2"], "sinks": {"tensorboard": {}}},
         "sinks.tensorboard", "2 key collision(s) for tensorboard:\n  two label sets render to the same tensorboard "
         "key 'tensor-grad-l2/blocks.w_1.bias': {metric='tensor-grad-l2', tensor='blocks.w+1.bias'} and "
         "{metric='tensor-grad-l2', tensor='blocks.w_1.bias'}; characters outside [-/\\w.] become '_', so rename one "
         "of the tensors",
         model="clash"),
    Case("key-collision-jsonl", "dict", {"metrics": ["tensor-param-l2"], "sinks": ["jsonl"]},
         "sinks.jsonl", "render to the same plain key 'tensor-param-l2/blocks.w_1.weight'", model="clash"),
]


class _Clash(torch.nn.Module):
    """Two module names that differ only in a character trackers rewrite (``+`` -> ``_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleDict({"w+1": torch.nn.Linear(3, 3), "w_1": torch.nn.Linear(3, 3)})


def _model(kind: str) -> torch.nn.Module:
    if kind == "clash":
        return _Clash()
    return Transformer(ModelConfig(**(TINY if kind == "moe" else DENSE)), seed=0)


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer | None:
    if kind == "none":
        return None
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.fixture
def dp_axis() -> Iterator[Any]:
    """A one-rank gloo group, so a config can name the axis ``dp``."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _hide(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    """Make ``module`` look uninstalled to the sinks' ``requires`` check."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any, **kwargs: Any) -> Any:
        return None if name.split(".")[0] == module else real(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def _tmetrics_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("tmetrics")}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_at_start_up_with_a_clear_message(case: Case, tmp_path: Path, request: pytest.FixtureRequest,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    file = tmp_path / f"config{case.suffix}"
    if case.entry != "dict" and case.source is not None:
        file.write_text(case.source.replace("{dir}", str(tmp_path)))
    path = case.path.replace("{file}", str(file))
    fragment = case.fragment.replace("{file}", str(file))
    if case.hidden_module:
        _hide(monkeypatch, case.hidden_module)

    if case.entry == "cli":
        result = CliRunner().invoke(main, ["validate", str(file)])
        assert result.exit_code == 2, result.output
        assert f"tmetrics: error: {path}: " in result.output and fragment in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit)
        return
    if case.entry == "load":
        with pytest.raises(ConfigError) as info:
            load_config(file)
        assert info.value.path == path and fragment in str(info.value), str(info.value)
        return

    model = _model(case.model)
    optimizer = _optimizer(case.optimizer, model)
    axes = {"dp": request.getfixturevalue("dp_axis")} if case.dp_axis else None
    sigterm = signal.getsignal(signal.SIGTERM)
    threads = _tmetrics_threads()
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        TensorMetrics.from_config(case.source if case.entry == "dict" else file, model=model, optimizer=optimizer,
                                  axes=axes, sinks=case.sinks, run_dir=run_dir, **case.kwargs)
    assert info.value.path == path, str(info.value)
    assert fragment in str(info.value), str(info.value)
    assert str(info.value).startswith(f"{path}: ")
    # Nothing started: no hooks, no handler, no threads, no files, no code run from the file.
    if optimizer is not None:
        assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert signal.getsignal(signal.SIGTERM) is sigterm
    assert _tmetrics_threads() == threads
    assert not run_dir.exists()
    assert not (tmp_path / "pwned").exists()


def test_the_table_covers_every_entry_point_and_enough_cases() -> None:
    assert len(CASES) >= 30
    assert {c.entry for c in CASES} == {"dict", "file", "load", "cli"}
    assert len({c.id for c in CASES}) == len(CASES)


def test_wandb_without_credentials_logs_offline_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    for variable in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    model = _model("moe")
    caplog.set_level(logging.WARNING, logger="tmetrics")
    metrics = TensorMetrics.from_config({"metrics": ["global-grad-l2"], "sinks": {"wandb": {"project": "t"}}},
                                        model=model, run_dir=tmp_path / "run")
    model(torch.randint(0, 256, (2, 9))[:, :-1]).sum().backward()
    with metrics.step(1):
        metrics.observe_gradients()
    report = metrics.close()
    assert report["wandb"].written == 1 and report["wandb"].opened and report["wandb"].closed
    warnings = [r.getMessage() for r in caplog.records if r.name == "tmetrics.wandb"]
    base = tmp_path / "run" / "wandb"
    assert warnings == [
        (f"W&B: no API key found (WANDB_API_KEY or a netrc entry for the W&B host), so this run is logged offline "
         f"under {base}; upload it later with `wandb sync {base / 'offline-run-*'}`, or run `wandb login` (or set "
         f"mode: offline to silence this)")
    ]
    assert len(list(base.glob("offline-run-*/run-*.wandb"))) == 1

"""Entry-point discovery on real installed metadata: a fake distribution on sys.path."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from tmetrics_core.sinks.console import ConsoleSink
from tmetrics_core.errors import ConfigError, SinkError
from tmetrics_core.sinks.jsonl import JsonlSink
from tmetrics_core.sinks.registry import MetricSink, available_sinks, build_sinks, load_sink_class

pytestmark = pytest.mark.timeout(60)

_SINK_BODY = """
from tmetrics_core.errors import ConfigError
from tmetrics_core.sinks.keys import PLAIN_RULES

class {cls}:
    name = {name!r}
    key_rules = PLAIN_RULES
    requires = {requires!r}

    def __init__(self, *, level: int = 1) -> None:
        if level < 0:
            raise ConfigError(f"got {{level}}; need >= 0", path="sinks.{name}.level")
        self.level = level

    def open(self, run): pass
    def log_config(self, config): pass
    def write(self, records, step): pass
    def flush(self): pass
    def close(self, status): pass
"""

_MODULES = {
    "fake_tm_good": _SINK_BODY.format(cls="GoodSink", name="fake_good", requires=()),
    "fake_tm_requires": _SINK_BODY.format(cls="RequiresSink", name="fake_requires", requires=("notinstalled_backend",)),
    "fake_tm_needs": "import notinstalled_backend\n",
    "fake_tm_broken": (
        "import pathlib\n"
        "pathlib.Path(__file__).with_suffix('.imported').write_text('yes')\n"
        "raise RuntimeError('plugin bug at import time')\n"
    ),
    "fake_tm_bad": "class NotASink:\n    name = 'other'\n    def open(self, run): pass\n    write = 3\n",
}

_ENTRY_POINTS = {
    "fake_good": "fake_tm_good:GoodSink",
    "fake_requires": "fake_tm_requires:RequiresSink",
    "fake_needs": "fake_tm_needs:Sink",
    "fake_broken": "fake_tm_broken:Sink",
    "fake_bad": "fake_tm_bad:NotASink",
    "fake_nowhere": "fake_tm_nowhere:Sink",
}


def _install(site: Path, dist: str, entry_points: dict[str, str]) -> None:
    info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        textwrap.dedent(
            f"""\
            Metadata-Version: 2.1
            Name: {dist}
            Version: 1.0
            Provides-Extra: nb
            Provides-Extra: other
            Requires-Dist: notinstalled-backend>=1; extra == "nb"
            Requires-Dist: something-else; extra == "other"
            """
        )
    )
    lines = "".join(f"{name} = {value}\n" for name, value in entry_points.items())
    (info / "entry_points.txt").write_text("[tmetrics.sinks]\n" + lines)


@pytest.fixture
def plugin_site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    for module, source in _MODULES.items():
        (site / f"{module}.py").write_text(source)
    _install(site, "fake-tm-plugin", _ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(site))
    yield site
    for module in _MODULES:
        sys.modules.pop(module, None)


def test_listing_reads_metadata_and_imports_nothing(plugin_site):
    listed = available_sinks()
    assert ("fake_broken", "fake-tm-plugin") in listed and ("jsonl", "tmetrics") in listed
    assert listed == sorted(listed)
    load_sink_class("fake_good")
    build_sinks({"jsonl": {}, "fake_good": {}})
    assert not (plugin_site / "fake_tm_broken.imported").exists()  # a broken plugin stays unimported
    assert not {"fake_tm_needs", "fake_tm_bad", "fake_tm_requires"} & set(sys.modules)


def test_builtin_sinks_load_and_satisfy_the_protocol():
    assert load_sink_class("jsonl") is JsonlSink and load_sink_class("console") is ConsoleSink
    assert isinstance(JsonlSink(), MetricSink) and isinstance(ConsoleSink(), MetricSink)


def test_unknown_name_lists_valid_names_and_close_matches(plugin_site):
    with pytest.raises(ConfigError) as caught:
        load_sink_class("fake_gdo")
    message = str(caught.value)
    assert caught.value.path == "sinks.fake_gdo"
    assert "did you mean 'fake_good'" in message and "console, " in message and "tmetrics.sinks" in message


def test_broken_plugin_named_explicitly_raises_with_name_distribution_and_cause(plugin_site):
    with pytest.raises(SinkError) as caught:
        load_sink_class("fake_broken")
    assert caught.value.sink == "fake_broken"
    assert "'fake-tm-plugin'" in str(caught.value) and "plugin bug at import time" in str(caught.value)
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_entry_point_to_a_missing_module_of_its_own_is_a_broken_plugin(plugin_site):
    with pytest.raises(SinkError) as caught:
        load_sink_class("fake_nowhere")
    assert isinstance(caught.value.__cause__, ModuleNotFoundError)


@pytest.mark.parametrize("name", ["fake_needs", "fake_requires"], ids=["import-at-load", "declared-requires"])
def test_missing_backend_names_the_extra_to_install(plugin_site, name):
    with pytest.raises(ConfigError) as caught:
        load_sink_class(name)
    message = str(caught.value)
    assert "'notinstalled_backend'" in message and 'pip install "fake-tm-plugin[nb]"' in message
    assert caught.value.path == f"sinks.{name}"


def test_class_problems_are_listed_at_once(plugin_site):
    with pytest.raises(SinkError) as caught:
        load_sink_class("fake_bad")
    message = str(caught.value)
    for problem in (
        "missing 'key_rules'",
        "missing 'requires'",
        "missing 'flush'",
        "'write' is not callable",
        "name='other'",
    ):
        assert problem in message


def test_a_name_registered_twice_names_both_distributions(plugin_site):
    _install(plugin_site, "second-plugin", {"fake_good": "fake_tm_good:GoodSink"})
    with pytest.raises(ConfigError, match="fake-tm-plugin.*second-plugin|second-plugin.*fake-tm-plugin"):
        load_sink_class("fake_good")


def test_build_sinks_constructs_each_with_its_options(plugin_site, tmp_path):
    sinks = build_sinks({"fake_good": {"level": 3}, "console": {"every": 5}, "jsonl": None})
    assert [s.name for s in sinks] == ["fake_good", "console", "jsonl"]
    assert sinks[0].level == 3 and sinks[1].every == 5


def test_build_sinks_reports_every_option_problem_at_once(plugin_site):
    with pytest.raises(ConfigError) as caught:
        build_sinks({"fake_good": {"colour": "red"}})
    assert caught.value.path == "sinks.fake_good" and "valid options: level" in str(caught.value)
    with pytest.raises(ConfigError, match="sinks.fake_good.level: got -1"):
        build_sinks({"fake_good": {"level": -1}})
    with pytest.raises(ConfigError) as caught:
        build_sinks({"nope": {}, "console": {"every": 0}, "jsonl": [1]})
    message = str(caught.value)
    assert caught.value.path == "sinks" and message.startswith("sinks: 3 problems")
    assert "unknown sink 'nope'" in message and "sinks.console.every" in message and "must be a mapping" in message

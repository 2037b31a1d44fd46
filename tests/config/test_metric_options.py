"""A metric entry's own options: read flat from the entry, kept apart from the fields, written
back flat, and checked against the options the metric declares."""

from __future__ import annotations

from typing import Any

import pytest

from tmetrics_core.config.metric_options import MetricOption, check_metric_options
from tmetrics_core.config.schema import load_config
from tmetrics_core.errors import ConfigError

WINDOW = MetricOption("window", "int", 8, "steps averaged")
SCALE = MetricOption("scale", "float", None, "a factor")
TAGS = MetricOption("tags", "strings", None, "labels")
SHOW = MetricOption("show", "bool", False, "whether to show")


def test_own_options_sit_apart_from_the_fields_and_round_trip_flat() -> None:
    config = load_config({"metrics": [{"name": "x", "window": 3, "bins": 4, "interval": 2}]})
    metric = config.metrics[0]
    assert metric.options == {"window": 3} and metric.bins == 4
    assert metric.option_values() == {"bins": 4, "window": 3}
    assert config.to_dict()["metrics"][0]["window"] == 3 and "options" not in config.to_dict()["metrics"][0]
    assert load_config(config.to_dict()) == config


@pytest.mark.parametrize(("entry", "path", "fragment"), [
    ({"name": "x", "selct": "a.*"}, "metrics[0].selct", "unknown key 'selct' (did you mean 'select'?)"),
    ({"name": "x", "my-opt": 1}, "metrics[0].my-opt", "option name 'my-opt' (a string) is not a plain key"),
])
def test_misspelt_fields_and_odd_option_names_are_refused_when_read(entry: dict[str, Any], path: str,
                                                                   fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config({"metrics": [entry]})
    assert err.value.path == path and fragment in str(err.value)


def test_values_are_checked_against_the_declared_types() -> None:
    declared = (WINDOW, SCALE, TAGS, SHOW)
    got = check_metric_options("m", declared, {"window": 3, "scale": 2, "tags": "a", "show": True}, path="metrics[1]")
    assert got == {"window": 3, "scale": 2.0, "tags": ("a",), "show": True}
    assert isinstance(got["scale"], float)
    for given, fragment in [({"window": True}, "got True (a boolean); need an integer (steps averaged)"),
                            ({"window": "3"}, "need an integer (steps averaged); write it without quotes"),
                            ({"scale": float("nan")}, "need a number (a factor)"),
                            ({"tags": ["a", 1]}, "need a string or a list of strings (labels)"),
                            ({"show": "yes"}, "need true or false (whether to show)")]:
        with pytest.raises(ConfigError) as err:
            check_metric_options("m", declared, given, path="metrics[1]")
        assert err.value.path == f"metrics[1].{next(iter(given))}" and fragment in str(err.value)
    with pytest.raises(ConfigError) as err:
        check_metric_options("m", declared, {"windw": 3}, path="metrics[1]")
    assert str(err.value).startswith("metrics[1].windw: metric 'm' takes no 'windw' option (did you mean 'window'?) "
                                     "(it takes: scale, show, tags, window)")


def test_a_declaration_with_an_unknown_type_is_refused() -> None:
    with pytest.raises(ConfigError, match="declares type 'list'"):
        MetricOption("x", "list", None, "m")  # type: ignore[arg-type]

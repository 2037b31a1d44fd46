"""Values in text (console, alerts, compare tables): counts in full (issue 35: 1.638e+04)."""

from __future__ import annotations

import math

from tmetrics_core.records import show_value


def test_whole_numbers_print_in_full_and_others_to_significant_digits():
    assert [show_value(v) for v in (16384.0, 0.0, -3.0, 2.0**40)] == ["16384", "0", "-3", "1099511627776"]
    assert [show_value(v) for v in (0.012345, 1234.5, math.nan, math.inf, 1e20)] == [
        "0.01235", "1234", "nan", "inf", "1e+20"]
    assert show_value(1 / 3, 6) == "0.333333"

"""Sinks: the MetricSink protocol and entry-point registry, key rendering, and the two sinks
that ship in core (JSONL file, console)."""

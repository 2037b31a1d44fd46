"""Delivery on the logging rank: the SinkHub, one worker per sink, the spool of what a sink
could not take, its replay, and the end-of-run report."""

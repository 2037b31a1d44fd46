"""Rows of tensors (:mod:`tmetrics_core.kernels.rows`): one batched pass that every elementwise statistic reads."""

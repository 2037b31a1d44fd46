"""Megatron-Core on CPU with gloo: the integration checked against one-process training."""

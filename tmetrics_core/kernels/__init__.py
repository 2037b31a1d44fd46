"""The optional fused CPU kernel (moments of many tensors in one pass) and its ctypes binding."""

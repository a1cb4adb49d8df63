"""Numba CPU kernels: one module per op (imported lazily by fastpe's dispatcher)."""

"""Pallas kernels (TPU Mosaic, GPU) with pure-XLA fallbacks; imports nothing from `mstar_jax`."""

"""Modules the benchmark scripts share (not scripts themselves): the growing-workers study."""

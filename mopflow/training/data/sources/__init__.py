"""Data sources: generated datasets, arrays, image folders and tensor columns."""

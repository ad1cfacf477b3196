"""Where training runs: devices and the Dask cluster."""

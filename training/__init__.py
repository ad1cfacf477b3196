"""mopflow training: data sharding on Dask, models, Lightning modules, the Optuna search."""

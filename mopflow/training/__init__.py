"""mopflow training: data sharding on Dask, models, Lightning modules, the Optuna search."""

# The repository's top-level `training/` is a link to this folder, for people reading the layout. Imported
# through it (the repository root on sys.path) this module would load a second time under another
# name, with its own classes and registries: refuse that.
if __name__ != "mopflow.training":
    raise ImportError(f"import mopflow.training, not {__name__} (the repository root is on sys.path)")

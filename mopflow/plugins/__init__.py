"""mopflow's Airflow plugin (the Sweeps page, the trigger guard), registered through the
``airflow.plugins`` entry point: any Airflow with mopflow installed loads it."""

# The repository's top-level `plugins/` is a link to this folder, for people reading the layout. Imported
# through it (the repository root on sys.path) this module would load a second time under another
# name, with its own classes and registries: refuse that.
if __name__ != "mopflow.plugins":
    raise ImportError(f"import mopflow.plugins, not {__name__} (the repository root is on sys.path)")

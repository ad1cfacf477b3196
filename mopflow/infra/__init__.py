"""mopflow's face: the ``mopflow`` command, the local stack and the deployment files."""

# The repository's top-level `infra/` is a link to this folder, for people reading the layout. Imported
# through it (the repository root on sys.path) this module would load a second time under another
# name, with its own classes and registries: refuse that.
if __name__ != "mopflow.infra":
    raise ImportError(f"import mopflow.infra, not {__name__} (the repository root is on sys.path)")

"""mopflow compression: top-k ensembles, distillation into a student, registration and promotion."""

# The repository's top-level `compression/` is a link to this folder, for people reading the layout. Imported
# through it (the repository root on sys.path) this module would load a second time under another
# name, with its own classes and registries: refuse that.
if __name__ != "mopflow.compression":
    raise ImportError(f"import mopflow.compression, not {__name__} (the repository root is on sys.path)")

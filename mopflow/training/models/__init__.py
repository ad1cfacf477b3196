"""Model families (the plugin registry, DataSpec), the built-in families, bundles, metrics."""

"""mopflow ground floor: settings, storage and tracking clients, and the operator's CLI."""

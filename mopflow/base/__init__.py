"""mopflow's ground floor: settings, storage, tracking, Optuna storage, stopping, progress."""

"""The Optuna search: spaces, samplers and pruners, rungs, the study, the controller, sweeps."""

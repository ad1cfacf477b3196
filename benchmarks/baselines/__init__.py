"""The baselines the benchmarks measure mopflow's strategies against, which the search does not
use: the sequential executor and model averaging."""

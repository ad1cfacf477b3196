"""The stage tests run stages one after another in this process, as ``mopflow run`` does: within
a test the stages share one LocalCluster (``shared_local_clusters``), closed when the test ends."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mopflow.training.compute.cluster import shared_local_clusters


@pytest.fixture(autouse=True)
def one_local_cluster_per_test() -> Iterator[None]:
    with shared_local_clusters():
        yield

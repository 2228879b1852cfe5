"""Session fixtures shared by several test modules."""

import pytest


@pytest.fixture(scope="session")
def netns():
    """A three-host test cluster of network namespaces (``tests/cluster/netns_cluster.py``), started
    once per session and torn down at its end (failing the session if anything is left);
    skipped, with the reason, where this process cannot build one (not root, no
    CAP_NET_ADMIN, 198.18.0.0/15 in use)."""
    import netns_cluster

    reason = netns_cluster.unavailable()
    if reason is not None:
        pytest.skip(reason)
    cluster = netns_cluster.NetnsCluster(hosts=3, slots=2).start()
    try:
        yield cluster
    finally:
        cluster.stop()

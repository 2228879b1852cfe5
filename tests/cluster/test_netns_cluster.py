"""The namespace test cluster itself (``netns_cluster.py``): hosts apart, nothing routed out,
nothing left after a stop, a SIGTERM, or a SIGKILL of its creator; the user wrapper."""

import ipaddress
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import netns_cluster

pytestmark = pytest.mark.mpi
WRAPPER = [sys.executable, str(Path(__file__).with_name("netns_cluster.py"))]


def test_hosts_are_apart_and_closed(netns):
    names = [netns.run(h, ["hostname"]).stdout.strip() for h in netns.names]
    assert names == ["h1", "h2", "h3"]
    hosts = netns.run("h2", ["cat", "/etc/hosts"]).stdout
    assert "198.18.0.1 h1" in hosts and "198.18.0.3 h3" in hosts
    assert Path("/etc/hosts").read_text() != hosts  # the machine's own file is untouched
    for h in netns.names:
        addrs = json.loads(netns.run(h, ["ip", "-j", "addr"]).stdout)
        inet = [a["local"] for link in addrs for a in link["addr_info"] if a["family"] == "inet"]
        assert all(ipaddress.ip_address(a) in netns_cluster.SUBNET or a == "127.0.0.1" for a in inet), inet
        routes = netns.run(h, ["ip", "route"]).stdout.strip().splitlines()
        assert routes == [f"{netns_cluster.SUBNET} dev eth0 proto kernel scope link src {netns.hosts[h].addr}"], routes
    # each host has its own /tmp (holding only a checkout or environment that lies under the
    # machine's /tmp, bound in at its path); the machine's namespace holds none of the cluster's links
    netns.run("h1", ["touch", "/tmp/ringmpi-probe"])
    assert not Path("/tmp/ringmpi-probe").exists()
    kept = sorted({p.relative_to("/tmp").parts[0] for p in netns_cluster._paths_under_tmp()})
    assert netns.run("h2", ["ls", "/tmp"]).stdout.split() == kept
    for p in netns_cluster._paths_under_tmp():
        assert netns.run("h2", ["test", "-d", str(p)]).returncode == 0, p
    here = json.loads(subprocess.run(["ip", "-j", "link"], capture_output=True, text=True).stdout)
    assert not [l["ifname"] for l in here if l["ifname"] in ("br0", "h1", "h2", "h3")]
    assert not netns_cluster.range_in_use()


def test_stop_leaves_nothing():
    cluster = netns_cluster.NetnsCluster(hosts=2).start()
    try:
        # a process that ignores SIGTERM, in the background on h2
        cluster.run("h2", ["sh", "-c", "trap '' TERM; sleep 1000 </dev/null >/dev/null 2>&1 & echo started"])
        assert len(cluster.processes()) >= 3  # two holders and the sleep
    finally:
        cluster.stop()
    assert cluster.leftovers() == []
    assert not [n for n in netns_cluster._our_namespaces(os.getpid()) if n.startswith(cluster.tag + "-")]


def _wrapper_namespaces(pid):
    return [n for n in netns_cluster._our_namespaces() if n.split("-")[1] == str(pid)]


def _wait_for(predicate, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_wrapper_leaves_nothing_when_stopped(netns, how):
    """SIGTERM: the wrapper tears down itself; SIGKILL: the next cluster's start removes it."""
    with tempfile.TemporaryDirectory(dir="/var/tmp") as cwd:
        proc = subprocess.Popen(WRAPPER + ["--hosts", "2", "--", "sleep", "1000"], cwd=cwd, env=dict(os.environ),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert _wait_for(lambda: len(_wrapper_namespaces(proc.pid)) == 3 and
                             "running on h1" in (proc.stderr.readline() if proc.poll() is None else "x"))
            proc.send_signal(getattr(signal, how))
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        if how == "SIGKILL":
            assert _wrapper_namespaces(proc.pid)  # nobody tore it down ...
            netns_cluster.remove_stale()          # ... until a cluster starts (start() calls this)
        assert _wrapper_namespaces(proc.pid) == []
        assert not [p for p in Path("/etc/netns").glob(f"{netns_cluster.PREFIX}{proc.pid}-*")] \
            if Path("/etc/netns").exists() else True


def test_wrapper_runs_mpirun_across_hosts():
    with tempfile.TemporaryDirectory(dir="/var/tmp") as cwd:
        proc = subprocess.run(WRAPPER + ["--hosts", "2", "--", "mpirun", "-n", "4", "--map-by", "node", "hostname"],
                              cwd=cwd, capture_output=True, text=True, timeout=120, env=dict(os.environ))
        assert proc.returncode == 0, proc.stderr
        assert sorted(proc.stdout.split()) == ["h1", "h1", "h2", "h2"], proc.stdout
        refused = subprocess.run(WRAPPER + ["--", "true"], cwd="/tmp", capture_output=True, text=True, timeout=60,
                                 env=dict(os.environ))
        assert refused.returncode == 2 and "outside /tmp" in refused.stderr

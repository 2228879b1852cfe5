"""Across hosts for real: ranks on the hosts of the namespace cluster, over TCP.

The ``netns`` fixture (``conftest.py``, ``netns_cluster.py``) gives three hosts,
each a network namespace with its own hostname, joined by veth links to a
bridge; ``mpirun`` runs on h1 and reaches the others through a remote-shell
agent.  MPI sees separate nodes (processor names, ``COMM_TYPE_SHARED``) with
no ``RINGMPI_NODE_SIZE``.  Skipped, with the reason, where the cluster
cannot be built (not root, no CAP_NET_ADMIN).
"""

import json
import re
import sys
from pathlib import Path

import pytest

from cli_util import RINGMPI
from mpi_util import case_results, launch_cache

pytestmark = pytest.mark.mpi

LAYOUTS = ("contiguous", "zigzag", "striped")
# (P, hosts): P = 4 on 2 hosts and P = 6 on 3 hosts, two ranks per host
SHAPES = ((4, 2), (6, 3))
PLACEMENTS = ("slot", "node")  # block: h1 h1 h2 h2; cyclic (--map-by node): h1 h2 h1 h2


def cases_for(p, hosts, map_by):
    cases = [dict(id="nodes", kind="nodes")]
    if map_by == "slot":
        for i, layout in enumerate(LAYOUTS):
            for causal in (False, True):
                cases.append(dict(id=f"{layout}-{'causal' if causal else 'full'}", B=1, H=4, Hkv=2, D=16,
                                  n_q=301 + i, layout=layout, causal=causal, backward=True, seed=10 * p + i))
        # head_parallel auto by predicted cost: on the measured links either U (one on every rank);
        # on a fast link inside a host and a slow one between, groups of the host's two ranks
        cases.append(dict(id="auto", kind="head_parallel", U="auto", expect_U=[1, 2], B=1, H=4, Hkv=2, D=16,
                          n_q=203, layout="zigzag", causal=True, backward=True, seed=5))
        cases.append(dict(id="auto-links", kind="head_parallel", U="auto", B=1, H=4, Hkv=2, D=16, n_q=203,
                          layout="zigzag", causal=True, backward=True, seed=5,
                          links=[[1e-6, 1e10], [1e-3, 1e7]], chosen=["head x ring, U=2"]))
    # the byte count: one larger case, placed both ways
    cases.append(dict(id="traffic", B=1, H=2, Hkv=2, D=32, n_q=2053, layout="zigzag", causal=True,
                      backward=True, seed=3))
    return cases


@pytest.fixture(scope="module")
def launch(netns):
    def run(key):
        p, hosts, map_by = key
        path = netns.shared / f"multinode-{p}-{map_by}.json"
        cases = cases_for(p, hosts, map_by)
        path.write_text(json.dumps(cases))
        rc, out, err, _ = netns.mpirun(p, [sys.executable, Path(__file__).with_name("multinode_cases.py"), path],
                                       timeout=300, hosts=hosts, map_by=map_by)
        return case_results(cases, rc, out, err)
    return launch_cache(run)


def numbers(msg):
    return {k: v for k, v in re.findall(r"(\w+)=(\S+)", msg)}


@pytest.mark.parametrize("p,hosts", SHAPES)
def test_ranks_see_their_hosts_as_nodes(launch, p, hosts):
    ok, msg = launch((p, hosts, "slot"))["nodes"]
    seen = json.loads(msg)
    assert ok and not seen["node_size_set"], msg
    assert seen["names"] == [f"h{1 + r // 2}" for r in range(p)], msg
    assert seen["shared_sizes"] == [2] * p, msg


@pytest.mark.parametrize("p,hosts", SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", ("full", "causal"))
def test_ring_across_hosts(launch, p, hosts, layout, causal):
    ok, msg = launch((p, hosts, "slot"))[f"{layout}-{causal}"]
    assert ok, msg
    got = numbers(msg)
    # K/V forward and backward, dK/dV: what the ring sent across hosts went through the links
    assert int(got["ring"]) > 0 and int(got["link"]) >= int(got["ring"]), msg
    assert got["bitwise"] == "True", msg


@pytest.mark.parametrize("p,hosts", SHAPES)
def test_head_parallel_auto_chooses_by_predicted_cost_across_hosts(launch, p, hosts):
    """On the measured links auto takes one U on every rank; with a slow link between the hosts
    the model takes the groups of each host's ranks (the cost model's choice, stamped in the stats)."""
    ok, msg = launch((p, hosts, "slot"))["auto"]
    assert ok and re.search(r"stats report U=[12]\b", msg), msg
    ok, msg = launch((p, hosts, "slot"))["auto-links"]
    assert ok, msg


@pytest.mark.parametrize("p,hosts", SHAPES)
def test_ring_order_keeps_one_crossing_per_host(launch, p, hosts):
    """Block and cyclic placement send the same bytes over the host links: the ring goes
    node by node, so per step only one hop per host crosses (cyclic in rank order: every hop)."""
    block = numbers(launch((p, hosts, "slot"))["traffic"][1])
    cyclic_ok, cyclic_msg = launch((p, hosts, "node"))["traffic"]
    cyclic = numbers(cyclic_msg)
    assert cyclic_ok, cyclic_msg
    assert cyclic["bitwise"] == "True"
    for got in (block, cyclic):
        assert int(got["link"]) >= int(got["ring"]) > 0, (block, cyclic)
    # cyclic in rank order would cross on all P hops instead of `hosts`: P/hosts = 2 times the bytes
    assert int(cyclic["link"]) < 1.25 * int(block["link"]), (block, cyclic)
    assert int(cyclic["ring"]) < 1.1 * int(block["ring"]), (block, cyclic)
    assert block["order"] == ",".join(map(str, range(p))), block
    assert cyclic["order"] == ",".join(str(r) for h in range(hosts) for r in range(h, p, hosts)), cyclic




@pytest.fixture(scope="module")
def file_job(netns):
    """make-data, run --backward (head_parallel auto) and verify on 4 ranks over 2 hosts, once."""
    where = netns.shared / "filejob"
    where.mkdir(exist_ok=True)
    steps = {}
    for name, nprocs, args in (
            ("make-data", 4, ["make-data", "in.h5", "--n", "389", "--heads", "4", "--kv-heads", "2", "--dim", "16",
                              "--batch", "2", "--with-do", "--overwrite"]),
            ("run", 4, ["run", "in.h5", "-o", "out.h5", "--backward", "--causal", "--head-parallel", "auto",
                        "--heads-per-pass", "2", "--timeout", "60"]),
            ("verify", 4, ["verify", "in.h5", "out.h5"]),
            ("bench", 4, ["bench", "--n", "192", "--heads", "4", "--dim", "16", "--repeat", "1", "--warmup", "0",
                          "--backend", "numpy", "--head-parallel", "auto", "--json", "bench.json"])):
        steps[name] = netns.mpirun(nprocs, [RINGMPI, *args], timeout=240, hosts=2, cwd=where)
        if name != "verify":
            assert steps[name][0] == 0, f"{name}: {steps[name][2][-3000:]}"
    return where, steps


def test_file_job_across_hosts(file_job):
    where, steps = file_job
    rc, out, err, _ = steps["verify"]
    assert rc == 0, out + err[-3000:]
    summary = steps["run"][1]
    assert "P=4, layout zigzag, causal, forward+backward" in summary, summary
    # head_parallel auto chooses U by predicted cost on the measured links (issue 53): groups of two
    # on each host, or the flat ring, with the prediction and the runner-up's
    assert re.search(r"  schedule: (head x ring, 2 ranks per group \(all-to-all\), ring of 2 groups|flat ring, "
                     r"head_parallel U=1) \(chosen by head_parallel auto: .*predicted [0-9.e+-]+ s, runner-up ",
                     summary), summary
    # nothing beside the files but themselves: no MPI-IO lock files, no partial file
    assert sorted(p.name for p in where.iterdir()) == ["bench.json", "in.h5", "out.h5"]


def test_bench_reports_the_u_auto_chose(file_job):
    where, steps = file_job
    out = steps["bench"][1]
    assert re.search(r"head_parallel auto \(U=[12]\)", out.splitlines()[0]), out
    report = json.loads((where / "bench.json").read_text())
    assert report["head_parallel"] == "auto" and report["head_parallel_chosen"] in (1, 2)

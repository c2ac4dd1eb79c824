"""Ranks on several hosts: network namespaces on this machine (``hosts.py``).

``test_across_hosts`` (the only test that runs in a plain session) starts this module
again inside a user and network namespace of its own (``hosts.run_inside``) and passes
when everything there passes; skipped where namespaces cannot be made, with the reason.
Inside, ``hosts.Fabric`` makes the hosts, and the launcher places each rank on one, so
ranks on one host talk through shared memory and ranks on different hosts only over tcp
through the bridge, as on a cluster:

* ``test_on_hosts``: the collective matrix of test_collectives.py (a sample of its sizes
  and dtypes; all of it in make stress), its big tensors, the p2p cases and the EP
  buffer's cases, at world 4 on two hosts of two ranks; each rank checks that it reaches
  its host's peer over shm and the other host's over tcp. Where the build has ucx, EP
  again with the ucx transport for every peer (UCX kept to tcp), and in make stress the
  matrix sample, big tensors and p2p too.
* ``test_partition``: world 4 on three hosts (ranks 0 and 1, rank 2, rank 3); rank 3's
  link is taken down in the middle of all_reduce rounds (a partition, not a crash:
  its process lives on and loses the store too). The others go on among themselves
  within the hang limit, with rank 3 out of their active set and every result over
  {0, 1, 2}. Rank 3 cannot reach the store either, so it cannot agree with anyone: its
  op raises ``LeftOutError`` (it lost the store) within the hang limit plus
  ``MOONCAKE_STORE_TIMEOUT_MS``, instead of waiting for TCP to give up; once its link is
  back, its next op says the others left it out. Over tcp, and over ucx (make stress).
* ``test_kill_across_hosts``: the same layout, rank 3 killed (SIGKILL) instead: its
  peers on the other hosts see its connections close and go on at once, well within
  the hang limit (over tcp, and over ucx).
* ``test_stops_and_slow_ranks_across_hosts``: a slow rank (kept) and two stopped ranks
  (left out, told so when they resume) on two hosts.
* ``test_chaos_across_hosts``: the chaos driver of test_fault_tolerance.py on two hosts:
  ranks killed inside ops (EP rounds among them) until one rank is left on each host
  (over tcp, and over ucx in make stress).
* ``test_replacements_across_hosts``: the elastic loop of test_elastic.py on two hosts:
  killed ranks replaced by new processes that join the running group, first on the
  victim's own host, then, once a whole host went down (its link cut, its processes
  killed), on the other hosts; after every join every op covers exactly the four ranks,
  and each process reaches its peers over the transport their new places call for (over
  tcp, and over ucx in make stress).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import hosts
from ep_cases import ep_cases
from launcher import SMALL_CHUNKS, Launch, check, parametrize, ucx_built
from test_collectives import big, matrix
from test_p2p import p2p_cases

INSIDE = hosts.inside()


def inner(test):
    """A test that runs inside the hosts' namespace (test_across_hosts starts it):
    collected there only, so that a run outside lists no skips for it. Goes above the
    test's other decorators."""
    return test if INSIDE else None


def outer(test):
    """test_across_hosts: collected outside only (inside, it is what runs)."""
    return None if INSIDE else test


TWO_BY_TWO = (0, 0, 1, 1)
#: Gloo (the EP cases' side group) picks its interface from the host name, which names
#: no interface of a host here: give it the host's link.
GLOO = (("GLOO_SOCKET_IFNAME", "eth0"),)
ON_HOSTS = (("transport_name", "hosts"), ("hosts", TWO_BY_TWO))
#: A sample of the matrix (the whole of it runs at world 4 on one host in
#: test_collectives.py, and here in make stress): empty, odd and chunked sizes, one
#: dtype of each width and kind.
SAMPLE = (
    ("sizes", (0, 7, 5000)),
    ("dtypes", (torch.int8, torch.int64, torch.bfloat16, torch.float32)),
)
LAUNCHES = [
    Launch(
        matrix,
        4,
        "hosts-2x2-chunk4k-sample",
        env=SMALL_CHUNKS,
        params=(*ON_HOSTS, *SAMPLE),
        hosts=TWO_BY_TWO,
    ),
    Launch(
        matrix,
        4,
        "hosts-2x2-chunk4k",
        env=SMALL_CHUNKS,
        params=ON_HOSTS,
        hosts=TWO_BY_TWO,
        stress=True,  # CI's time: the sample above runs by default
    ),
    Launch(big, 4, "hosts-2x2-default", params=ON_HOSTS, hosts=TWO_BY_TWO),
    Launch(p2p_cases, 4, "hosts-2x2-p2p-chunk4k", env=SMALL_CHUNKS, hosts=TWO_BY_TWO),
    # The EP buffer's portable path, every case checked against the model.
    Launch(ep_cases, 4, "hosts-2x2-ep", env=GLOO, op_timeout_s=30.0, hosts=TWO_BY_TWO),
]
#: The ucx transport for every peer, UCX itself kept to tcp: only the network, as between
#: hosts without RDMA.
UCX_ENV = (("MOONCAKE_TRANSPORT", "ucx"), ("UCX_TLS", "tcp"))
TRANSPORTS = ["auto", *(["ucx"] if ucx_built() else [])]
#: The same, with ucx only in make stress (for the slower tests; CI's time is bounded).
TRANSPORTS_UCX_STRESS = [
    "auto",
    *([pytest.param("ucx", marks=pytest.mark.stress)] if ucx_built() else []),
]
if ucx_built():
    LAUNCHES += [
        Launch(
            matrix,
            4,
            "hosts-2x2-ucx-sample",
            env=(*UCX_ENV, *SMALL_CHUNKS),
            params=(*SAMPLE, ("transport_name", "ucx")),
            hosts=TWO_BY_TWO,
            stress=True,  # a minute here; the big tensors and p2p below run by default
        ),
        Launch(
            big,
            4,
            "hosts-2x2-ucx-default",
            env=UCX_ENV,
            params=(("transport_name", "ucx"),),
            hosts=TWO_BY_TWO,
            stress=True,  # CI time: p2p and EP over ucx run by default
        ),
        Launch(
            p2p_cases,
            4,
            "hosts-2x2-ucx-p2p",
            env=(*UCX_ENV, *SMALL_CHUNKS),
            hosts=TWO_BY_TWO,
            stress=True,  # CI's time: EP over ucx runs by default
        ),
        Launch(
            ep_cases,
            4,
            "hosts-2x2-ucx-ep",
            env=(*UCX_ENV, *GLOO),
            op_timeout_s=30.0,
            hosts=TWO_BY_TWO,
        ),
    ]


def transport_env(transport: str) -> dict[str, str]:
    return dict(UCX_ENV) if transport == "ucx" else {"MOONCAKE_TRANSPORT": transport}


# Collected inside only (outside, thousands of skipped items would say nothing).
if INSIDE:

    @pytest.mark.parametrize(("launch", "case"), parametrize(LAUNCHES))
    def test_on_hosts(launch, case):
        """The case's result equals the local reference bit for bit on every rank."""
        check(launch, case)


# --- a partition ---------------------------------------------------------------------------

PARTITION_HOSTS = (0, 0, 1, 2)
CUT_RANK = 3  # alone on host 2
HANG_MS = 1000
STORE_TIMEOUT_MS = 3000  # a store request with no answer in this long: the store is out of reach


def partition_rank(rank: int, world: int, port: int, marker: str, fault: str = "cut") -> dict:
    """All_reduce rounds across the cut of rank 3's host, or its kill (``fault``: "cut" or
    "kill"; see ``test_partition`` and ``test_kill_across_hosts``)."""
    from mooncake import LeftOutError
    from mooncake.launch import init_rank, store_host

    active = init_rank(rank, world, port, timeout_s=20)
    store = dist.TCPStore(store_host(), port, world, is_master=False, timeout=timedelta(seconds=5))
    out: dict = {"rank": rank, "rounds": 0}

    def round_(i: int) -> list[int]:
        t = torch.full((256,), float(rank + 1))
        dist.all_reduce(t)
        members = [r for r in range(world) if int(active[r])]
        want = float(sum(r + 1 for r in members))
        if not bool((t == want).all()):
            raise AssertionError(f"round {i}: {t[0].item()} over {members}, want {want}")
        return members

    for i in range(3):
        round_(i)
    store.set(f"ready/{rank}", "1")
    # Bounded as the parent's wait for the same keys (2 cores may be busy with other work).
    store.wait([f"ready/{r}" for r in range(world)], timedelta(seconds=120))
    if rank != CUT_RANK:
        store.wait(["cut"], timedelta(seconds=120))
        cut_at = float(store.get("cut").decode())
        i = 3
        while True:
            members = round_(i)
            i += 1
            if CUT_RANK not in members:
                out["detect_s"] = time.time() - cut_at
                break
            if time.time() - cut_at > 30:
                raise AssertionError(f"rank {CUT_RANK} still counted 30 s after the cut")
        for _ in range(5):
            members = round_(i)
            i += 1
        out["members"] = members
        out["rounds"] = i
        store.set(f"done/{rank}", "1")
        return out
    if fault == "kill":  # rounds until the parent kills this process
        while True:
            round_(-1)
    # The rank that is cut off: rounds until one fails (its process lives on, and
    # reaches neither its peers nor the store).
    start = time.time()
    out["error"] = ""
    try:
        for i in range(3, 100000):
            round_(i)
            if time.time() - start > 60:
                break
    except Exception as e:  # noqa: BLE001 - what it gets is the result
        out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    out["error_after_s"] = time.time() - start
    out["rounds"] = i
    with open(marker, "w") as f:  # the parent heals the link now (the store is out of reach)
        f.write(out["error"])
    # Once the link is back, the next op says it was left out.
    deadline = time.time() + 120
    while True:
        try:
            store.get("healed")
            break
        except Exception:  # noqa: BLE001 - the store is out of reach until the heal
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    try:
        round_(-1)
        out["after_heal"] = "ran"
    except LeftOutError as e:
        out["after_heal"] = f"LeftOutError: {str(e).splitlines()[0][:200]}"
    except Exception as e:  # noqa: BLE001
        out["after_heal"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out


@inner
@pytest.mark.timeout(240)
@pytest.mark.parametrize("transport", TRANSPORTS_UCX_STRESS)
def test_partition(transport):
    from mooncake.launch import LocalGroup

    f = hosts.fabric()
    tmp = tempfile.mkdtemp(prefix="mooncake-partition-")
    env = {
        "MOONCAKE_HANG_MS": str(HANG_MS),
        "MOONCAKE_STORE_TIMEOUT_MS": str(STORE_TIMEOUT_MS),
        "OMP_NUM_THREADS": "1",
        **transport_env(transport),
    }
    with LocalGroup(
        4, env=env, placement=f.placement(PARTITION_HOSTS), store_host=f.gateway
    ) as group:
        marker = os.path.join(tmp, "cut-off-rank-failed")
        group.start(partition_rank, args=(marker,))
        group.store.wait([f"ready/{r}" for r in range(4)], timedelta(seconds=120))
        f.cut(PARTITION_HOSTS[CUT_RANK])
        group.store.set("cut", repr(time.time()))
        try:
            survivors = [group.result(str(r), timeout_s=120) for r in range(3)]
            # Rank 3 stays cut off until its op has failed by itself.
            while not group.store.check(["healed"]):
                if group.exited(str(CUT_RANK)) or time.time() - float(group.store.get("cut")) > 90:
                    break
                if os.path.exists(marker):
                    break
                time.sleep(0.1)
        finally:
            f.heal(PARTITION_HOSTS[CUT_RANK])
            group.store.set("healed", "1")
        cut_off = group.result(str(CUT_RANK), timeout_s=180)
    print(f"partition ({transport}): survivors {survivors}; cut-off {cut_off}", file=sys.stderr)
    for s in survivors:
        assert s["members"] == [0, 1, 2], s
        assert s["detect_s"] < HANG_MS / 1000 + 3.0, s
    # Out of reach of its peers (the hang limit) and then of the store (its bound).
    assert cut_off["error"].startswith("LeftOutError"), cut_off
    assert "lost the store" in cut_off["error"], cut_off
    assert cut_off["error_after_s"] < (HANG_MS + STORE_TIMEOUT_MS) / 1000 + 5, cut_off
    assert cut_off["after_heal"].startswith("LeftOutError"), cut_off


@inner
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", [*TRANSPORTS, pytest.param("tcp", marks=pytest.mark.stress)])
def test_kill_across_hosts(transport):
    """Rank 3, alone on its host, is killed (SIGKILL) in the middle of all_reduce rounds:
    its peers on the other hosts see its connections close (tcp, or UCX's endpoint
    error) and go on among {0, 1, 2} well within the hang limit."""
    from mooncake.launch import LocalGroup

    f = hosts.fabric()
    env = {"MOONCAKE_HANG_MS": "10000", "OMP_NUM_THREADS": "1", **transport_env(transport)}
    with LocalGroup(
        4, env=env, placement=f.placement(PARTITION_HOSTS), store_host=f.gateway
    ) as group:
        group.start(partition_rank, args=("", "kill"))
        group.store.wait([f"ready/{r}" for r in range(4)], timedelta(seconds=120))
        group.expect_exit(CUT_RANK)
        group.kill(CUT_RANK)
        group.store.set("cut", repr(time.time()))
        survivors = [group.result(str(r), timeout_s=60) for r in range(3)]
    print(f"kill across hosts ({transport}): {survivors}", file=sys.stderr)
    for s in survivors:
        assert s["members"] == [0, 1, 2], s
        assert s["detect_s"] < 2.0, s  # the hang limit is 10 s: a closed connection, not silence


@inner
@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", TRANSPORTS_UCX_STRESS)
def test_chaos_across_hosts(transport):
    """The fault-tolerance chaos driver (test_fault_tolerance.py) at world 4 on two hosts
    of two ranks: rank 3 killed inside a chunked all_reduce, then rank 0 inside an
    all_to_all, so that one rank goes on on each host (1 and 2, over tcp); every
    survivor's every op (every collective, p2p rings, EP rounds) must cover the same
    ranks, never a dead one."""
    from ft_parent import CHUNKED, chaos_plan, check_chaos, conduct_chaos, env, launch
    from ft_ranks import chaos_rank

    f = hosts.fabric()
    plan = chaos_plan(11, [([3], "in_big"), ([0], "in_a2a")])
    where = {"placement": f.placement(TWO_BY_TWO), "store_host": f.gateway}
    env_vars = env(CHUNKED, **transport_env(transport))
    out = launch(4, chaos_rank, plan, env_vars, conduct_chaos(plan), timeout_s=150, **where)
    problems = check_chaos(out.get(), 4, plan)
    assert not problems, f"{out.seconds:.1f} s:\n" + "\n".join(problems[:40])


@inner
@pytest.mark.timeout(200)
def test_stops_and_slow_ranks_across_hosts():
    """The chaos driver's stops on two hosts, over tcp: rank 2 slowed (stopped for less
    than the hang limit: nobody is left out), rank 1 stopped between two of its ops and
    rank 3 at a random moment, each seen by its silent heartbeat across the wire; once
    the others went on, the stopped rank resumes and learns it was left out."""
    from ft_parent import CHUNKED, chaos_plan, check_chaos, conduct_chaos, env, launch
    from ft_ranks import chaos_rank

    f = hosts.fabric()
    plan = chaos_plan(3, [([2], "slow"), ([1], "stop_between"), ([3], "stop")])
    where = {"placement": f.placement(TWO_BY_TWO), "store_host": f.gateway}
    out = launch(4, chaos_rank, plan, env(CHUNKED), conduct_chaos(plan), timeout_s=150, **where)
    problems = check_chaos(out.get(), 4, plan)
    assert not problems, f"{out.seconds:.1f} s:\n" + "\n".join(problems[:40])


# --- replacements ---------------------------------------------------------------------------


@inner
@pytest.mark.timeout(200)
@pytest.mark.parametrize("transport", TRANSPORTS_UCX_STRESS)
def test_replacements_across_hosts(transport):
    """The elastic loop of test_elastic.py at world 4 on two hosts of two ranks. Ranks 2
    (host 1) and 0 (host 0) are killed together and each replaced on its own host; then
    host 0 goes down (its link cut, then both its processes killed: its peers see only
    silence) and its ranks are replaced elsewhere, rank 0 on host 1 and rank 1 on a
    third host. The survivors admit each replacement (``get_peer_state``,
    ``recover_ranks``; it joins with ``join_group``); after every join all processes,
    replacements included, run every collective, a p2p ring, an EP Buffer round and an
    elastic EP buffer round, each covering exactly all four ranks; at the end each
    process reaches its host's peers over shm and the others over tcp (or every peer
    over ucx). Over ucx this needs the tcp dial before each UCX endpoint: UCX's tcp
    transport connects in blocking mode, and the elastic buffer's probe of an address
    that no longer answers stalled the process's UCX calls until the kernel gave up."""
    from ft_parent import check_elastic, conduct_steps, elastic_plans, env, launch
    from ft_ranks import ELASTIC_KINDS, elastic_rank

    f = hosts.fabric()
    member, joiner = elastic_plans(4, 4, range(4), ELASTIC_KINDS, 3, transports=True)
    steps = [
        ("wait_full", 120),
        ("kill", 2),
        ("kill", 0),
        ("start", 2, joiner),
        ("start", 0, joiner),
        ("wait_full", 60),
        ("call", lambda: f.cut(0)),
        ("kill", 0),
        ("kill", 1),
        ("start", 0, joiner, f.placement([1])[0]),
        ("start", 1, joiner, f.placement([2])[0]),
        ("wait_full", 60),
        ("stop",),
    ]
    where = {"placement": f.placement(TWO_BY_TWO), "store_host": f.gateway}
    env_vars = env(**transport_env(transport))
    try:
        out = launch(4, elastic_rank, member, env_vars, conduct_steps(steps), 150, **where)
    finally:
        f.heal(0)
    results = out.get()
    problems = check_elastic(results, range(4), ELASTIC_KINDS)
    assert sorted(results) == ["0.2", "1.1", "2.1", "3"], sorted(results)
    assert len(results["3"]["batteries"]) == 3, results["3"]["batteries"]  # before, 2 joins
    host = {0: 1, 1: 2, 2: 1, 3: 1}  # where each rank's latest process runs
    for key, res in results.items():
        me = int(key.split(".")[0])
        want = {
            r: "ucx" if transport == "ucx" else "shm" if host[r] == host[me] else "tcp"
            for r in range(4)
            if r != me
        }
        if res.get("transports") != want:
            problems.append(f"process {key}: transports {res.get('transports')}, want {want}")
    print(f"replacements across hosts ({transport}): {out.seconds:.1f} s", file=sys.stderr)
    assert not problems, f"{out.seconds:.1f} s:\n" + "\n".join(problems[:40])


# --- the outer test ------------------------------------------------------------------------


@outer
@pytest.mark.timeout(900)
def test_across_hosts():
    """Everything above, inside a user and network namespace of its own."""
    why = hosts.reason()
    if why:
        pytest.skip(why)
    r = hosts.run_inside(
        ["-m", "pytest", os.path.abspath(__file__), "-q", "-p", "no:cacheprovider", "-rs",
         "-k", "not test_across_hosts"],
        timeout_s=850,
    )  # fmt: skip
    tail = (r.stdout + r.stderr)[-6000:]
    assert r.returncode == 0, tail
    assert " passed" in r.stdout and " failed" not in r.stdout, tail

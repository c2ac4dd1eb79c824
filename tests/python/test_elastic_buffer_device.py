"""The ElasticBuffer's device path (``mooncake/ep/throughput_device.py``, kernels in
``src/kernels/ep_ht``) on the GPU: every rank of a ``mooncake-cpu`` group shares the one
GPU of the test machine, maps the others' workspaces through CUDA IPC, and runs its CUDA
calls there (under MPS side by side; without it they time-slice: correct, only slower).

Needs a CUDA GPU and a CUDA build of the extension (``make gpu-check`` runs it on the GPU
machine, with MPS for the rounds and without it for the kill test); skipped elsewhere,
and under ``MOONCAKE_NO_SKIP=1`` a skip fails.

* ``test_device_rounds`` (worlds 1, 2, 4): every argument combination of
  ``test_elastic_buffer.py`` (BF16/FP16/FP32 and pre-quantised FP8 with odd strides and
  packed scales, do_expand and alignments, CPU sync on and off, cached dispatches, top-1
  to top-32, -1 selections, ranks with no tokens, int32 ids, strided and misaligned x,
  weights or not, single reduction) plus H=7168 rounds at top-8 of 256 experts: each
  checked against ``ht_model`` bit for bit, then against the portable path (the same
  inputs as CPU tensors through the same buffer) bit for bit, and the path that ran is
  the device path wherever the rows allow it. Also ``num_sms`` (the grid) changes
  nothing, the workspace does not grow with T, and a bad expert id raises ValueError on
  its rank only.
  The launches at 2 and 4 run again with ``MOONCAKE_EP_HT_ONE_COPY=1`` (dests read a
  source's x in place), with ``dev/one-copy``: rows were read so after the first round.
  The kill test below runs with it off and on.
* ``test_kills_rank_mid_dispatch_then_replacement``: world 4; rank 2 dies inside a fresh
  dispatch, after its layout pass told the others what it sends and before its rows move.
  The survivors' dispatch masks it and drops its rows (checked against the model), as do
  a round with it masked and a cached dispatch along a handle from before its death; a
  replacement joins (``recover_ranks`` + ``update_ep_member``), stale handles are refused
  naming the generation, and rounds at full strength (the replacement included) are exact.
"""

from __future__ import annotations

import pytest

import ht_device
from ft_parent import env, launch, mark_dead, wait_key
from ht_fault import rejoin_problems
from launcher import Launch, check, parametrize

pytestmark = pytest.mark.skipif(
    not ht_device.has_device_path(),
    reason="needs a CUDA GPU and a CUDA build of mooncake (the ElasticBuffer device path)",
)

# Generous deadlines: four processes on one GPU time-slice without MPS. The launch's own
# bound comes before pytest's (the first case pays for the launch): it names the case that
# hung, where pytest's would only stop the test.
LAUNCHES = [
    Launch(ht_device.device_cases, w, f"htdev-w{w}", op_timeout_s=60.0, timeout_s=500.0)
    for w in (1, 2, 4)
] + [
    # The same with one copy (receivers read a source's x in place), and a case that
    # checks the rows were read so.
    Launch(
        ht_device.device_cases,
        w,
        f"htdev-onecopy-w{w}",
        env=(("MOONCAKE_EP_HT_ONE_COPY", "1"),),
        params=(("one_copy", True),),
        op_timeout_s=60.0,
        timeout_s=500.0,
    )  # fmt: skip
    for w in (2, 4)
]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("launch", "case"), parametrize(LAUNCHES))
def test_device_rounds(launch, case):
    """One case of a device-path launch, on every rank (see support/ht_device.py)."""
    check(launch, case)


def _conduct(plan):
    def conduct(group, extra):
        wait_key(group, "armed", 240, extra)
        mark_dead(group, str(plan["victim"]), 60)
        group.start(ht_device.fault_rank, ranks=[plan["victim"]], args=(dict(plan, role="joiner"),))

    return conduct


def fault_problems(plan, results) -> list[str]:
    victim, world = plan["victim"], 4
    if sorted(results) != ["0", "1", f"{victim}.1", "3"]:
        return [f"results from {sorted(results)}"]
    problems = []
    after_death = [0 if r == victim else 1 for r in range(world)]
    for key, res in sorted(results.items()):
        problems += rejoin_problems(key, res, victim, world)
        if res["role"] == "member":
            during = next((rec for rec in res["rounds"] if rec["tag"] == "during"), None)
            if during is None or during["active"] != after_death or not during.get("masked_in"):
                problems.append(f"process {key}: the dying round left active_ranks {during}")
    return problems


@pytest.mark.timeout(600)
@pytest.mark.parametrize("one_copy", ["0", "1"], ids=["ring", "onecopy"])
def test_kills_rank_mid_dispatch_then_replacement(one_copy):
    plan = {"role": "member", "timeout_s": 30.0, "victim": 2}
    out = launch(4, ht_device.fault_rank, plan, env(MOONCAKE_EP_HT_ONE_COPY=one_copy),
                 _conduct(plan), timeout_s=540.0)  # fmt: skip
    problems = fault_problems(plan, out.get())
    assert not problems, f"{out.seconds:.1f} s:\n" + "\n".join(problems[:40])

"""The elastic EP buffer on the GPU: the RFC's plans of test_ep_elastic.py with CUDA tensors.

Needs a CUDA GPU and a CUDA build of the extension (``make gpu-check`` runs it on the GPU
machine); skipped elsewhere. The timelines of ``elastic_ranks.py`` run with
``device="cuda"``: every process allocates its workspace in device memory, maps each
slot's as it connects it, and every round (dispatch + combine, all the styles of
``elastic_round.STYLES``: sync, event, hook, FP8, ``out=``, zero-copy, stats, explicit
``active_ranks``) runs the device path's kernels on CUDA tensors and is checked against
the same model as on the CPU. All processes share the one GPU: under MPS in
``make gpu-check`` (correct, only slower, without it), except the kill test: under MPS a
process killed while its kernel runs makes the MPS server report a fatal error to every
client on the GPU, so ``make gpu-check`` runs that one without MPS.

* ``growth`` (capacity 8): slot 0 alone, then 1 -> 2 -> 4 (new processes join the call
  count of the running ones), then slot 1 leaves cleanly and {0, 2, 3} go on (sparse).
* ``fault`` (capacity 8, slots 0..3): slot 2 killed (SIGKILL) between rounds and slot 1
  in the middle of rounds: the kernels mask exactly the dead slot, told by the transport
  (within a few seconds, against a 20 s timeout_ms), the survivors go on; a replacement takes the slot and full rounds are exact again. Then
  the sparse layout {0, 3}.
* ``contract`` (capacity 4, three processes): staging beside live traffic (a staged
  slot receives nothing), disconnect/reconnect and mask/publish of a live peer (the
  peers ran different numbers of calls meanwhile and align again), barriers, a peer
  that skips a round masked by the kernels' deadline.
* ``upstream`` (capacity 4, three processes): upstream's elastic API
  (``test_upstream_elastic.py``) on the kernels, with views of the workspace.
* ``stopped`` (capacity 4, three processes; the canary of device fencing): slot 2 stopped
  with SIGSTOP is masked by the kernels past MOONCAKE_HANG_MS and left out; connect_ranks
  waits for its replacement (not the stopped process); resumed, its next calls raise
  LeftOutError and a late launch of its kernel stores into nobody (its peers fenced its
  workspace); the survivors' and the replacement's rounds after it are exact.
"""

from __future__ import annotations

import pytest

import ep_device_ranks as edr
from elastic_parent import SEED, Timeline, device_problems, report

pytestmark = pytest.mark.skipif(
    not edr.has_device_path(), reason="needs a CUDA GPU and a CUDA build of mooncake"
)

#: The kills' deadline, far above the detection limit: the transport tells the kernels of a
#: dead slot (its process gone), so they must not wait for the deadline.
TIMEOUT_MS = 20000
DETECT_LIMIT_S = 5.0

GROWTH = {
    "capacity": 8,
    "stages": [1, 2, 4],
    "rounds": 6,
    "removed": [1],
    "timeout_ms": 30000,
    "seed": SEED,
    "device": "cuda",
}

FAULT = {
    "capacity": 8,
    "world": 4,
    "rounds": 6,
    "timeout_ms": TIMEOUT_MS,
    "cycles": [
        {"victim": 2, "mode": "between", "arm": 1, "delay": 0.1},
        {"victim": 1, "mode": "mid", "arm": 1, "delay": 0.05},
    ],
    "sparse": True,
    "seed": SEED,
    "device": "cuda",
}

CONTRACT = {"capacity": 4, "rounds": 4, "timeout_ms": 2500, "seed": SEED, "device": "cuda"}

#: elastic_ranks.stopped, on the device (test_ep_elastic.py runs it on the CPU).
STOPPED = {"capacity": 4, "rounds": 3, "timeout_ms": 20000, "metadata_timeout_ms": 60000,
           "seed": SEED, "device": "cuda"}  # fmt: skip

#: upstream_elastic_ranks.upstream: upstream's elastic API (test_upstream_elastic.py).
UPSTREAM = {"capacity": 4, "rounds": 6, "timeout_ms": 10000, "seed": SEED, "device": "cuda"}


@pytest.mark.timeout(400)
def test_growth_on_the_device():
    tl = Timeline("growth", GROWTH, [0], timeout_s=360).run()
    problems = device_problems(tl)
    assert not problems, report(problems, tl)
    phases = {r["phase"] for _, r in tl.records(event="round")}
    assert {"solo", "grow2", "grow4", "remove"} <= phases, phases
    assert {r["R"] for p, r in tl.rounds_of("remove") if p.slot != 1} >= {4, 8}


@pytest.mark.timeout(400)
def test_kills_and_replacements_on_the_device():
    tl = Timeline("fault", FAULT, range(4), timeout_s=360).run()
    problems = device_problems(tl)
    limit = DETECT_LIMIT_S
    for c in range(2):
        detected = tl.checks(f"kill{c}", "detected")
        survivors = [s for s in range(4) if s != FAULT["cycles"][c]["victim"]]
        if sorted(detected) != survivors:
            problems.append(f"cycle {c}: the kill was seen by {sorted(detected)}")
        for slot, rec in detected.items():
            if rec["detect_s"] > limit:
                problems.append(f"cycle {c}: slot {slot} took {rec['detect_s']:.2f} s")
    assert not problems, report(problems, tl)
    assert {r["phase"] for _, r in tl.records(event="round")} >= {
        "full", "kill0", "rejoin0", "kill1", "rejoin1", "sparse"
    }  # fmt: skip


@pytest.mark.timeout(400)
def test_connection_contract_on_the_device():
    tl = Timeline("contract", CONTRACT, [0, 1], timeout_s=360).run()
    problems = device_problems(tl)
    for slot, rec in tl.checks("staging", "staging").items():
        if rec["rounds_during_connect"] < 2:
            problems.append(f"slot {slot}: {rec['rounds_during_connect']} rounds during connect")
    assert not problems, report(problems, tl)
    phases = {r["phase"] for _, r in tl.records(event="round")}
    assert {"pair", "staging", "reconnect", "toggle", "timeout"} <= phases, phases


@pytest.mark.timeout(400)
def test_upstream_elastic_api_on_the_device():
    """The upstream scenario with CUDA tensors: upstream's elastic forms on the kernels,
    clean_mask_buffer, get_comm_stream and get_local_buffer_tensor over the workspace,
    destroy and a new buffer in the slot."""
    tl = Timeline("upstream", UPSTREAM, [0, 1, 2], timeout_s=360).run()
    problems = device_problems(tl)
    assert not problems, report(problems, tl)
    phases = {r["phase"] for _, r in tl.records(event="phase")}
    assert {"forms", "clean", "local", "destroy"} <= phases, phases


@pytest.mark.timeout(400)
def test_a_stopped_rank_is_fenced_on_the_device():
    tl = Timeline("stopped", STOPPED, [0, 1, 2], env={"MOONCAKE_HANG_MS": "1000"}, timeout_s=360)
    tl.run()
    problems = device_problems(tl)
    told = [r for p, r in tl.records(["resumed"], "check") if p.key == "2.0"]
    if not told or not (told[0].get("late") or {}).get("fenced"):
        problems.append(f"the resumed slot 2: {told}")
    for slot, rec in tl.checks("stop", "masked").items():
        if rec["dispatch_s"] > STOPPED["timeout_ms"] / 1000 / 2:
            problems.append(f"slot {slot} masked the stopped slot in {rec['dispatch_s']:.1f} s")
    assert not problems, report(problems, tl)
    phases = {r["phase"] for _, r in tl.records(event="phase")}
    assert {"full", "stop", "replace", "resume", "resumed"} <= phases, phases

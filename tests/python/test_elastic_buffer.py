"""The high-throughput ElasticBuffer (``mooncake.mooncake_elastic_buffer``), portable path,
over ``mooncake-cpu`` groups of 1, 2 and 4 ranks (one launch each, many cases).

* Rounds (``support/ht_cases.py``, ``support/ht_round.py``), each checked against the
  plain-Python model of ``support/ht_model.py``: received rows bit for bit in the fixed
  order (sources in rank order, tokens in order), ``recv_topk_idx`` (local ids, -1
  elsewhere), weights, the expanded layout (per expert, padded to ``expert_alignment``
  with zero rows), every handle field (prefix sums, counts, ``recv_src_metadata``,
  ``dst_buffer_slot_idx``), worst-case shapes without CPU sync, cached dispatches along
  a handle, and combine (bit for bit: fp32, slot by slot, one rounding; the weights each
  slot's rank sent back). Over BF16/FP16/FP32 and pre-quantised FP8 (fp32 scales, odd
  strides, packed int32 words), do_expand on and off, alignments 1, 8 and 128, CPU sync
  on and off, top-1 to top-32, -1 selections (all of them too), ranks with no tokens,
  N == T, int32 ids, strided x, with and without weights, single reduction, a
  deterministic buffer run twice, the defaults, and a gloo group.
* Rules that take several ranks: one rank's bad arguments make every rank raise, ranks
  that disagree (T, dtype, weights, fresh vs cached), a handle of an earlier membership
  generation or of another buffer, a destroyed buffer; a verified round follows each.
  Single-rank argument rules are rows of ``test_argument_checks.py``.
* The size hint's closed formula and the other hints.
* Failures (world 4, ``support/ht_fault.py``): a rank killed mid-dispatch is masked and
  the survivors' rounds stay correct (fresh, cached along a handle from before the death,
  and combine); a replacement joins (``recover_ranks`` + ``update_ep_member``), the old
  handles are refused on every rank, and a full-strength round is correct; then a rank
  stopped (SIGSTOP) is masked within the exchange timeout.
"""

from __future__ import annotations

import os
import random
import signal

import pytest

from ft_parent import env, launch, mark_dead, wait_key
from ht_cases import ht_cases
from ht_fault import TIMEOUT_SECS, ht_fault_rank, rejoin_problems
from launcher import Launch, check, parametrize

LAUNCHES = [Launch(ht_cases, w, f"ht-w{w}", op_timeout_s=30.0, timeout_s=300.0) for w in (1, 2, 4)]


@pytest.mark.parametrize(("launch", "case"), parametrize(LAUNCHES))
def test_elastic_buffer(launch, case):
    """One case of an ElasticBuffer launch, on every rank (see support/ht_cases.py)."""
    check(launch, case)


# --- failures: a rank killed mid-dispatch, a replacement, a stopped rank -------------------------


def fault_plan(seed: int, mode: str) -> dict:
    """``mode``: "between" (the victim dies between the exchanges of its second round's
    fresh dispatch: the third packing of token rows, after a fresh and a cached one) or
    "timer" (at a random moment of its rounds)."""
    rng = random.Random(seed)
    return {"role": "member", "timeout_s": 10.0, "victim": 2, "mode": mode, "at_pack": 3,
            "delay_s": rng.uniform(0.0, 0.04)}  # fmt: skip


def _conduct(plan):
    def conduct(group, extra):
        wait_key(group, "armed", 180, extra)
        mark_dead(group, str(plan["victim"]), 30)
        group.start(ht_fault_rank, ranks=[plan["victim"]], args=(dict(plan, role="joiner"),))
        for r in range(4):
            wait_key(group, f"p4ready/{r}", 180, extra)
        group.kill("3", signal.SIGSTOP)
        group.store.set("stopped", "1")
        wait_key(group, "p4done", 180, extra)
        group.kill("3", signal.SIGCONT)

    return conduct


def fault_problems(plan, results) -> list[str]:
    """What the fault launch's processes recorded that is wrong."""
    problems = []
    if sorted(results) != ["0", "1", "2.1", "3"]:
        return [f"results from {sorted(results)}"]
    bound_s = 2 * TIMEOUT_SECS + 3.0
    for key, res in sorted(results.items()):
        problems += rejoin_problems(key, res, plan["victim"], 4)
        tags = [rec["tag"] for rec in res["rounds"]]
        if res["role"] == "member":
            died = [rec for rec in res["rounds"] if rec.get("masked_in")]
            if not died:
                problems.append(f"process {key}: no round masked the victim: {tags}")
            elif plan["mode"] == "between" and (
                died[0]["tag"] != "during1" or died[0]["masked_in"] != "during1: dispatch"
            ):
                problems.append(
                    f"process {key}: the victim died between the exchanges of round during1's "
                    f"dispatch, but {died[0]['masked_in']!r} masked it"
                )
        if res["pg_after_rejoin"] != [1, 1, 1, 1]:
            problems.append(f"process {key}: pg view after the rejoin {res['pg_after_rejoin']}")
        if key == "3":
            status, detail, took = res.get("stopped", ("missing", "", 0))
            if status != "LeftOutError" or "left out" not in detail or took > 15:
                problems.append(
                    f"process 3 (stopped, resumed): {status} {detail!r} after {took:.1f} s; "
                    f"want LeftOutError (left out)"
                )
        else:
            stopped = next((rec for rec in res["rounds"] if rec["tag"] == "stopped_peer"), None)
            if stopped is None or stopped["active"] != [1, 1, 1, 0]:
                problems.append(f"process {key}: round with a stopped peer: {stopped}")
            elif stopped["dispatch_s"] > bound_s:
                problems.append(
                    f"process {key}: dispatch with a stopped peer took {stopped['dispatch_s']:.1f} s"
                )
    return problems


def run_fault(plan) -> list[str]:
    out = launch(4, ht_fault_rank, plan, env(MOONCAKE_HANG_MS="20000"), _conduct(plan),
                 timeout_s=200.0)  # fmt: skip
    problems = fault_problems(plan, out.get())
    return [f"plan {plan}, {out.seconds:.1f} s:"] + problems[:40] if problems else []


@pytest.mark.timeout(240)
def test_rank_killed_mid_dispatch_is_masked_replaced_and_stale_handles_refused():
    """Rank 2 dies between the two exchanges of a dispatch (after the others counted on
    its tokens): the survivors' dispatch returns with it masked and its rows left out,
    their rounds stay correct (checked against the model), and a round with it masked
    and a cached dispatch along a handle from before its death are correct. A replacement joins (recover_ranks, update_ep_member / ElasticBuffer): the
    handles from before are refused on every rank (ValueError naming the generation; the
    replacement's fresh dispatches fail alike), and full-strength rounds are correct.
    Last, a stopped rank (SIGSTOP) is masked within the 3 s exchange timeout, and
    resumed, learns it was left out (LeftOutError)."""
    problems = run_fault(fault_plan(5, "between"))
    assert not problems, "\n".join(problems)


@pytest.mark.stress
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("seed", range(200, 200 + int(os.environ.get("MOONCAKE_EP_KILLS", "4"))))
def test_rank_killed_at_a_random_moment_stress(seed):
    """As above, with the victim killed by a timer at a random moment of its rounds."""
    problems = run_fault(fault_plan(seed, "timer"))
    assert not problems, "\n".join(problems)

"""EP as a serving engine drives it (``support/engine_ranks.py`` says how), at 1, 2
and 4 processes: over the engine's own group without a mooncake backend, over a
mooncake group, and with a rank killed between two steps. CPU tensors here; CUDA
tensors on the GPU machine (``make gpu-check``), where the device path must serve
every step.
"""

from __future__ import annotations

import pytest

import engine_ranks
import ep_device_ranks as edr

DEVICES = ["cpu", "cuda"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_engine_pattern(world, device):
    from mooncake.launch import LocalGroup

    if device == "cuda" and not edr.has_device_path():
        pytest.skip("needs a CUDA GPU and a CUDA build of mooncake")
    victim = world - 1 if world > 1 else None
    with LocalGroup(world, {"MOONCAKE_EP_WAIT_CAP_MS": "60000"}) as group:
        group.start(engine_ranks.rank_engine, args=(device, victim))
        if victim is not None:
            group.expect_exit(victim)
        results = group.results(timeout_s=300)
    survivors = [r for r in range(world) if r != victim]
    assert sorted(results) == [str(r) for r in survivors], sorted(results)
    for r in survivors:
        res = results[str(r)]
        steps = res["foreign"]["steps"] + res["mooncake"]
        assert all(s["active"] == [1] * world for s in steps), (r, steps)
        if device == "cuda":
            assert all(s["path"] == "device" for s in steps), (r, steps)
        if victim is None:
            continue
        after = res["after_kill"]
        masked = [1 if q != victim else 0 for q in range(world)]
        assert all(s["active"] == masked for s in after), (r, after)
        if device == "cuda":
            assert all(s["path"] == "device" for s in after), (r, after)
        # Either path hears of a dead rank within milliseconds (the device path from
        # the group's transport and from the rank's life page), never at the deadline
        # (timeout_us, 10 s).
        assert after[0]["s"] < 5.0, (r, after)

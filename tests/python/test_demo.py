"""The examples run as their docstrings say and pass: the quick start under torchrun,
``make demo``, the MoE layer, the elastic buffer and the transformers MoE blocks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_python(*args: str) -> str:
    """Runs ``python *args`` in the repository without MOONCAKE_* variables; asserts it
    exits 0 and returns what it printed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    proc = subprocess.run(
        [sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=280
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def test_pg_quickstart_under_torchrun():
    """``torchrun --standalone --nproc-per-node=2 examples/pg_quickstart.py`` exits 0 and
    both ranks print every result and OK."""
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(
        [str(torchrun), "--standalone", "--nproc-per-node=2", "examples/pg_quickstart.py"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so a hang can be ended with the ranks torchrun started
    )
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError("torchrun did not finish within 180 s:\n" + out[-4000:]) from None
    assert proc.returncode == 0, out[-4000:]
    for rank in (0, 1):
        assert f"rank={rank} all_reduce=3" in out, out[-4000:]
        assert f"rank={rank} ring_exchange=" in out, out[-4000:]
        assert f"rank={rank} OK" in out, out[-4000:]


def test_make_demo_shows_a_kill_and_a_replacement():
    """``python -m mooncake demo`` (what ``make demo`` runs first): collectives, an EP
    dispatch/combine, rank 2 killed inside an all_reduce that the survivors complete among
    themselves, EP masking it, a replacement joining, and full strength again (collectives
    and EP)."""
    out = run_python("-m", "mooncake", "demo")
    for line in (
        "all_reduce(SUM) of rank+1 over 4 ranks = 10",
        "all_reduce of 1 << rank covered ranks [0, 1, 3]",
        "active_ranks = [1, 1, 0, 1], synced ranks = 3",
        "recover_ranks([2]): active_ranks = [1, 1, 1, 1]",
        "full strength again: all_reduce covered ranks [0, 1, 2, 3]",
        "EP dispatch/combine: each token went to 4 experts, one per rank, and came back summed",
        "EP after the kill: ep active_ranks = [1, 1, 0, 1], tokens came back from 3 experts",
        "EP at full strength again: tokens came back from 4 experts",
        "replacement rank 2 joined; its all_reduce covered [0, 1, 2, 3], its EP tokens came back "
        "from 4 experts",
        "demo finished",
    ):
        assert line in out, f"missing {line!r} in:\n{out[-4000:]}"


def test_moe_layer_example_matches_the_dense_reference():
    """``python examples/moe_layer.py --world 2`` (``make demo`` runs it at world 4): an MoE
    layer over dispatch/combine agrees with a single-process dense layer, with BF16 and with
    FP8 dispatch, and exits 0."""
    out = run_python("examples/moe_layer.py", "--world", "2")
    for fmt in ("BF16", "FP8 "):
        assert f"MoE layer over 2 ranks, 8 experts, top-3, {fmt} dispatch" in out, out[-4000:]
    assert out.count(" OK") == 2, out[-4000:]


def test_elastic_ep_example_grows_loses_and_replaces_a_rank():
    """``python examples/elastic_ep.py`` (in ``make demo``): 2 -> 4 slots, slot 3 killed and
    masked, a new process in slot 3; every round checked inside the ranks, and it exits 0."""
    out = run_python("examples/elastic_ep.py")
    assert "elastic EP example: ok" in out, out[-4000:]
    for line in (
        "[slot 0] 2 ranks: active [0, 1]",
        "[slot 0] 4 ranks: active [0, 1, 2, 3]",
        "[slot 0] slot 3 killed: masked after",
        "[slot 3 (replacement)] after replacement: active [0, 1, 2, 3]",
    ):
        assert line in out, f"missing {line!r} in:\n{out[-4000:]}"


def test_hf_moe_example_matches_the_transformers_blocks():
    """``python examples/hf_moe.py --world 2`` (the default is 4; half the processes, each
    importing torch and transformers, keep it short on a busy machine): the sparse MoE blocks
    of Mixtral and Qwen2-MoE with their experts over the ranks agree with the unsharded blocks
    from transformers, in fp32 and bf16, and it exits 0. Skipped without transformers 5
    (``requirements-dev.txt`` has it)."""
    pytest.importorskip(
        "transformers",
        minversion="5",
        reason="examples/hf_moe.py needs transformers 5",
        exc_type=ImportError,  # not installed, or installed but broken
    )
    out = run_python("examples/hf_moe.py", "--world", "2")
    for model in ("Mixtral", "Qwen2-MoE"):
        for dtype in ("float32", "bfloat16"):
            assert f"{model} block, 16 experts over 2 ranks, {dtype}: max error" in out, out[-4000:]
    assert out.count(" OK") == 4, out[-4000:]


def test_hf_moe_prefill_example_matches_the_transformers_blocks():
    """``python examples/hf_moe_prefill.py --world 2`` (the default is 4; two processes keep
    it short, as above), 1,024 tokens per rank: the same blocks with their experts over the
    ranks through ``ElasticBuffer`` (one row per token, local expert ids, weights applied by
    the experts) agree with the unsharded blocks, in fp32 and bf16, and it exits 0. Skipped
    without transformers 5."""
    pytest.importorskip(
        "transformers",
        minversion="5",
        reason="examples/hf_moe_prefill.py needs transformers 5",
        exc_type=ImportError,
    )
    out = run_python("examples/hf_moe_prefill.py", "--world", "2")
    for model in ("Mixtral", "Qwen2-MoE"):
        for dtype in ("float32", "bfloat16"):
            line = (
                f"{model} block, 16 experts over 2 ranks, 1024 tokens per rank, {dtype}: max error"
            )
            assert line in out, out[-4000:]
    assert out.count(" OK") == 4, out[-4000:]

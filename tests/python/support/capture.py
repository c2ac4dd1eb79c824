"""CUDA graph capture for the GPU tests: ``graph`` is ``torch.cuda.graph`` with Python's
garbage collector kept out of the capture."""

from __future__ import annotations

import contextlib
import gc
import os
import sys

import torch

#: "1": keep Python's garbage collector running during captures, and report on stderr
#: each collection that starts inside one (to tell whether one breaks a capture).
GC_IN_CAPTURE = os.environ.get("MOONCAKE_TEST_GC_IN_CAPTURE") == "1"


@contextlib.contextmanager
def graph(cuda_graph, stream=None):
    """``torch.cuda.graph(cuda_graph, stream=stream)`` with Python's garbage collector held off
    inside it. torch 2.11 no longer collects before a capture, so a collection can start
    inside one and free an object of an earlier case whose destructor makes a CUDA call
    that is not allowed while a stream captures (an old CUDAGraph's, a group's), which
    ends the capture in error however the captured ops went."""
    enabled = gc.isenabled()
    if GC_IN_CAPTURE:
        gc.callbacks.append(_report)
    else:
        gc.collect()
        gc.disable()
    try:
        with torch.cuda.graph(cuda_graph, stream=stream):
            yield
    finally:
        if GC_IN_CAPTURE:
            gc.callbacks.remove(_report)
        elif enabled:
            gc.enable()


def _report(phase: str, info: dict) -> None:
    """A gc callback: says so when a collection starts (during a capture)."""
    if phase == "start":
        print(f"gc during a capture: generation {info['generation']}", file=sys.stderr)

"""Running a benchmark's ``main`` as a machine without a GPU would."""

import os
import subprocess
import sys

import torch


def main_without_gpu(module, args: list[str]) -> int:
    """``module.main(args)`` where torch sees no GPU: in this process when it sees none
    already, else in a child shown none (``CUDA_VISIBLE_DEVICES=""``), so that the GPU
    machine's run checks the answer too instead of skipping it."""
    if not torch.cuda.is_available():
        return module.main(args)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, module.__file__, *args], env=env, timeout=300).returncode

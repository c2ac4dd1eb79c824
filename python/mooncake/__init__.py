"""mooncake: a fault-tolerant torch.distributed backend and expert-parallel buffer.

``from mooncake import pg`` registers the ``mooncake-cpu`` (and, with CUDA,
``mooncake``) process-group backends. When ranks fail, ops raise
:class:`PeerFailedError` (a peer failed) or :class:`LeftOutError` (this rank was
left out of the group), both ``RuntimeError`` subclasses (``mooncake.errors``).
"""

from mooncake.errors import LeftOutError, PeerFailedError

__version__ = "0.1.0"
__all__ = ["LeftOutError", "PeerFailedError"]


def __getattr__(name):
    # `mooncake.TransferEngine` without importing torch at package import time.
    if name == "TransferEngine":
        from mooncake._loader import load_extension

        return load_extension().TransferEngine
    raise AttributeError(f"module 'mooncake' has no attribute {name!r}")

"""The exceptions mooncake raises when ranks fail, for callers to catch by type.

Both are :class:`RuntimeError` subclasses, so ``except RuntimeError`` keeps
catching them. Bad arguments raise :class:`ValueError` and deadlines
:class:`TimeoutError`, as before. This module imports nothing else of mooncake
(the extension raises these classes from C++).

Example::

    from mooncake import LeftOutError, PeerFailedError

    try:
        dist.broadcast(t, src=root)
    except LeftOutError:
        ...  # this rank is out of the group: exit; a new process can rejoin
    except PeerFailedError as e:
        ...  # e.ranks == [root]: the root failed; the group goes on without it
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["PeerFailedError", "LeftOutError"]


class PeerFailedError(RuntimeError):
    """An op could not complete because a peer failed.

    Raised by ``broadcast``/``scatter`` from a failed root and ``reduce``/``gather``
    to one (on every survivor; the group goes on without it), by p2p with a failed
    peer, by any op that meets a failed peer when recovery is off
    (``MOONCAKE_RECOVER=0``), and by ops on a process group that was shut down
    (``ranks`` is then empty).

    Attributes:
        ranks: list[int], the failed ranks when known (ranks of the process group
            the op ran on), else ``[]``.
    """

    def __init__(self, message: str = "", ranks: Iterable[int] = ()):
        super().__init__(message)
        self.ranks: list[int] = [int(r) for r in ranks]

    def __reduce__(self):
        # Keeps ``ranks`` through pickling (e.g. from a rank process to its launcher).
        return (type(self), (str(self), self.ranks))


class LeftOutError(PeerFailedError):
    """The other ranks left this rank out of the group: they took it for failed
    (it was stopped or hung past ``MOONCAKE_HANG_MS``, or did not call an op
    within its timeout) and went on without it.

    Every later op of this process on that group raises it too. The message says
    how to come back: a new process for this rank creates its group with
    ``MooncakeBackendOptions(..., is_extension=True)`` and calls
    ``pg.join_group()``, and the healthy ranks call ``pg.recover_ranks``.

    Attributes:
        ranks: ``[this rank]`` when known, else ``[]``.
    """

"""The expert-parallel Buffer's implementation (private: import the Buffer from
``mooncake.mooncake_ep_buffer``, upstream's path, which re-exports it from here).

A Buffer is its members times its paths; each module has one job:

* ``buffer``: the public :class:`Buffer`, composed of the parts below.
* ``types``: the small types the parts share (``DispatchHandle``, ``EventOverlap``).
* members, who the ranks are and which take part right now:
  ``group`` (``GroupMembers``, a process group's ranks) and ``elastic``
  (``Slots``, an elastic Buffer's slots, connected one by one).
* the portable path, for CPU tensors and every call the device path does not
  take: ``portable`` (``PortablePath``, running a call over the members'
  exchange) over ``portable_rows`` (its messages and tensor work).
* the device path: ``device`` (``DevicePath``, CUDA kernels over mapped
  workspaces, and the mapping of the members' workspaces).

The high-throughput ``ElasticBuffer`` (prefill; ``mooncake.mooncake_elastic_buffer``
re-exports it) shares the members and the row helpers: ``throughput`` (the public
class), ``throughput_handle`` (``EPHandle``, a call's routing plan),
``throughput_portable`` (its portable path) over ``throughput_rows``.

Nothing is imported here, so that ``mooncake._checks`` can take ``types`` alone.
"""

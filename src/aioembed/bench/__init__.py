"""``aioembed bench``: aioembed measured side by side with the raw transport.

Run ``aioembed bench --help``. Each measured point runs, alternately, aioembed end to end
(the receiver's copying ``receive()`` with the sender's ``send()``; the zero-copy
``receive_leased()`` where the receiver has it) and the transport's *raw baseline* moving the
same source bytes, and reports the median and spread of each and the ratio aioembed / raw.
Workloads: ``sizes``, ``concurrency``, ``resume``, ``trace`` (the seeded mixed multimodal trace
of :func:`aioembed.bench.workloads.generate_trace`), ``idle`` and ``memory``.

Process model (``--process-model``, default ``auto``): for a transport that crosses processes
(``capabilities.cross_process``, every plugin transport) the sender runs in the benchmark
process and the receiver in a child process (:mod:`aioembed.bench.peer`, JSON lines on its
stdin/stdout), as deployed; loopback runs both in one process. ``idle`` and ``memory`` keep
both sides in one process in every model. A plugin's raw baseline should likewise put its
destination in a peer process of its own (``cross_process = True``).

Raw baselines of plugin transports
----------------------------------
A transport plugin adds its raw baseline with an entry point in the group
``aioembed.bench_baselines``, named like the transport (its ``aioembed.transports`` name)::

    [project.entry-points."aioembed.bench_baselines"]
    mooncake = "aioembed_mooncake.bench:MooncakeBaseline"

The entry point resolves to a factory ``factory(layout: Layout, config: TransferConfig)``
(a class works) returning an object of the :class:`~aioembed.bench.baselines.RawBaseline`
protocol:

* ``description: str``: one line saying how the raw number is obtained;
* ``methods: tuple[str, ...]``: raw variants measured side by side (e.g. ``("batch_write",)``);
  the one with the smallest median time counts as "raw";
* ``cross_process: bool``: whether the destination lives in another process;
* optionally ``cuda: bool``: ``True`` when ``setup`` takes CUDA sources (the benchmark makes its sources
  on the pool's device) and puts the destination on their device; a baseline without it moves CPU
  memory only and is left out when the pool is on a GPU;
* ``async setup(sources, capacity_tokens)``: register the source tensors (one per layout
  field; rows ``[0, capacity_tokens)``) and prepare a registered destination of
  ``capacity_tokens`` rows per field (in a peer process if the transport allows);
* ``async transfer(method, num_tokens)``: move rows ``[0, num_tokens)`` of every field to the
  destination, returning once the bytes are visible there (the caller times this call);
* ``async aclose()``: release everything.

The loopback baseline (:class:`~aioembed.bench.baselines.LoopbackBaseline`) is built in: a
plain memory copy (``Tensor.copy_`` and ``ctypes.memmove``, the faster counts).
"""

from aioembed.bench.baselines import ENTRY_POINT_GROUP, LoopbackBaseline, RawBaseline, RawBaselineFactory
from aioembed.bench.workloads import TraceRequest, generate_trace

__all__ = [
    "ENTRY_POINT_GROUP",
    "LoopbackBaseline",
    "RawBaseline",
    "RawBaselineFactory",
    "TraceRequest",
    "generate_trace",
]

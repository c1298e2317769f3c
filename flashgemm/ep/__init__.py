"""Expert parallelism across GPUs: dispatch into the masked layout, the expert
path of ``flashgemm.moe``, and a combine that ships each m-block's rows to the
ranks that own the tokens while the down GEMM still runs.

Modules (one concept each):

* ``plan``: the routing plan (which copy goes to which rank, row and expert;
  the combine's routing back), pure torch.
* ``device_dispatch`` / ``dispatch_kernel``: the device dispatch (host side and
  CuTe DSL kernel): token rows stored straight into the owners' symmetric
  receive buffers in the masked layout, fp8 quantized on the way, rows
  claimed with remote atomics, ``masked_m`` made on the owner's GPU, a
  sequence-numbered bounded arrival; no host sync.
* ``dispatch``: the baseline dispatch over ``torch.distributed.all_to_all_single``
  (host-synced), and ``Dispatched``, what either dispatch returns.
* ``buffers``: receive buffers in PyTorch symmetric memory, the multicast-off
  environment, the peer address tables.
* ``combine_kernel`` / ``combine``: the signalled combine (CuTe DSL) and its
  host wrapper: polls the down GEMM's completion signals and stores each
  weighted row into the owner rank's receive buffer at (token, top-k slot)
  over NVLink, then signals completion to every peer with a bounded wait;
  ``complete`` is that last step alone, after a down GEMM whose epilogue
  stored the rows itself (``flashgemm.Combine.peers``).
* ``sum_kernel``: the owner's sum of each token's received rows (fixed
  order, fp32: deterministic).
* ``layer``: the whole EP MoE layer in three forms (fused, signalled,
  sequential), with either dispatch; with the device dispatch one CUDA graph.
* ``reference``: the all-gather reference of a layer.
* ``parts``: timing the layer's parts against their bounds (the demo's).
* ``demo``: ``torchrun --nproc-per-node N -m flashgemm.ep.demo``.

Engine: PyTorch symmetric memory (``torch.distributed._symmetric_memory``,
CUDA backend, next to an NCCL process group): it ships with torch, needs no
NVSHMEM bootstrap, and gives what the combine needs, each peer's buffer
address (NVLink peer-to-peer) and a non-multicast signal-pad barrier.
Completion: each rank counts itself into a flags block at the front of every
peer's symmetric buffer (release, system scope) and waits, bounded, for every
peer's count (acquire): no multicast, no host round trip, an error word
instead of a hang. Design and
measurements: ``docs/design.md``, "Expert parallelism across GPUs".
"""

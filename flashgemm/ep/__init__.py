"""Expert parallelism across GPUs: dispatch into the masked layout, the expert
path of ``flashgemm.moe``, and a combine that ships each m-block's rows to the
ranks that own the tokens while the down GEMM still runs.

Modules (one concept each):

* ``plan``: the routing plan (which copy goes to which rank, row and expert;
  the combine's routing back), pure torch.
* ``dispatch``: the baseline dispatch over ``torch.distributed.all_to_all_single``.
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
  sequential).
* ``reference``: the all-gather reference of a layer.
* ``demo``: ``torchrun --nproc-per-node N -m flashgemm.ep.demo``.

Engine: PyTorch symmetric memory (``torch.distributed._symmetric_memory``,
CUDA backend, next to an NCCL process group): it ships with torch, needs no
NVSHMEM bootstrap, and gives what the combine needs, each peer's buffer
address (NVLink peer-to-peer) and a non-multicast signal-pad barrier.
Completion: each rank counts itself into a flags block at the front of every
peer's symmetric buffer (release, system scope) and waits, bounded, for every
peer's count (acquire): no multicast, no host round trip, an error word
instead of a hang. Dispatch: the ``all_to_all_single`` baseline. Design and
measurements: ``docs/design.md``, "Expert parallelism across GPUs".
"""

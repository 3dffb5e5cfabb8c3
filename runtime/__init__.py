"""Runtime: apply a Plan to an nn.Module on torch.distributed.

- ``init_distributed() -> DistInfo`` (runtime.mesh): the process group from RANK / WORLD_SIZE / LOCAL_RANK,
  gloo on CPU, NCCL on CUDA; ``build_mesh(plan, device_type=...)``: the 5-D ("pp","dp","ep","cp","tp") mesh.
- ``apply_plan(model, plan, *, mesh=None, loss_fn=None, seed=0) -> ParallelModel`` (runtime.wrap): TP/SP
  (runtime.tensor_parallel), context parallel (runtime.context_parallel: all-gather K/V attention over the cp
  ranks, load-balanced sequence split), DP/ZeRO over dp x cp (runtime.data_parallel) or the pipeline
  (runtime.pipeline, per-chunk TP/DP); plans with ep > 1 go to runtime.expert_parallel (experts over the ep
  axis, all-to-all dispatch); then meta-device parameters are materialised as local shards (runtime.materialize).
- ``auto_wrap(model, example_inputs, *, loss_fn, plan=None, cluster=None, seed=0) -> ParallelModel``: loads /
  takes / makes the plan on rank 0, broadcasts it, checks model fingerprint and world size, applies it.
- ``ParallelModel``: ``step(inputs, targets) -> loss``, ``parameters()``, ``named_parameters()``,
  ``state_dict()`` / ``load_state_dict()`` (for torch.distributed.checkpoint), ``plan``.
- ``runtime.manual_plan.manual_plan(model, tp=, cp=, dp=, pp=, ...)``: a Plan chosen by hand (tests, examples).
"""

from runtime.mesh import build_mesh, init_distributed
from runtime.wrap import ParallelModel, apply_plan, auto_wrap

__all__ = ["ParallelModel", "apply_plan", "auto_wrap", "build_mesh", "init_distributed"]

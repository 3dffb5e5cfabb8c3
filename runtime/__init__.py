"""Runtime: apply a Plan to an nn.Module on torch.distributed.

- ``init_distributed(timeout_s=None) -> DistInfo`` (runtime.mesh): the process group from RANK / WORLD_SIZE /
  LOCAL_RANK, gloo on CPU, NCCL on CUDA, collectives bounded by a timeout; ``build_mesh(plan, device_type=...)``:
  the 5-D ("pp","dp","ep","cp","tp") mesh over the ranks ordered by node (GROUP_RANK), refusing a torchrun launch
  whose nodes x ranks per node are not the plan's (``check_launch``).
- ``apply_plan(model, plan, *, mesh=None, loss_fn=None, seed=0) -> ParallelModel`` (runtime.apply): checks the plan,
  builds the mesh and runs ``runtime.parallelize.parallelize`` on the whole model or on each local pipeline chunk
  (runtime.pipeline): recomputation (runtime.checkpointing), TP/SP (runtime.tensor_parallel), experts over ep with
  all-to-all dispatch (runtime.expert_parallel), context parallel (runtime.context_parallel), DP/ZeRO
  (runtime.data_parallel), then meta-device parameters materialised as local shards (runtime.materialize).
- ``auto_wrap(model, example_inputs, *, loss_fn, plan=None, cluster=None, seed=0, checkpoint_dir=None,
  checkpoint_every=None, ...) -> ParallelModel`` (runtime.auto_wrap): loads / takes / picks (a directory of plans:
  the one for this world size) / makes the plan on rank 0, broadcasts it, checks model fingerprint and world size,
  applies it, and sets up checkpoints.
- ``ParallelModel`` (runtime.parallel_model): ``step(inputs, targets) -> loss``, ``resume(optimizer) -> step``,
  ``close()``, ``steps_done``, ``parameters()``, ``named_parameters()``, ``state_dict()`` / ``load_state_dict()``
  (for torch.distributed.checkpoint), ``plan``; a collective that fails because another rank died or hung raises
  ``RankFailureError`` naming it and the step (runtime.failures).
- ``runtime.checkpoint.Checkpointer``: distributed checkpoints that reshard on load.
- ``runtime.manual_plan.manual_plan(model, tp=, cp=, dp=, pp=, ...)``: a Plan chosen by hand (tests, examples).
- ``runtime.measure``: this machine and plans on it: calibration (``autopar calibrate``), a plan's measured steps
  (``autopar validate``), and the one helper that starts local ranks (``runtime.measure.spawn``).
"""

from runtime.apply import apply_plan
from runtime.auto_wrap import auto_wrap
from runtime.mesh import build_mesh, init_distributed
from runtime.parallel_model import ParallelModel

__all__ = ["ParallelModel", "apply_plan", "auto_wrap", "build_mesh", "init_distributed"]

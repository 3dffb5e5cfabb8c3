"""Runtime: apply a Plan to an nn.Module on torch.distributed (see runtime/wrap.py)."""

from runtime.mesh import build_mesh, init_distributed
from runtime.wrap import ParallelModel, apply_plan, auto_wrap

__all__ = ["ParallelModel", "apply_plan", "auto_wrap", "build_mesh", "init_distributed"]

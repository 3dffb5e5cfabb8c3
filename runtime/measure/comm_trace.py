"""What a training step really issues: every collective the runtime calls, by mesh axis, op and bytes.

``CollectiveRecorder`` is a ``TorchDispatchMode`` that sees the c10d ops (``c10d.allreduce_``,
``c10d._allgather_base_``, ... : what DDP's C++ reducer, FSDP2 and ``torch.distributed`` calls dispatch) and the
functional collectives DTensor issues (``_c10d_functional.all_reduce``, ...), with the process group each runs on.
``axis_of_groups(mesh)`` names the groups by the plan's mesh axes; ``record_step(pm, inputs, targets,
optimizer)`` runs one ``ParallelModel.step`` and the optimizer step under the recorder and returns
``{(axis, op): [count, total bytes]}`` in the convention of
``costmodel.step.priced_collectives`` (full buffer bytes: the reduced tensor, the gathered output, the scattered
input, the all-to-all input; a send or receive: its tensor). Axes: ``tp`` / ``cp`` / ``ep`` / ``pp`` (groups of
those mesh axes), ``dp`` (the data-parallel wrappers' gradient and parameter traffic on the batch groups: DDP,
FSDP2, replicate, ``average_gradients``), ``loss`` (the step's global-mean loss, ``ParallelModel.step``) and
``other`` (anything else, e.g. DDP's buffer broadcast).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

OPS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced_": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base_": "all_to_all", "alltoall_": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast", "broadcast": "broadcast",
    "send": "send_recv", "recv_": "send_recv", "recv_any_source_": "send_recv",
    "barrier": "barrier",
}
"""c10d / functional op name -> the cost model's collective name."""

_LOSS_SITES = {("runtime/parallel_model.py", "_local_step"), ("runtime/pipeline.py", "step")}
"""(file, function) of the runtime code that all-reduces the step's loss for reporting."""
_OWN_SITES = {"runtime/context_parallel.py": "cp", "runtime/expert_parallel.py": "ep"}
"""Runtime modules that issue their axis' collectives themselves (on groups that may equal dp x cp's)."""


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


def _nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of a c10d ProcessGroup (a dispatcher script object) or a functional collective's group name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(group, str):
        group = _resolve_process_group(group)
    elif not isinstance(group, dist.ProcessGroup):
        group = dist.ProcessGroup.unbox(group)
    return tuple(dist.get_process_group_ranks(group))


def _site() -> str:
    """Which runtime code issued the collective, from the innermost frame outside torch: ``loss`` (the step's
    loss report), ``cp`` / ``ep`` (``runtime.context_parallel`` / ``runtime.expert_parallel``), or ``""``."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename.replace("\\", "/")
        if "/torch/" not in name and "/_python_dispatch" not in name and not name.endswith("comm_trace.py"):
            for key, label in _OWN_SITES.items():
                if name.endswith(key):
                    return label
            for key, func in _LOSS_SITES:
                if name.endswith(key) and f.f_code.co_name == func:
                    return "loss"
            return ""
        f = f.f_back
    return ""


class CollectiveRecorder(TorchDispatchMode):
    """Records ``(op, group ranks, bytes, site)`` of every collective dispatched while active (this thread and the
    autograd threads it starts). ``events`` in call order; ``wait_tensor`` and the like are not collectives."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, tuple[int, ...], int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is DTensor for t in types):
            # modes run before tensor subclasses: hand a DTensor op to DTensor first, so the collectives its
            # sharding propagation issues inside the op (loss parallel, implicit redistributes) come back here
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace in ("c10d", "_c10d_functional"):
            name = func._schema.name.split("::")[-1]
            op = OPS.get(name)
            if op is not None and op != "barrier":
                self.events.append(self._event(op, name, func.namespace, args, out))
        return out

    def _event(self, op: str, name: str, ns: str, args: tuple, out: Any) -> tuple[str, tuple[int, ...], int, str]:
        if ns == "_c10d_functional":
            group = args[-1]
            first = _tensors(args[0])
            if op == "all_gather":
                nbytes = _nbytes(first) * int(args[1])
            else:
                nbytes = _nbytes(first)
        else:
            group = next(a for a in args if not isinstance(a, (torch.Tensor, list, tuple, int, float, str, bool))
                         and a is not None)
            first = _tensors(args[0])
            if op == "reduce_scatter":  # (output, input, ...): the full input
                nbytes = _nbytes(_tensors(args[1]))
            elif op == "all_to_all":  # (output, input, ...)
                nbytes = _nbytes(_tensors(args[1]))
            else:  # all_reduce / broadcast / send / recv: the tensor; all_gather: the output
                nbytes = _nbytes(first)
        return op, _group_ranks(group), nbytes, _site()


def axis_of_groups(mesh) -> dict[tuple[int, ...], list[str]]:
    """Global ranks of each of this rank's mesh-axis groups -> the axis names with those ranks (one group may be
    several axes: dp x cp flattened is the cp group when dp is 1)."""
    from runtime.mesh import grad_mesh

    out: dict[tuple[int, ...], list[str]] = {}
    for axis in mesh.mesh_dim_names:
        sub = mesh[axis]
        if sub.size() > 1:
            out.setdefault(tuple(dist.get_process_group_ranks(sub.get_group())), []).append(axis)
    gm = grad_mesh(mesh)
    if gm.size() > 1:
        out.setdefault(tuple(dist.get_process_group_ranks(gm.get_group())), []).append("grad")
    return out


def summarize(events, groups: dict[tuple[int, ...], list[str]]) -> dict[tuple[str, str], list]:
    """``{(axis, op): [count, total bytes]}`` of recorded events (module docstring for the axes): a group that is
    one mesh axis is that axis; the dp x cp group (``grad``) is ``dp`` unless context parallelism itself issued it
    (when dp is 1 it is also the cp group)."""
    out: dict[tuple[str, str], list] = {}
    for op, ranks, nbytes, site in events:
        axes = groups.get(ranks, [])
        named = [a for a in ("tp", "cp", "ep", "pp") if a in axes]
        if site == "loss" and op == "all_reduce":
            axis = "loss"
        elif site in ("cp", "ep") and site in axes:
            axis = site
        elif named and (op in ("all_to_all", "send_recv") or not ("grad" in axes or "dp" in axes)):
            axis = named[0]  # data-parallel wrappers issue no all-to-all or point-to-point
        elif "grad" in axes or "dp" in axes:
            axis = "dp" if op != "broadcast" else "other"
        else:
            axis = "other"
        row = out.setdefault((axis, op), [0, 0])
        row[0] += 1
        row[1] += nbytes
    return out


def record_step(pm, inputs: torch.Tensor, targets: torch.Tensor, optimizer=None) -> dict[tuple[str, str], list]:
    """One ``pm.step(inputs, targets)`` and ``optimizer.step()`` (DTensor reduces a sequence-parallel norm's
    Partial weight gradient there) under a ``CollectiveRecorder``: this rank's collectives by axis and op."""
    rec = CollectiveRecorder()
    with rec:
        pm.step(inputs, targets)
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return summarize(rec.events, axis_of_groups(pm.mesh))

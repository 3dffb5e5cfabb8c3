"""What autograd keeps for the backward pass, per op of an exported graph: ``saved_bytes_by_node(ep)``.

The exported program runs once under ``FakeTensorMode`` on the CPU device (no memory; CPU so that
``scaled_dot_product_attention`` takes the fused kernel, which saves q, k, v, the output and the log-sum-exp as
the CUDA flash kernels do, where the meta device would take the math path and save the scores; the fused kernel
needs one head dim for q, k and v, so models with a narrower v are built with it zero-padded, see
``planner.mla_attention``), with
``torch.autograd.graph.saved_tensors_hooks`` recording every tensor an op's derivative formula saves. A saved
tensor is charged to the op whose output owns its storage (views share it), or, for a temporary the op made
inside itself (a norm's fp32 statistics, attention's log-sum-exp), to the op that was running; parameters,
buffers and what is made from them alone (cast copies, per-token gathers of expert weights) are not
activations; a storage saved by several ops counts once. This is the eager behaviour, fp32
upcasts, rotary temporaries and GLU intermediates included, not a formula of it.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)


def saved_bytes_by_node(ep: Any) -> dict[str, float] | None:
    """Bytes saved for backward per ``call_function`` node name of ``ep`` (a ``torch.export.ExportedProgram``),
    or None when the graph cannot run on fake tensors (the caller keeps its own estimate)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.export.graph_signature import InputKind

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            args, frozen = _fake_inputs(ep, torch, InputKind)
            return _run(ep, args, frozen, torch)
    except Exception as e:  # noqa: BLE001 - any failure leaves the tracer's own estimate in place
        log.warning("could not replay the exported graph on fake tensors to count saved activations (%s: %s); "
                    "activation bytes fall back to op outputs", type(e).__name__, str(e).splitlines()[0][:200])
        return None


def _storage(t: Any) -> int:
    return t.untyped_storage()._cdata


def _fake_like(val: Any, torch: Any, *, requires_grad: bool = False) -> Any:
    shape = [int(s) for s in val.shape]
    if val.dtype.is_floating_point or val.dtype.is_complex:
        out = torch.empty(shape, dtype=val.dtype, device="cpu")
        return out.requires_grad_(requires_grad)
    return torch.zeros(shape, dtype=val.dtype, device="cpu")


def _fake_inputs(ep: Any, torch: Any, kinds: Any) -> tuple[list[Any], set[int]]:
    """Placeholder values in graph order: parameters requiring grad as the model's do, buffers and constants
    (not activations: their storages are ``frozen``), user inputs from the placeholders' recorded shapes."""
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    args, frozen = [], set()
    for node, spec in zip(placeholders, ep.graph_signature.input_specs):
        val = node.meta.get("val")
        if spec.kind == kinds.PARAMETER:
            src = ep.state_dict.get(spec.target)
            t = _fake_like(val, torch, requires_grad=bool(getattr(src, "requires_grad", True)))
            frozen.add(_storage(t))
        elif spec.kind in (kinds.BUFFER, kinds.CONSTANT_TENSOR):
            t = _fake_like(val, torch)
            frozen.add(_storage(t))
        else:
            t = _fake_like(val, torch) if hasattr(val, "shape") else val
        args.append(t)
    return args, frozen


def _run(ep: Any, args: list[Any], frozen: set[int], torch: Any) -> dict[str, float]:
    from torch.fx import Interpreter

    produced: dict[int, str] = {}
    alive: list[Any] = []  # every output stays referenced, so no storage address is reused during the replay
    saved: dict[int, tuple[str, float]] = {}
    current = [""]

    def pack(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            sid = _storage(t)
            if sid not in frozen and sid not in saved:
                saved[sid] = (produced.get(sid, current[0]), float(t.untyped_storage().nbytes()))
        return t

    class _Replay(Interpreter):
        def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
            # factories traced on meta (position ids, masks) are made on the replay's CPU device
            kwargs = {k: (torch.device("cpu") if k == "device" and getattr(v, "type", v) == "meta" else v)
                      for k, v in kwargs.items()}
            args = tuple(torch.device("cpu") if isinstance(a, torch.device) and a.type == "meta" else a
                         for a in args)
            return super().call_function(target, args, kwargs)

        def run_node(self, n: Any) -> Any:
            current[0] = n.name if n.op == "call_function" else ""
            out = super().run_node(n)
            if n.op == "call_function":
                weights_only = _from_weights(n, self.env, frozen, torch)
                for t in _tensors(out, torch):
                    produced.setdefault(_storage(t), n.name)
                    alive.append(t)
                    if weights_only:
                        frozen.add(_storage(t))
            return out

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _Replay(ep.graph_module).run(*args)
    out: dict[str, float] = {}
    for name, nbytes in saved.values():
        if name:
            out[name] = out.get(name, 0.0) + nbytes
    return out


_VIEWS_AND_CASTS = ("aten.to.", "aten._to_copy", "aten.t.", "aten.view", "aten.reshape", "aten.expand", "aten.transpose",
                    "aten.permute", "aten.unsqueeze", "aten.squeeze", "aten.alias", "aten.detach", "aten.contiguous",
                    "aten.clone", "aten.slice", "aten.select")
_GATHERS = ("aten.index.", "aten.index_select", "aten.embedding", "aten._unsafe_index", "aten.gather")


def _from_weights(node: Any, env: dict, frozen: set[int], torch: Any) -> bool:
    """Whether ``node`` makes a weight, not an activation: a cast or view of parameters / buffers (a bf16 copy
    under autocast), or a per-token gather from a stacked expert weight (>= 3 dimensions: HF's ``batched_mm``
    experts; grouped-GEMM kernels read the weights in place). A lookup in a 2-D embedding table is an
    activation (the hidden states)."""
    target = str(node.target)
    inputs = [t for a in node.all_input_nodes for t in _tensors(env.get(a), torch)]
    floats = [t for t in inputs if t.dtype.is_floating_point]
    if not floats or not all(_storage(t) in frozen for t in floats):
        return False
    if target.startswith(_VIEWS_AND_CASTS):
        return True
    return target.startswith(_GATHERS) and all(t.dim() >= 3 for t in floats)


def _tensors(value: Any, torch: Any) -> list[Any]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v, torch)]
    return []

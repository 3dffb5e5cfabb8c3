"""What autograd keeps for the backward pass, per op of an exported graph: ``saved_bytes_by_node(ep)`` (and, from
the same replay, the dtypes each op returns: ``replay_forward``).

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
upcasts, rotary temporaries and GLU intermediates included, not a formula of it. With ``autocast=True`` both
replays run under bf16 ``torch.autocast`` (the export of a model with fp32 parameters, as the runtime computes
it without FSDP2's mixed precision); the bf16 casts autocast makes of parameters inside an op are weights too.

``backward_excess_by_node(ep, block_of)`` replays the forward again with tensors freed as eager frees them and
then runs the backward, counting live storages (``_LiveStorages``): per op, the most bytes its backward holds
beyond what was live when its block's backward began, less the parameter gradients (model states; the gradient
of a weight made from parameters alone, a cast copy or the per-token gather of stacked expert weights, counts as
one, as the forward counts that weight no activation: a grouped-GEMM kernel writes the experts' weight gradients
in place, and autopar's expert-parallel loop runs each local expert's own weight): the
gradient flowing into the block, the gradients of its intermediate tensors and autograd's temporaries, net of
the saved activations the block's backward has freed by then.
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

log = logging.getLogger(__name__)


class ForwardReplay(NamedTuple):
    """What one replay of an exported forward finds (``replay_forward``)."""

    saved: dict[str, float]
    """Bytes saved for backward per ``call_function`` node name."""
    dtypes: dict[str, tuple[str, ...]]
    """Per node name (placeholders too): the dtypes of the tensors it returned in the replay, ``float32`` style.
    Under autocast they are the dtypes the runtime computes in (a linear's bf16 output beside an fp32 residual
    stream), where the export's own metadata holds the fp32 model's."""


def replay_forward(ep: Any, *, autocast: bool = False) -> ForwardReplay | None:
    """Replay the forward of ``ep`` (a ``torch.export.ExportedProgram``) once on fake tensors: the bytes saved
    for backward per ``call_function`` node and the dtypes every node returned; None when the graph cannot run
    on fake tensors (the caller keeps its own estimate). ``autocast``: replay under
    ``torch.autocast(dtype=bfloat16)`` (the export of a model with fp32 parameters, as the runtime computes it
    there; see the module docstring)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.export.graph_signature import InputKind

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            args, frozen = _fake_inputs(ep, torch, InputKind)
            with _autocast(autocast, torch), _weight_casts(autocast, frozen, torch):
                return _run(ep, args, frozen, torch)
    except Exception as e:  # noqa: BLE001 - any failure leaves the tracer's own estimate in place
        log.warning("could not replay the exported graph on fake tensors to count saved activations (%s: %s); "
                    "activation bytes fall back to op outputs", type(e).__name__, str(e).splitlines()[0][:200])
        return None


def saved_bytes_by_node(ep: Any, *, autocast: bool = False) -> dict[str, float] | None:
    """Bytes saved for backward per ``call_function`` node name of ``ep``, or None when the graph cannot run on
    fake tensors: ``replay_forward(ep, autocast=autocast).saved``."""
    replay = replay_forward(ep, autocast=autocast)
    return None if replay is None else replay.saved


def backward_excess_by_node(ep: Any, block_of: dict[str, str], *, autocast: bool = False) -> dict[str, float] | None:
    """Per ``call_function`` node name of ``ep``: the most bytes live while its backward runs beyond those live
    when the backward of its block (``block_of``: node name -> block) began, less parameter gradients, plus the
    gradients made by the backward before and still alive then (what flows into the block). None when the
    graph cannot run on fake tensors. ``autocast``: forward and backward under bf16 autocast, as
    ``saved_bytes_by_node``. See the module docstring."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.export.graph_signature import InputKind

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            args, frozen = _fake_inputs(ep, torch, InputKind)
            with _autocast(autocast, torch):
                return _run_backward(ep, args, block_of, torch, frozen)
    except Exception as e:  # noqa: BLE001 - any failure leaves the backward's working bytes unpriced
        log.warning("could not replay the exported graph's backward on fake tensors (%s: %s); the backward's "
                    "working bytes are not priced", type(e).__name__, str(e).splitlines()[0][:200])
        return None


def _autocast(on: bool, torch: Any) -> Any:
    """bf16 autocast on the replay's CPU device, as the runtime computes fp32 parameters (``on``), or nothing."""
    import contextlib

    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def _weight_casts(on: bool, frozen: set[int], torch: Any) -> Any:
    """Under autocast (``on``): a ``TorchDispatchMode`` that adds to ``frozen`` the storages of the casts and
    views autocast makes of parameters inside an op (the bf16 copy of a linear's weight, which its backward
    saves): weights, priced as the target's ``autocast_weight_copies``, not activations (the rule
    ``_from_weights`` applies to the graph's own nodes). Otherwise nothing."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    if not on:
        return contextlib.nullcontext()

    class _WeightCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if str(func).startswith(_VIEWS_AND_CASTS):
                floats = [t for t in _tensors([*args, *kwargs.values()], torch) if t.dtype.is_floating_point]
                if floats and all(_storage(t) in frozen for t in floats):
                    frozen.update(_storage(t) for t in _tensors(out, torch))
            return out

    return _WeightCasts()


def _live_storages(torch: Any) -> Any:
    """A ``TorchDispatchMode`` class that counts the bytes of the storages ops return until they are freed
    (weakref finalizers on the storages, as ``torch.distributed._tools.mem_tracker`` counts), ``total``, and
    those made since ``mark`` was set (``since_mark``); ``on_op`` is called after every op."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    class _LiveStorages(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, tuple[int, bool]] = {}
            self.total = self.since_mark = 0
            self.marking = False
            self.on_op = lambda: None

        def _free(self, key: int) -> None:
            nbytes, marked = self.live.pop(key, (0, False))
            self.total -= nbytes
            self.since_mark -= nbytes if marked else 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            for t in _tensors(out, torch):
                st = t.untyped_storage()
                key = st._cdata
                if key not in self.live:
                    self.live[key] = (st.nbytes(), self.marking)
                    self.total += st.nbytes()
                    self.since_mark += st.nbytes() if self.marking else 0
                    weakref.finalize(st, self._free, key)
            self.on_op()
            return out

    return _LiveStorages


def _run_backward(ep: Any, args: list[Any], block_of: dict[str, str], torch: Any,
                  frozen: set[int]) -> dict[str, float]:
    params = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grad_fns: dict[Any, str] = {}
    excess: dict[str, float] = {}
    state = {"node": "", "block": None, "base": 0.0}
    counter = _live_storages(torch)()

    def grads_bytes() -> int:
        return sum({_storage(p.grad): p.grad.untyped_storage().nbytes() for p in params
                    if p.grad is not None}.values())

    def held() -> float:  # live bytes that are not parameter gradients
        return float(counter.total - grads_bytes())

    def record() -> None:
        name = state["node"]
        if name:
            excess[name] = max(excess.get(name, 0.0), held() - state["base"])

    def enter(name: str) -> None:
        block = block_of.get(name)
        if block != state["block"]:  # this block's backward begins: what flows in is what the backward made
            grads_in = float(counter.since_mark - grads_bytes())
            state.update(block=block, base=held() - grads_in)
        state["node"] = name
        record()

    def as_weight(t: Any) -> Any:
        """A weight made from parameters alone (``_from_weights``), detached: its gradient is a parameter
        gradient, a model state (a grouped-GEMM kernel writes the experts' weight gradients into the
        parameters' in place, with no per-token copy; a cast copy's gradient is the parameter's), as the forward
        counts that weight no activation."""
        frozen.add(_storage(t))
        return t.detach() if t.requires_grad else t

    class _Forward(_cpu_interpreter(torch)):
        def run_node(self, n: Any) -> Any:
            out = super().run_node(n)
            if n.op == "call_function" and _from_weights(n, self.env, frozen, torch):
                out = as_weight(out) if isinstance(out, torch.Tensor) else out
            elif n.op == "call_function":
                for t in _tensors(out, torch):
                    fn = t.grad_fn
                    if fn is not None and fn not in grad_fns:
                        grad_fns[fn] = n.name
                        fn.register_prehook(lambda grads, name=n.name: enter(name))
            return out

    counter.on_op = record
    with torch.enable_grad(), counter:
        outs = [t for t in _tensors(_Forward(ep.graph_module).run(*args), torch) if t.requires_grad]
        seeds = [torch.ones_like(t) for t in outs]
        counter.marking = True
        torch.autograd.backward(outs, seeds)
    return excess


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


def _cpu_interpreter(torch: Any) -> type:
    """An ``fx.Interpreter`` that makes on the replay's CPU device the factories traced on meta (position ids,
    masks), and skips the export's checks of the dtypes it traced (``aten._assert_tensor_metadata``: they
    allocate nothing, and under autocast the replay's dtypes differ from the export's by design)."""
    from torch.fx import Interpreter

    def on_cpu(v: Any) -> Any:
        return torch.device("cpu") if isinstance(v, torch.device) and v.type == "meta" else v

    class _OnCpu(Interpreter):
        def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
            if target is torch.ops.aten._assert_tensor_metadata.default:
                return None
            kwargs = {k: (torch.device("cpu") if k == "device" and getattr(v, "type", v) == "meta" else v)
                      for k, v in kwargs.items()}
            return super().call_function(target, tuple(on_cpu(a) for a in args), kwargs)

    return _OnCpu


def _run(ep: Any, args: list[Any], frozen: set[int], torch: Any) -> ForwardReplay:
    produced: dict[int, str] = {}
    dtypes: dict[str, tuple[str, ...]] = {}
    alive: list[Any] = []  # every output stays referenced, so no storage address is reused during the replay
    saved: dict[int, tuple[str, float]] = {}
    current = [""]

    def pack(t: Any) -> Any:
        if isinstance(t, torch.Tensor):
            sid = _storage(t)
            if sid not in frozen and sid not in saved:
                saved[sid] = (produced.get(sid, current[0]), float(t.untyped_storage().nbytes()))
        return t

    class _Replay(_cpu_interpreter(torch)):
        def run_node(self, n: Any) -> Any:
            current[0] = n.name if n.op == "call_function" else ""
            out = super().run_node(n)
            dtypes[n.name] = tuple(str(t.dtype).removeprefix("torch.") for t in _tensors(out, torch))
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
    return ForwardReplay(saved=out, dtypes=dtypes)


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

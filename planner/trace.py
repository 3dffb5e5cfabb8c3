"""``trace(model, example_inputs) -> OpGraph``: torch.export (non-strict) on meta / fake tensors.

Every ``call_function`` node of the exported (pre-dispatch, training) aten graph becomes an ``OpNode`` with
its shapes, dtypes, FLOP rule (``planner.flops``), bytes, the parameters it reads and the module it came from
(``nn_module_stack``); every tensor flowing between two ops becomes an ``Edge`` with its size.

The depth shortcut (why a 126-layer model traces in seconds): torch.export costs ~10 ms per op, and a
transformer's layers are identical. Unless ``full_depth=True``, ``trace`` finds the model's layer list (the
``nn.ModuleList`` holding the most parameters, ``find_layer_list``), keeps the first two layers of every distinct layer structure (class, parameter
names / shapes / dtypes, ``attention_type``): 2 layers for Llama 3 405B, 4 for an alternating pattern. It
swaps that shorter list into the model for the duration of the export (restored in ``finally``), and expands
the traced layers back to the full depth: layer ``i`` gets a copy of the second traced layer of its
structure (the one fed by another layer), with module and parameter FQNs renamed
(``model.layers.1.mlp`` -> ``model.layers.i.mlp``), and the residual stream is re-linked layer to layer.
Two checks guard it: the traced copies of one structure must have identical op signatures, and the
stream between layers must have the same arity everywhere; otherwise ``trace`` falls back to exporting the
full depth. ``OpGraph.traced_layers`` says how many layers were exported. The totals are exact: tests check
``graph.params`` against ``sum(p.numel())`` of the full model and the FLOPs against the analytic formulas.

Blocks: ops of a layer's modules belong to that layer, ops before the first layer to ``embedding``, after the
last to ``head``; ops the root module runs between two layers count to the layer before them, so blocks are
contiguous and in execution order. ``cast_floating`` casts float example inputs to the model's dtype.

Attention masks: HF causal LMs pass an explicit (Sq, Sk) boolean mask to sdpa; with ``causal_mask=True``
(default) an attention with a mask is counted as causal in ``causal_fraction`` (dense counts stay). An attention
whose v is a zero padding of a narrower v (``planner.mla_attention``, ``planner.sink_attention``: one head dim for
the fused kernel) has the FLOPs of the unpadded v; its bytes are the padded tensors'.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import time
import traceback
from collections import Counter
from dataclasses import replace
from typing import Any, Iterator

from costmodel.errors import UnsupportedModelError
from planner.flops import op_class_of, op_cost, op_name
from planner.graph import Edge, OpGraph, OpNode, op_signature
from planner.saved import backward_excess_by_node, replay_forward

log = logging.getLogger(__name__)

_GATHER_OPS = frozenset({"index", "index_select", "gather", "_unsafe_index"})


def find_layer_list(model: Any) -> tuple[str, Any] | None:
    """(FQN, ModuleList) of the model's repeated layers: of the ``nn.ModuleList`` s of two or more modules, the
    one holding the most parameters (the outermost stack: not a list of attention heads or experts inside a
    layer), then the longest, then the one with fewer module classes, then the first. ``nn.TransformerEncoder``
    keeps its layers in ``.layers``. None when the model has no such list."""
    import torch.nn as nn

    best, best_key = None, None
    for fqn, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2:
            params = sum(p.numel() for p in mod.parameters())
            key = (params, len(mod), -len({type(m) for m in mod}))
            if best_key is None or key > best_key:
                best, best_key = (fqn, mod), key
    return best


def cast_floating(example_inputs: tuple, dtype: Any) -> tuple:
    """``example_inputs`` with floating-point tensors cast to ``dtype`` (the model's training dtype); integer
    tensors (token ids) and non-tensors as they are."""
    import torch
    from torch.utils import _pytree as pytree

    return pytree.tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t,
                                tuple(example_inputs))


def trace(model: Any, example_inputs: tuple, *, full_depth: bool = False, causal_mask: bool = True,
          autocast: bool = False) -> OpGraph:
    """Trace ``model(*example_inputs)`` into an ``OpGraph`` (see the module docstring for the depth shortcut).

    ``autocast``: the saved activations and the backward's working bytes (``planner.saved``) are those of the
    graph run under bf16 ``torch.autocast`` (a model with fp32 parameters computed as the runtime computes it
    without FSDP2's mixed precision: fp32 residual stream and norms, bf16 matmuls), and so are each op's input
    and output dtypes; the export, and so the ops, shapes, FLOPs and traced bytes, are the model's own."""
    t0 = time.perf_counter()
    found = find_layer_list(model)
    graph = None
    if found is not None and not full_depth and len(found[1]) > 2:
        graph = _trace_shortcut(model, example_inputs, found, causal_mask=causal_mask, autocast=autocast)
    if graph is None:
        layer_fqns = tuple(f"{found[0]}.{i}" for i in range(len(found[1]))) if found else ()
        ep = export_model(model, example_inputs)
        graph = _graph_from_export(ep, layer_parent=found[0] if found else None, layer_fqns=layer_fqns,
                                   causal_mask=causal_mask, autocast=autocast)
    unsupported = tuple(sorted(Counter(op_name_of(n) for n in graph.nodes if not n.covered).items()))
    return replace(graph, unsupported=unsupported, module_kinds=module_kinds(model),
                   trace_time_s=time.perf_counter() - t0)


def module_kinds(model: Any) -> tuple[tuple[str, str], ...]:
    """(FQN, ``linear`` / ``embedding``) of the ``nn.Linear`` / ``nn.Embedding`` modules (``OpGraph.module_kinds``)."""
    import torch.nn as nn

    kinds = []
    for fqn, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            kinds.append((fqn, "linear"))
        elif isinstance(mod, nn.Embedding):
            kinds.append((fqn, "embedding"))
    return tuple(kinds)


def op_name_of(node: OpNode) -> str:
    return node.target.removeprefix("aten.")


# --- export and its errors ----------------------------------------------------------------------------------


def export_model(model: Any, example_inputs: tuple) -> Any:
    """``torch.export`` (non-strict) of ``model`` as the tracer runs it (eager attention masks), typed errors."""
    import torch

    err = io.StringIO()
    try:
        with _eager_causal_masks(), contextlib.redirect_stderr(err):
            return torch.export.export(model, tuple(example_inputs), strict=False)
    except Exception as e:  # noqa: BLE001 - every export failure becomes one typed error
        # torch.export prints the partial graph of a failed export to stderr: the error below says where
        partial = str(getattr(e, "partial_fx_graph", "") or "")
        err = io.StringIO(err.getvalue().replace(partial, "") if partial else err.getvalue())
        raise UnsupportedModelError(_explain_export_failure(model, e)) from None
    finally:
        if err.getvalue().strip():  # warnings torch printed while exporting
            log.warning("torch.export: %s", err.getvalue().strip())


@contextlib.contextmanager
def _eager_causal_masks() -> Iterator[None]:
    """Trace the attention the training runtime runs. Under torch.export, transformers materialises the causal
    mask (an exported model may serve other shapes, and packed sequences cannot be ruled out without reading the
    position ids) and then repeats K / V for grouped-query attention; eagerly, unpacked full-length training
    sequences pass no mask: ``is_causal=True`` with ``enable_gqa`` (flash kernels, K / V not repeated). The
    saved activations and the attention kernel differ, so for the duration of the export transformers' mask
    code is told what eager execution finds (``transformers.masking_utils``: not exporting, no packing)."""
    try:
        import transformers.masking_utils as masking
    except ImportError:  # no transformers: nothing to undo
        yield
        return
    eager = {"is_torchdynamo_exporting": lambda: False, "find_packed_sequence_indices": lambda position_ids: None}
    original = {name: getattr(masking, name) for name in eager if hasattr(masking, name)}
    for name in original:
        setattr(masking, name, eager[name])
    try:
        yield
    finally:
        for name, fn in original.items():
            setattr(masking, name, fn)


def _explain_export_failure(model: Any, exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    first = text.strip().splitlines()[0][:300]
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "/torch/" not in f.filename and "/planner/trace.py" not in f.filename]
    where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
    user = re.search(r'File "([^"]+)", line (\d+)', text)
    if not where and user:
        where = f" at {user.group(1)}:{user.group(2)}"
    op = re.search(r"(aten\.\w+(?:\.\w+)?)", text)
    op_part = f" in op {op.group(1)}" if op else ""
    hf = type(model).__module__.startswith("transformers")
    return (f"torch.export could not trace {type(model).__name__}{op_part}{where}: {first}. "
            f"Suggestion: {_suggestion(text, hf=hf)}")


def _suggestion(text: str, *, hf: bool) -> str:
    low = text.lower()
    if ("dtype" in low or "type" in low) and ("should be the same" in low or "expected" in low) and (
            "float" in low or "half" in low or "bfloat16" in low):
        return ("cast float example inputs to the model's dtype (planner.trace.cast_floating), or build them "
                "with the dtype of the parameters")
    if "grouped_mm" in low or "expert" in low or "histc" in low:
        return 'build MoE models with experts_implementation="batched_mm" (transformers)'
    if hf and ("flash" in low or "flex" in low or "attention" in low):
        return 'build the model with attn_implementation="sdpa"'
    if "data-dependent" in low or "guardondatadependent" in low or "item()" in low or "nonzero" in low:
        return ("remove data-dependent control flow (Python if on tensor values, .item(), nonzero) from forward, "
                "or guard it with torch._check; meta tensors have no values")
    if hf:
        return ("check that model(*example_inputs) runs on meta tensors; for Hugging Face models pass "
                'attn_implementation="sdpa" and use_cache=False')
    return "check that model(*example_inputs) runs on meta tensors (no .item(), no data-dependent Python control flow)"


# --- the depth shortcut -------------------------------------------------------------------------------------


def _structure_key(layer: Any) -> tuple:
    params = tuple((n, tuple(p.shape), str(p.dtype)) for n, p in layer.named_parameters())
    attrs = tuple(repr(getattr(layer, a, None)) for a in ("attention_type", "sliding_window", "is_sliding"))
    return (type(layer).__name__, params, attrs)


def _representatives(layers: Any) -> tuple[list[int], list[int], list[tuple]]:
    """(keep: full indices to trace, rep: full index -> position in keep, structure key of each kept layer).

    The first two layers of every structure are traced (so a repeated structure is seen fed by another layer,
    and its two copies can be compared); every other layer copies the second one of its structure.
    """
    keys = [_structure_key(layer) for layer in layers]
    seen: dict[tuple, list[int]] = {}
    for i, k in enumerate(keys):
        if len(seen.setdefault(k, [])) < 2:
            seen[k].append(i)
    keep = sorted(i for idx in seen.values() for i in idx)
    pos = {full: j for j, full in enumerate(keep)}
    rep = [pos[i] if i in pos else pos[seen[keys[i]][-1]] for i in range(len(keys))]
    return keep, rep, [keys[i] for i in keep]


@contextlib.contextmanager
def _swapped_layers(model: Any, parent_fqn: str, keep: list[int]) -> Iterator[None]:
    import torch.nn as nn

    owner_fqn, _, attr = parent_fqn.rpartition(".")
    owner = model.get_submodule(owner_fqn) if owner_fqn else model
    full = getattr(owner, attr)
    setattr(owner, attr, nn.ModuleList([full[i] for i in keep]))
    try:
        yield
    finally:
        setattr(owner, attr, full)


def _trace_shortcut(model: Any, example_inputs: tuple, found: tuple[str, Any], *,
                    causal_mask: bool, autocast: bool = False) -> OpGraph | None:
    parent, layers = found
    keep, rep, keys = _representatives(layers)
    with _swapped_layers(model, parent, keep):
        ep = export_model(model, example_inputs)
    reduced_fqns = tuple(f"{parent}.{j}" for j in range(len(keep)))
    reduced = _graph_from_export(ep, layer_parent=parent, layer_fqns=reduced_fqns, causal_mask=causal_mask,
                                 autocast=autocast)
    full_fqns = tuple(f"{parent}.{i}" for i in range(len(layers)))
    graph = _expand(reduced, rep=rep, keys=keys, full_fqns=full_fqns)
    if graph is None:
        log.warning("layer shortcut did not verify for %s; exporting all %d layers", parent, len(layers))
        return None
    log.info("traced %d of %d layers of %s, expanded to the full depth", len(keep), len(layers), parent)
    return graph


def _rename(fqn: str, src: str, dst: str) -> str:
    if fqn == src:
        return dst
    if fqn.startswith(src + "."):
        return dst + fqn[len(src):]
    return fqn


def _expand(reduced: OpGraph, *, rep: list[int], keys: list[tuple], full_fqns: tuple[str, ...]) -> OpGraph | None:
    """Copy each full layer from its representative; None when the structure does not allow it."""
    red_fqns = reduced.layer_fqns
    groups: dict[str, list[OpNode]] = {b: [] for b in ("embedding", *red_fqns, "head")}
    for n in reduced.nodes:
        groups[n.block].append(n)
    # traced copies of one layer structure must have traced to identical op sequences
    sig_of_key: dict[tuple, str] = {}
    for fqn, key in zip(red_fqns, keys):
        sig = op_signature(groups[fqn], fqn)
        if sig_of_key.setdefault(key, sig) != sig:
            return None
    links = _classify_edges(reduced)
    if links is None:
        return None
    try:
        return _materialize(reduced, groups, links, rep=rep, full_fqns=full_fqns)
    except (KeyError, IndexError):  # a layer's stream slots have no counterpart in its predecessor
        return None


def _classify_edges(reduced: OpGraph) -> dict | None:
    """Split the reduced graph's edges into fixed, intra-layer, broadcast (pre -> layer) and stream edges."""
    red = {f: j for j, f in enumerate(reduced.layer_fqns)}
    block_of = {n.name: n.block for n in reduced.nodes}
    pos = lambda name: red.get(block_of[name], -1 if block_of[name] == "embedding" else len(red))  # noqa: E731
    consumers: dict[str, set[int]] = {}
    for e in reduced.edges:
        if pos(e.src) == -1 and 0 <= pos(e.dst) < len(red):
            consumers.setdefault(e.src, set()).add(pos(e.dst))
    out_lists: dict[int, list[str]] = {}
    fixed, intra, bcast, stream = [], [], [], []
    for e in reduced.edges:
        a, b = pos(e.src), pos(e.dst)
        if a == b and 0 <= a < len(red):
            intra.append((a, e))
        elif a in (-1, len(red)) and b in (-1, len(red)):
            fixed.append(e)
        elif a == -1 and consumers[e.src] != {0}:
            bcast.append((b, e))
        elif b == a + 1:  # pre -> layer 0, layer j -> j + 1, last layer -> head
            out = out_lists.setdefault(a, [])
            if e.src not in out:
                out.append(e.src)
            stream.append((b, out.index(e.src), e))
        else:
            return None
    arity = {len(v) for k, v in out_lists.items() if k >= 0}
    if len(arity) > 1:
        return None
    return {"fixed": fixed, "intra": intra, "bcast": bcast, "stream": stream, "out": out_lists}


def _materialize(reduced: OpGraph, groups: dict[str, list[OpNode]], links: dict, *, rep: list[int],
                 full_fqns: tuple[str, ...]) -> OpGraph:
    red_fqns = reduced.layer_fqns
    nk = len(red_fqns)
    name_in = lambda name, i: f"{name}@{i}"  # noqa: E731
    nodes = list(groups["embedding"])
    for i, j in enumerate(rep):
        src, dst = red_fqns[j], full_fqns[i]
        for n in groups[src]:
            nodes.append(replace(
                n, name=name_in(n.name, i), block=dst, module_fqn=_rename(n.module_fqn, src, dst),
                params=tuple((_rename(f, src, dst), s, d) for f, s, d in n.params)))
    nodes.extend(groups["head"])
    edges = list(links["fixed"])
    for i, j in enumerate(rep):
        edges.extend(Edge(src=name_in(e.src, i), dst=name_in(e.dst, i), nbytes=e.nbytes)
                     for a, e in links["intra"] if a == j)
        edges.extend(Edge(src=e.src, dst=name_in(e.dst, i), nbytes=e.nbytes) for b, e in links["bcast"] if b == j)
    out = links["out"]
    last = len(rep) - 1
    for b, q, e in links["stream"]:
        if b == nk:  # into the head, from the last full layer
            edges.append(Edge(src=name_in(out[rep[last]][q], last), dst=e.dst, nbytes=e.nbytes))
            continue
        for i, j in enumerate(rep):
            if j != b:
                continue
            src = e.src if i == 0 else name_in(out[rep[i - 1]][q], i - 1)
            edges.append(Edge(src=src, dst=name_in(e.dst, i), nbytes=e.nbytes))
    param_sizes: dict[str, int] = {}
    for n in nodes:
        for f, shape, _ in n.params:
            if f not in param_sizes:
                param_sizes[f] = _numel(shape)
    return replace(reduced, nodes=tuple(nodes), edges=tuple(edges), param_sizes=tuple(param_sizes.items()),
                   layer_fqns=full_fqns, traced_layers=nk)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# --- exported program -> OpGraph ----------------------------------------------------------------------------


def _graph_from_export(ep: Any, *, layer_parent: str | None, layer_fqns: tuple[str, ...],
                       causal_mask: bool, autocast: bool = False) -> OpGraph:
    import torch

    sig = ep.graph_signature
    param_of = dict(sig.inputs_to_parameters)
    state = ep.state_dict
    grad: dict[str, bool] = {}
    eff_bytes: dict[str, float] = {}
    for ph in ep.graph.nodes:
        if ph.op != "placeholder":
            continue
        fqn = param_of.get(ph.name)
        grad[ph.name] = bool(fqn is not None and getattr(state.get(fqn), "requires_grad", True))
    layer_set = set(layer_fqns)
    replay = replay_forward(ep, autocast=autocast)
    saved = replay.saved if replay is not None else {}
    # under autocast, each op's dtypes as the replay ran it (the export's metadata holds the fp32 model's)
    ran_as = replay.dtypes if replay is not None and autocast else None
    nodes: list[OpNode] = []
    edges: dict[tuple[str, str], float] = {}
    param_sizes: dict[str, int] = {}
    last_layer, pending = "", []  # ops outside the layers since the last layer op (head, or between layers)
    for fx in ep.graph.nodes:
        if fx.op != "call_function":
            continue
        node = _make_node(fx, param_of=param_of, grad=grad, eff_bytes=eff_bytes, causal_mask=causal_mask,
                          torch=torch)
        block = _layer_of(node.module_fqn, layer_parent, layer_set)
        if block:
            for i in pending:  # the root ran them between two layers: they count to the layer before
                nodes[i] = replace(nodes[i], block=last_layer)
            last_layer, pending = block, []
        elif last_layer:
            block = "head"
            pending.append(len(nodes))
        else:
            block = "embedding"
        if ran_as is not None:
            node = replace(node, output_dtypes=ran_as.get(fx.name, node.output_dtypes),
                           input_dtypes=tuple(d for a in _tensor_inputs(fx) for d in ran_as.get(a.name, ())[:1]
                                              if hasattr(a.meta.get("val"), "dtype")))
        nodes.append(replace(node, block=block, saved_bytes=saved.get(fx.name, 0.0) if saved else None))
        for f, shape, _ in node.params:
            param_sizes.setdefault(f, _numel(shape))
        for src in _tensor_inputs(fx):
            if src.op == "call_function":
                edges[(src.name, fx.name)] = eff_bytes.get(src.name, 0.0)
    backward = backward_excess_by_node(ep, {n.name: n.block for n in nodes}, autocast=autocast) if saved else None
    if backward is not None:
        nodes = [replace(n, backward_bytes=backward.get(n.name, 0.0)) for n in nodes]
    return OpGraph(nodes=tuple(nodes), edges=tuple(Edge(src=s, dst=d, nbytes=b) for (s, d), b in edges.items()),
                   param_sizes=tuple(param_sizes.items()), layer_fqns=layer_fqns, traced_layers=len(layer_fqns))


def _layer_of(module_fqn: str, parent: str | None, layers: set[str]) -> str:
    if not parent or not module_fqn.startswith(parent + "."):
        return ""
    idx = module_fqn[len(parent) + 1:].split(".", 1)[0]
    fqn = f"{parent}.{idx}"
    return fqn if fqn in layers else ""


def _tensor_inputs(fx: Any) -> list[Any]:
    out: list[Any] = []
    for a in (*fx.args, *fx.kwargs.values()):
        for x in a if isinstance(a, (list, tuple)) else (a,):
            if hasattr(x, "op") and x not in out:
                out.append(x)
    return out


def _vals(v: Any) -> list[Any]:
    if isinstance(v, (list, tuple)):
        return [x for x in v if hasattr(x, "shape")]
    return [v] if hasattr(v, "shape") else []


def _nbytes(t: Any) -> float:
    return float(t.numel() * t.element_size())


def _unpadded_value_shape(v: Any) -> tuple[int, ...] | None:
    """Shape of an attention's value before zero padding of its last dim (``planner.mla_attention`` pads a v
    narrower than q / k to their head dim for the fused kernel): the padded columns are no work for a kernel
    taking the narrower v (FlashAttention-3), so FLOPs use this shape. None when v is not such a padding."""
    if not hasattr(v, "target") or op_name(v.target) not in ("pad", "constant_pad_nd") or len(v.args) < 2:
        return None
    src, pad = v.args[0], v.args[1]
    mode = v.args[2] if len(v.args) > 2 and op_name(v.target) == "pad" else v.kwargs.get("mode", "constant")
    value = v.args[-1] if len(v.args) > (3 if op_name(v.target) == "pad" else 2) else v.kwargs.get("value")
    val = src.meta.get("val") if hasattr(src, "meta") else None
    if (mode != "constant" or value not in (None, 0, 0.0) or not hasattr(val, "shape")
            or not isinstance(pad, (list, tuple)) or len(pad) != 2 or pad[0] != 0 or not isinstance(pad[1], int)
            or pad[1] <= 0):
        return None
    return tuple(val.shape)


def _make_node(fx: Any, *, param_of: dict, grad: dict, eff_bytes: dict, causal_mask: bool, torch: Any) -> OpNode:
    name = op_name(fx.target)
    arg_list = list(fx.args)
    if "attn_mask" in fx.kwargs and len(arg_list) == 3:
        arg_list.append(fx.kwargs["attn_mask"])
    in_shapes, grads = [], []
    for a in arg_list:
        v = a.meta.get("val") if hasattr(a, "meta") else None
        in_shapes.append(tuple(v.shape) if hasattr(v, "shape") else None)
        grads.append(bool(hasattr(a, "name") and grad.get(a.name, False)))
    outs = _vals(fx.meta.get("val"))
    kwargs = {k: v for k, v in fx.kwargs.items() if isinstance(v, (bool, int, float))}
    schema = getattr(fx.target, "_schema", None)
    for arg, value in zip(schema.arguments if schema is not None else (), fx.args):
        if isinstance(value, (bool, int, float)):  # positional scalars (sdpa's is_causal) by their schema name
            kwargs.setdefault(arg.name, value)
    cost_shapes = list(in_shapes)
    if op_class_of(name) == "attention" and len(arg_list) > 2:
        cost_shapes[2] = _unpadded_value_shape(arg_list[2]) or cost_shapes[2]
    cost = op_cost(name, in_shapes=cost_shapes, out_shapes=[tuple(o.shape) for o in outs], grads=grads,
                   kwargs=kwargs, causal_mask=causal_mask)
    inputs = _tensor_inputs(fx)
    params = []
    for a in inputs:
        fqn = param_of.get(a.name) if a.op == "placeholder" else None
        if fqn is not None:
            v = a.meta["val"]
            params.append((fqn, tuple(int(s) for s in v.shape), str(v.dtype).removeprefix("torch.")))
    in_vals = [(a, a.meta.get("val")) for a in inputs]
    out_bytes = sum(_nbytes(o) for o in outs)
    if cost.op_class == "view":
        read = written = 0.0
        eff = sum(eff_bytes.get(a.name, _nbytes(v)) for a, v in in_vals if hasattr(v, "shape")) if outs else 0.0
        eff = min(eff, out_bytes) if outs else 0.0
    else:
        read = sum(eff_bytes.get(a.name, _nbytes(v)) for a, v in in_vals if hasattr(v, "shape"))
        written = eff = out_bytes
        if name in _GATHER_OPS and params:  # gather of expert weights (batched_mm): a grouped kernel reads them in place
            written = eff = min(out_bytes, sum(_numel(s) for _, s, _ in params) * outs[0].element_size())
    eff_bytes[fx.name] = eff
    floating = any(o.dtype.is_floating_point for o in outs)
    grad[fx.name] = floating and any(grad.get(a.name, False) for a in inputs)
    stack = fx.meta.get("nn_module_stack") or {}
    module_fqn, module_type = list(stack.values())[-1] if stack else ("", "")
    module_type = getattr(module_type, "__name__", str(module_type)).rsplit(".", 1)[-1]
    return OpNode(
        name=fx.name, target=str(fx.target) if name != "getitem" else "getitem", op_class=cost.op_class,
        input_shapes=tuple(s for s in in_shapes if s is not None),
        input_dtypes=tuple(str(v.dtype).removeprefix("torch.") for _, v in in_vals if hasattr(v, "dtype")),
        output_shapes=tuple(tuple(int(s) for s in o.shape) for o in outs),
        output_dtypes=tuple(str(o.dtype).removeprefix("torch.") for o in outs),
        flops_fwd=cost.flops_fwd, flops_bwd=cost.flops_bwd, flops_bwd_recompute=cost.flops_bwd_recompute,
        causal_fraction=cost.causal_fraction, bytes_read=read, bytes_written=written, params=tuple(params),
        module_fqn=module_fqn.removeprefix("L__self__."), module_type=module_type, covered=cost.covered,
    )

"""From a traced block (``planner.graph.Block`` + its ``OpGraph``) to the coarse ops the sharding ILP chooses for.

Rules, applied to the block's aten ops in execution order (the graph from ``planner.trace.trace``, before
``planner.graph.coarsen``: coarsening folds residual adds and norm internals into their producers, which erases
the structure the layouts are chosen on):

- a matmul that uses a 2-D weight is a linear of its module. It is shardable (colwise / rowwise) only if it is
  an ``aten.linear`` run by an ``nn.Linear`` module itself (``OpGraph.module_kinds``): not GPT-2's Conv1D, not
  ``nn.MultiheadAttention``'s ``F.linear`` on its packed ``in_proj_weight`` / ``out_proj``, and not a fused
  projection whose output is split (nanoGPT's ``c_attn``: a column shard would not hold whole heads).
  Linears that read the same tensor form one group op (q/k/v, gate/up: Megatron's fused projections); a linear
  whose output width is the number of experts in the block is the MoE router;
- attention, norm (with parameters; ``batchnorm`` for BatchNorm modules), embedding and convolution (``conv``)
  ops are their own ops, and so is a matmul of two activations (``matmul``: the scores and context of an attention
  written by hand, whose heads the layouts cannot follow: replicated); attention splits over heads only when
  every projection feeding it is shardable; a
  non-convolution matmul or gather reading a >= 3-D weight (grouped expert GEMMs) belongs to the experts op;
- every op run inside a norm module is the norm op, its dtype casts too: Hugging Face's RMSNorm upcasts its
  input to fp32 and casts the normalized result back, and autograd saves the fp32 input and the cast-back
  output (``saved_bytes``), which are the norm's activations;
- other dtype casts and copies (``aten.to``: a no-op at the training dtype) hand their input on unchanged, and
  what autograd saves of them is kept in their input's layout; views
  and ops with one activation input (activations, dropout, rotary embedding with its cos / sin inputs)
  follow their producer's layout: their work is added to the producer;
- an op with two activation inputs is a pointwise op, or a residual add when one input is on the residual
  stream (the block input, or an earlier residual add);
- the block input is the largest tensor entering from outside the block; the last residual add feeds the block
  output.

Numbers are converted to the micro-batch and sequence asked for (token-linear work scales with tokens, the
attention core with ``batch * seq^2``) and to the training dtype's bytes, or, with ``dtype="traced"``, kept at
each tensor's traced dtype (the graph of fp32 parameters under bf16 autocast, ``planner.trace.trace(autocast=True)``:
a linear's output in bf16, the residual stream, norms and the tokens experts receive in fp32, the weights and
their gradients in fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from costmodel.errors import UnsupportedModelError
from planner.search.strategies import LayerOp

_ALIASES = ("aten.to.", "aten._to_copy", "aten._assert", "aten.alias", "aten.clone", "aten.contiguous",
            "aten.detach", "aten.lift_fresh")
"""Ops that hand on (a copy of) their input: the residual stream often passes through a dtype cast."""
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "tf32": 4}
TRACED = "traced"
"""``layer_ops_from_block``'s dtype that keeps every tensor at the element size it was traced in."""
_CONV = ("aten.conv", "aten.convolution", "aten._convolution")
_GATHERS = ("aten.index", "aten._unsafe_index", "aten.gather", "aten.index_select")
_SPLITS = ("aten.split", "aten.split_with_sizes", "aten.chunk", "aten.unbind", "aten.tensor_split",
           "aten.unsafe_split")
"""Ops that cut a tensor into pieces: a linear feeding one is a fused projection (q/k/v, gate/up)."""


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


@dataclass(kw_only=True)
class _Acc:
    """A LayerOp under construction."""

    name: str
    kind: str
    inputs: list[str]
    modules: list[str] = field(default_factory=list)
    flops_fwd: float = 0.0
    flops_bwd: float = 0.0
    act_elems: float = 0.0
    """Activation elements read + written (token-linear)."""
    attn_flops_fwd: float = 0.0
    attn_flops_bwd: float = 0.0
    out_elems: float = 0.0
    saved_elems: float = 0.0
    params: int = 0
    weight_elems: float = 0.0
    op_class: str = "other"
    out_features: list[int] = field(default_factory=list)
    in_features: int = 0
    tokens: int = 0
    shardable: bool = True
    """Linears: every member is an ``nn.Linear`` (``aten.linear``), which Colwise / RowwiseParallel need."""
    tokens_hidden: tuple[int, int] = (0, 0)
    """Experts: (tokens, hidden) of the token-major input the experts read."""
    out_size: float = 2.0
    """Bytes per element of the output as traced (``dtype="traced"``)."""
    act_bytes: float = 0.0
    """``act_elems`` in bytes, each op's at its output's traced element size."""
    weight_bytes: float = 0.0
    """``weight_elems`` in bytes at the parameters' traced dtype."""
    dispatch_size: float = 2.0
    """Experts: bytes per element of the token-major input the experts read, as traced."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Scale:
    tokens: float
    attention: float
    dtype_bytes: int
    """Bytes per activation / weight element; 0: each at its traced size (``TRACED``)."""


def layer_ops_from_block(block, graph, *, microbatch: int, seq: int, dtype: str = "bf16") -> tuple[LayerOp, ...]:
    """The coarse ops of ``block`` (see the module docstring), for ``microbatch`` sequences of ``seq`` tokens."""
    nodes = {n.name: n for n in graph.nodes}
    names = [n for n in block.ops if n in nodes]
    if not names:
        raise UnsupportedModelError(f"block {block.name!r} has no ops in the given graph; pass the graph it came from")
    folded = next((n for n in names if nodes[n].folded), None)
    if folded is not None:
        raise UnsupportedModelError(
            f"block {block.name!r}: op {folded!r} was coarsened (folds {nodes[folded].folded[:3]}); pass the graph "
            "from planner.trace.trace before planner.graph.coarsen"
        )
    in_block = set(names)
    preds: dict[str, list[tuple[str, float]]] = {}
    for e in graph.edges:
        if e.dst in in_block:
            preds.setdefault(e.dst, []).append((e.src, e.nbytes))
    succ: dict[str, list[str]] = {}
    for e in graph.edges:
        succ.setdefault(e.src, []).append(e.dst)
    builder = _Builder(block=block, nodes=nodes, preds=preds, in_block=in_block, succ=succ,
                       kinds=dict(getattr(graph, "module_kinds", ()) or ()))
    for name in names:
        builder.visit(nodes[name])
    accs = builder.finish(next((builder.rep[n] for n in reversed(names) if builder.rep.get(n)), None))
    scale = _scale_of(builder, microbatch=microbatch, seq=seq, dtype=dtype)
    return tuple(_to_layer_op(a, scale, heads=builder.heads_of(a), experts=builder.experts) for a in accs)


class _Builder:
    def __init__(self, *, block, nodes, preds, in_block, succ, kinds) -> None:
        self.block, self.nodes, self.preds, self.in_block = block, nodes, preds, in_block
        self.succ, self.kinds = succ, kinds
        self.rep: dict[str, str] = {}  # aten node -> the coarse op carrying its layout
        self.ops: dict[str, _Acc] = {}
        self.residual: set[str] = {"input"}
        self.last_residual = "input"
        self.head_dim: dict[str, int] = {}
        self.traced_tokens = 0
        self.traced_seq = 0
        self.attention_seq = 0
        self.conv_batch = 0
        block_nodes = [nodes[x] for x in in_block]
        self.norm_modules = _norm_modules(block_nodes)
        self.batchnorm_modules = frozenset(n.module_fqn for n in block_nodes if "batch_norm" in n.target)
        self.expert_modules = tuple(sorted({n.module_fqn for n in block_nodes if _is_expert_op(n)}))
        self.experts = max((p[1][0] for n in block_nodes if _is_expert_op(n) for p in n.params if len(p[1]) >= 3),
                           default=0)
        self._input()

    def _input(self) -> None:
        self.ops["input"] = _Acc(name="input", kind="input", inputs=[])
        outside = [(s, b) for d, ps in self.preds.items() for s, b in ps if s not in self.in_block]
        # the residual stream: the largest floating-point tensor entering the block (a boolean causal mask of
        # (seq, seq) can be as large as the hidden states at long sequences)
        self.input_src = max(outside, key=lambda x: (self._floating(x[0]), x[1]))[0] if outside else None

    def _floating(self, name: str) -> bool:
        node = self.nodes.get(name)
        return bool(node and node.output_dtypes and node.output_dtypes[0].startswith(("float", "bfloat")))

    def _act_inputs(self, n) -> list[str]:
        """Coarse ops producing ``n``'s activation inputs (constants and side inputs such as rotary cos / sin
        or the attention mask map to None and are left out)."""
        reps = []
        for src, _ in self.preds.get(n.name, ()):
            r = self.rep.get(src) if src in self.in_block else ("input" if src == self.input_src else None)
            if r is not None and r not in reps:
                reps.append(r)
        return reps

    def _rel(self, fqn: str) -> str:
        p = self.block.name
        return fqn[len(p) + 1:] if p and fqn.startswith(p + ".") else fqn

    def visit(self, n) -> None:
        ins = self._act_inputs(n)
        weights = [p for p in n.params if len(p[1]) >= 2]
        if n.module_fqn in self.norm_modules and n.op_class != "attention":  # (a module holding a 1-D
            self._norm(n, ins)  # parameter beside its attention, GPT-OSS's sinks, is not a norm around it)
        elif n.target.startswith(_ALIASES) and len(ins) <= 1 and not n.params:
            self.rep[n.name] = ins[0] if ins else None  # type: ignore[assignment]  # same tensor, no layout change
            if ins and ins[0] in self.ops and n.saved_bytes:  # a copy the backward keeps: kept in its input's layout
                self.ops[ins[0]].saved_elems += _saved_elems(n, 0.0)
        elif self._expert_module(n.module_fqn):
            self._experts(n, ins, self._expert_module(n.module_fqn))
        elif n.target.startswith(_CONV) and weights:
            self._new(n, "conv", ins[:1], modules=[self._rel(_module_of(weights[0][0]))])
            if n.input_shapes and n.input_shapes[0]:
                self.conv_batch = self.conv_batch or int(n.input_shapes[0][0])
        elif n.op_class == "matmul" and weights and len(weights[0][1]) == 2:
            self._linear(n, ins, weights[0])
        elif n.op_class == "embedding" and weights:
            acc = self._new(n, "embedding", ins, modules=[self._rel(n.module_fqn)])
            acc.out_features = [weights[0][1][0]]  # vocabulary rows
            acc.tokens = _numel(n.output_shapes[0][:-1]) if n.output_shapes else 0
        elif n.op_class in ("attention", "norm"):
            mods = [self._rel(_module_of(n.params[0][0]))] if n.params else []
            self._new(n, n.op_class, ins, modules=mods)
        elif n.op_class == "matmul" and not weights and len(self.preds.get(n.name, ())) >= 2 and ins:
            # two activations (q and k, or scores and v, may come from one q/k/v group): QK^T / AV by hand
            self._new(n, "matmul", ins)
        elif len(ins) >= 2:
            kind = "add" if any(i in self.residual for i in ins) else "pointwise"
            self._new(n, kind, ins)
            if kind == "add":
                self.residual.add(n.name)
                self.last_residual = n.name
        elif ins:
            self._fold(n, ins[0])
        else:
            self.rep[n.name] = None  # type: ignore[assignment]  # computed from constants / side inputs only

    def _expert_module(self, fqn: str) -> str:
        return next((m for m in self.expert_modules if fqn == m or fqn.startswith(m + ".")), "")

    def _experts(self, n, ins: list[str], module: str) -> None:
        """All ops of an experts module are one op. Grouped / batched expert GEMMs gather weights per token
        (3-D tensors): only 2-D, token-major tensors count as activation traffic."""
        name = f"experts:{module}"
        acc = self.ops.get(name)
        if acc is None:
            acc = _Acc(name=name, kind="experts", inputs=[], modules=[self._rel(module)], op_class="matmul")
            self.ops[name] = acc
        for i in ins:
            if i != name and i not in acc.inputs:
                acc.inputs.append(i)
        self.rep[n.name] = name
        if acc.tokens_hidden == (0, 0):
            flat = [sh for sh in n.input_shapes if len(sh) == 2 and sh[1] > 1]
            if flat:
                acc.tokens_hidden = (flat[0][0], flat[0][1])
                acc.dispatch_size = _size(n.input_dtypes[0] if n.input_dtypes else "")
        acc.flops_fwd += n.flops_fwd
        acc.flops_bwd += n.flops_bwd
        weight = sum(_numel(p[1]) for p in n.params)
        acc.params += weight
        acc.weight_elems += weight
        acc.weight_bytes += _param_bytes(n)
        token_major = [_numel(sh) for sh in n.output_shapes if len(sh) == 2]
        if n.op_class != "view":
            acc.act_elems += 2 * sum(token_major)
            acc.act_bytes += 2 * sum(token_major) * _out_size(n)
            acc.saved_elems += _saved_elems(n, sum(token_major))
        if token_major:
            acc.out_elems, acc.out_size = float(token_major[0]), _out_size(n)

    def _norm(self, n, ins: list[str]) -> None:
        """All ops run inside one norm module (RMSNorm decomposes into pow, mean, rsqrt, mul) are one op."""
        name = f"norm:{n.module_fqn}"
        acc = self.ops.get(name)
        if acc is None:
            kind = "batchnorm" if n.module_fqn in self.batchnorm_modules else "norm"
            acc = _Acc(name=name, kind=kind, inputs=list(ins), modules=[self._rel(n.module_fqn)], op_class="norm")
            self.ops[name] = acc
        self.rep[n.name] = name
        self._add_work(acc, n)
        if n.output_shapes:
            acc.out_elems, acc.out_size = float(_numel(n.output_shapes[0])), _out_size(n)

    def _new(self, n, kind: str, ins: list[str], *, modules=()) -> _Acc:
        acc = _Acc(name=n.name, kind=kind, inputs=list(ins), modules=list(modules), op_class=n.op_class)
        self.ops[n.name] = acc
        self.rep[n.name] = n.name
        self._add_work(acc, n)
        acc.out_elems = float(_numel(n.output_shapes[0])) if n.output_shapes else 0.0
        acc.out_size = _out_size(n)
        if kind == "attention" and n.input_shapes and len(n.input_shapes[0]) == 4:
            acc.out_features = [n.input_shapes[0][1], n.input_shapes[1][1]]  # (heads, kv heads as traced)
            self.attention_seq = max(self.attention_seq, n.input_shapes[0][2])
        return acc

    def _add_work(self, acc: _Acc, n) -> None:
        weight_elems = sum(_numel(p[1]) for p in n.params)
        acts = sum(_numel(s) for s in n.input_shapes) + sum(_numel(s) for s in n.output_shapes) - weight_elems
        if n.op_class == "attention":
            acc.attn_flops_fwd += n.flops_fwd
            acc.attn_flops_bwd += n.flops_bwd
        else:
            acc.flops_fwd += n.flops_fwd
            acc.flops_bwd += n.flops_bwd
        if n.op_class != "view":
            acc.act_elems += max(0, acts)
            acc.act_bytes += max(0, acts) * _out_size(n)
        acc.saved_elems += _saved_elems(n, sum(_numel(s) for s in n.output_shapes) if n.op_class != "view" else 0)
        acc.weight_elems += weight_elems
        acc.weight_bytes += _param_bytes(n)
        acc.params += weight_elems

    def _fold(self, n, into: str) -> None:
        self.rep[n.name] = into
        acc = self.ops[into]
        self._add_work(acc, n)
        if n.op_class != "view" and n.output_shapes and into != "input" and _numel(n.output_shapes[0]) >= acc.out_elems:
            acc.out_elems, acc.out_size = float(_numel(n.output_shapes[0])), _out_size(n)

    def _linear(self, n, ins: list[str], weight) -> None:
        # Features from the activations: GPT-2's Conv1D (aten.addmm(bias, x, w)) stores its weight as (in, out).
        x = next((sh for sh in n.input_shapes if len(sh) >= 2 and tuple(sh) != tuple(weight[1])), None)
        in_f = x[-1] if x else weight[1][1]
        out_f = n.output_shapes[0][-1] if n.output_shapes and n.output_shapes[0] else weight[1][0]
        src = ins[0] if ins else "input"
        tokens = _numel(x[:-1]) if x else 0
        self.traced_tokens = max(self.traced_tokens, tokens)
        if x and len(x) >= 3:
            self.traced_seq = max(self.traced_seq, x[-2])
        group = next((a for a in self.ops.values() if a.kind == "linear" and a.inputs == [src]
                      and a.in_features == in_f and not self._consumed(a)), None)
        kind = "router" if self.experts and out_f == self.experts else "linear"
        if self.block.kind == "head":
            kind, group = "head", None  # the LM head: vocabulary-parallel or replicated
        if group is None or kind != "linear":
            group = self._new(n, kind, [src])
            group.in_features, group.tokens = in_f, tokens
        else:
            self.rep[n.name] = group.name
            self._add_work(group, n)
            group.out_elems += float(_numel(n.output_shapes[0]))
        group.modules.append(self._rel(n.module_fqn if self.kinds.get(n.module_fqn) == "linear"
                                       else _module_of(weight[0])))
        group.out_features.append(out_f)
        group.op_class = "matmul"
        group.shardable = group.shardable and self._shardable_linear(n, weight)

    def _shardable_linear(self, n, weight) -> bool:
        """Colwise / RowwiseParallel apply: an ``aten.linear`` run by an ``nn.Linear`` module's own forward (not
        ``F.linear`` on another module's weight, as ``nn.MultiheadAttention`` does with its packed
        ``in_proj_weight`` and ``out_proj``), whose output is not split into pieces (nanoGPT's fused ``c_attn``
        + ``split``: a column shard would not hold whole q / k / v heads)."""
        if not n.target.startswith("aten.linear"):
            return False
        if self.kinds:
            if self.kinds.get(n.module_fqn) != "linear":
                return False
        elif n.module_fqn != _module_of(weight[0]):
            return False
        todo, seen = list(self.succ.get(n.name, ())), set()
        while todo:  # consumers, through dtype casts / copies
            name = todo.pop()
            if name in seen or name not in self.nodes:
                continue
            seen.add(name)
            target = self.nodes[name].target
            if target.startswith(_SPLITS):
                return False
            if target.startswith(_ALIASES):
                todo.extend(self.succ.get(name, ()))
        return True

    def _consumed(self, acc: _Acc) -> bool:
        """A group is closed once a later op reads it (q/k/v are read by attention after all three)."""
        return any(acc.name in a.inputs for a in self.ops.values())

    def finish(self, last: str | None) -> list[_Acc]:
        """Close the block: transformer layers end in their last residual add, the head in a (synthetic)
        cross-entropy loss op, other blocks in the op producing their last value."""
        if self.block.kind == "head":
            heads = [a for a in self.ops.values() if a.kind == "head"]
            if heads:
                h = heads[-1]
                self.ops["loss"] = _Acc(name="loss", kind="loss", inputs=[h.name], act_elems=h.out_elems,
                                        act_bytes=h.out_elems * h.out_size, tokens=h.tokens, op_class="reduction")
            return list(self.ops.values())
        end = self.last_residual if self.block.kind == "transformer" else (last or "input")
        stream = self.ops[end].out_elems if end != "input" else 0.0
        size = self.ops[end].out_size if end != "input" else 2.0
        self.ops["input"].out_elems = stream if self.block.kind == "transformer" else 0.0
        self.ops["input"].out_size = size
        self.ops["output"] = _Acc(name="output", kind="output", inputs=[end], out_elems=stream, out_size=size)
        return list(self.ops.values())

    def heads_of(self, acc: _Acc) -> tuple[int, int, int] | None:
        """(heads, kv_heads, head_dim) of the attention reading (or read by) ``acc``, if any; None also when a
        projection feeding it cannot be sharded (then neither can its heads)."""
        for a in self.ops.values():
            if a.kind == "attention" and (acc is a or acc.name in a.inputs or a.name in acc.inputs):
                feeders = [self.ops[i] for i in a.inputs if self.ops[i].kind == "linear"]
                heads = a.out_features[0] if a.out_features else 0
                if feeders and heads and all(f.shardable for f in feeders):
                    q_out = feeders[0].out_features[0]
                    head_dim = q_out // heads
                    kv = feeders[0].out_features[1] // head_dim if len(feeders[0].out_features) > 1 else heads
                    return heads, kv, head_dim
        return None


def _saved_elems(n, outputs: float) -> float:
    """Bf16-sized units (2 bytes each, whatever dtype the trace ran in: ``saved_bytes`` are measured bytes) that
    autograd keeps for backward because of node ``n``: measured by ``planner.saved`` when the tracer could replay
    the graph, else its outputs (an upper bound, in elements: exact for a bf16 trace)."""
    if n.saved_bytes is not None:
        return n.saved_bytes / 2.0
    size = _ELEMENT_BYTES.get(str(n.output_dtypes[0]).replace("torch.", "") if n.output_dtypes else "", 2)
    return outputs * size / 2.0


_ELEMENT_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def _size(dtype: str) -> float:
    """Bytes per element of a traced dtype name (2 for one not known: the training dtype's)."""
    return float(_ELEMENT_BYTES.get(str(dtype).replace("torch.", ""), 2))


def _out_size(n) -> float:
    return _size(n.output_dtypes[0] if n.output_dtypes else "")


def _param_bytes(n) -> float:
    """Bytes of the parameters ``n`` reads, at their traced dtype."""
    return sum(_numel(shape) * _size(dtype) for _, shape, dtype in n.params)


def _norm_modules(nodes) -> frozenset[str]:
    """Modules whose ops use parameters, all of them 1-D (LayerNorm, RMSNorm weights and biases)."""
    with_params: dict[str, bool] = {}
    for n in nodes:
        if n.params and n.module_fqn and n.op_class not in ("matmul", "embedding"):
            one_d = all(len(p[1]) == 1 for p in n.params)
            with_params[n.module_fqn] = with_params.get(n.module_fqn, True) and one_d
        elif n.params and n.module_fqn:
            with_params[n.module_fqn] = False
    return frozenset(m for m, ok in with_params.items() if ok)


def _is_expert_op(n) -> bool:
    """A grouped / batched expert GEMM, or the gather of expert weights feeding one: an op reading a >= 3-D
    weight that is not a convolution (conv kernels, position tables are not experts)."""
    if n.target.startswith(_CONV) or not any(len(p[1]) >= 3 for p in n.params):
        return False
    return n.op_class == "matmul" or n.target.startswith(_GATHERS)


def _module_of(param_fqn: str) -> str:
    return param_fqn.rsplit(".", 1)[0]


def _scale_of(b: _Builder, *, microbatch: int, seq: int, dtype: str) -> _Scale:
    traced_seq = b.attention_seq or b.traced_seq or seq
    if b.traced_tokens:
        traced_batch = max(1, b.traced_tokens // traced_seq)
    else:  # a block without linears (a CNN's): the batch of its convolutions' input
        traced_batch = b.conv_batch or 1
    tokens = (microbatch * seq) / (traced_batch * traced_seq)
    db = 0 if dtype == TRACED else DTYPE_BYTES.get(dtype, 2)
    return _Scale(tokens=tokens, attention=tokens * seq / traced_seq, dtype_bytes=db)


def _to_layer_op(a: _Acc, sc: _Scale, *, heads: tuple[int, int, int] | None, experts: int = 0) -> LayerOp:
    db = sc.dtype_bytes
    out_size, act_bytes = (db, a.act_elems * db) if db else (a.out_size, a.act_bytes)
    weight_bytes = a.weight_elems * db if db else a.weight_bytes
    shard_dims: tuple[int, ...] = ()
    if a.kind in ("linear", "router", "head"):
        outs, fan_in = list(a.out_features), a.in_features
        if heads and a.name != "attention":
            h, kv, hd = heads
            if len(outs) == 3 and outs[0] == h * hd:  # q/k/v: split whole heads
                outs = [h, kv, kv]
            elif fan_in == h * hd and len(outs) == 1:  # output projection: its input is whole heads
                fan_in = h
        shard_dims = (*outs, fan_in) if a.shardable else ()
    elif a.kind == "attention" and heads:
        shard_dims = heads[:2]
    elif a.kind in ("embedding",):
        shard_dims = (a.out_features[0],) if a.out_features else ()
    out_bytes = a.out_elems * sc.tokens * out_size
    dispatch = rows = 0.0
    if a.kind == "experts" and experts and a.out_elems:
        # tokens * topk * hidden elements cross the ep axis each way; topk from FLOPs = 2 * tokens * topk * P_e
        per_expert = a.params / experts
        tokens, hidden = a.tokens_hidden
        topk = a.flops_fwd / (2.0 * tokens * per_expert) if per_expert and tokens else 1.0
        rows = tokens * topk * sc.tokens
        dispatch = rows * hidden * (db or a.dispatch_size)
    if a.kind == "loss":  # fp32 per-token statistics (max, sum of exponentials, target logit)
        out_bytes = a.tokens * sc.tokens * 4.0
    return LayerOp(
        name=a.name, kind=a.kind, inputs=tuple(a.inputs), modules=tuple(a.modules),  # type: ignore[arg-type]
        flops_fwd=a.flops_fwd * sc.tokens + a.attn_flops_fwd * sc.attention,
        flops_bwd=a.flops_bwd * sc.tokens + a.attn_flops_bwd * sc.attention,
        bytes_fwd=act_bytes * sc.tokens + weight_bytes,
        out_bytes=out_bytes, dispatch_bytes=dispatch, dispatch_rows=rows,
        experts=experts if a.kind == "experts" else 0,
        saved_bytes=a.saved_elems * sc.tokens * 2.0,  # measured bytes (bf16-sized units), whatever the trace dtype
        params=int(a.params), param_bytes=float(a.params) * db if db else a.weight_bytes, shard_dims=shard_dims,
        op_class=a.op_class if a.op_class != "other" else "elementwise",
        mnk=(int(a.tokens * sc.tokens), sum(a.out_features), a.in_features)
        if a.kind in ("linear", "router", "head") else (),
    )


"""Pipeline units of any model whose forward runs its layers as a chain, from a torch.fx trace of its forward.

The family adapters of ``runtime.model_adapters`` know how OPT, Llama and GPT-2 compute what runs around their
layers. For every other model ``TracedAdapter`` reads it from the model itself: ``torch.fx`` traces the root's
``forward`` symbolically (no tensor is computed; a meta-device model traces as well) with every module that
holds no transformer layer kept as one call (a leaf), so the layers (``runtime.checkpointing.transformer_layers``:
the children of the outermost ``nn.ModuleList`` s, the planner's blocks) and the modules around them appear as
``call_module`` nodes under their own FQNs, and the root's own code between them (``wte(ids) + wpe(arange(T))``,
residual adds, reshapes) as plain nodes (``nn.TransformerEncoder`` as the layer calls its forward makes without
masks). The graph is cut into the units a pipeline chunk runs:

    unit 0          everything before the first layer call (the planner's ``embedding`` block)
    units 1..L      layer ``i``'s call and the root's ops after it, up to the next module call after the layers
    units L+1..     one per module call after the layers, with the root's ops that follow it (the ``head``)

A chunk runs its units' nodes in graph order, calling the chunk's own submodules (the model's, at their FQNs:
``runtime.pipeline.PipelineChunk``), so tensor parallelism, FSDP and recomputation applied to those modules apply
here as in the whole model, and the chained chunks compute what ``model(x)`` computes, op for op.

The model must be a chain at every cut: exactly one value computed from the input or from parameters (the hidden
states) crosses each unit boundary. Values computed from neither (constants, buffers, ``arange`` over a literal)
are recomputed in every chunk that reads them. Anything else raises ``UnsupportedModelError`` naming the values
and the fix (a plan with pp=1): a skip connection around layers, a layer that returns extra outputs (an
auxiliary loss) used later, a layer called twice or out of order, a forward torch.fx cannot trace
(data-dependent control flow), a forward that needs a second input.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from costmodel.errors import PlanMismatchError, UnsupportedModelError
from runtime.checkpointing import transformer_layers

FIX = "plan with pp=1 (autopar plan ... --fix pp=1), or write the forward as embedding -> layers in order -> head"


class _LeafTracer(fx.Tracer):
    """Traces into the modules that contain layers (and the root) only; every other module is one call."""

    def __init__(self, containers: frozenset[str]) -> None:
        super().__init__()
        self._containers = containers

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name not in self._containers

    def call_module(self, m: nn.Module, forward: Any, args: tuple, kwargs: dict) -> Any:
        # torch's nn.TransformerEncoder checks tensor properties for its inference fast path (control flow fx
        # cannot trace); without masks its forward is: each layer in turn (src_mask=None, is_causal=False,
        # src_key_padding_mask=None), then the optional norm. Recorded as those calls.
        if isinstance(m, nn.TransformerEncoder) and len(args) == 1 and not any(
                kwargs.get(k) is not None for k in ("mask", "src_key_padding_mask")) and not kwargs.get("is_causal"):
            out = args[0]
            for layer in m.layers:
                out = super().call_module(layer, layer.forward, (out,),
                                          {"src_mask": None, "is_causal": False, "src_key_padding_mask": None})
            return super().call_module(m.norm, m.norm.forward, (out,), {}) if m.norm is not None else out
        return super().call_module(m, forward, args, kwargs)


@dataclass(slots=True)
class Unit:
    """One pipeline unit: graph nodes (in order) and the module FQNs / attribute paths they read."""

    name: str
    nodes: list[fx.Node] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    """Module FQNs the nodes call or read attributes of (the modules a chunk running this unit holds)."""
    root_attrs: list[str] = field(default_factory=list)
    """Attributes of the root module the nodes read (a root-level ``nn.Parameter``, a buffer)."""


def _prefixes(fqn: str) -> list[str]:
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def trace_forward(model: nn.Module) -> tuple[fx.Graph, dict[str, Any]]:
    """The fx graph of ``model.forward`` with its first argument as the input (the others at their defaults)
    and the constants the tracer had to store (literal tensors), which are taken off the model again."""
    layers = transformer_layers(model)
    containers = frozenset({""} | {p for f in layers for p in _prefixes(f)})
    name = type(model).__name__
    params = list(inspect.signature(model.forward).parameters.values())
    if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                            inspect.Parameter.POSITIONAL_OR_KEYWORD):
        raise UnsupportedModelError(f"pipeline parallelism cannot run {name}: its forward takes no positional "
                                    f"input to feed the first stage; {FIX}")
    concrete: dict[str, Any] = {}
    for p in params[1:]:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            continue
        if p.default is inspect.Parameter.empty:
            raise UnsupportedModelError(
                f"pipeline parallelism cannot run {name}: its forward needs argument {p.name!r} besides the "
                f"input, and a pipeline feeds one tensor to its first stage; give {p.name!r} a default or {FIX}"
            )
        concrete[p.name] = p.default
    before = set(vars(model))
    try:
        graph = _LeafTracer(containers).trace(model, concrete_args=concrete or None)
    except Exception as e:  # noqa: BLE001 - any tracing failure: the model cannot be cut here
        raise UnsupportedModelError(
            f"pipeline parallelism cannot run {name}: torch.fx could not trace its forward to find where the "
            f"layers run ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); {FIX}"
        ) from None
    finally:
        added = {k: vars(model)[k] for k in set(vars(model)) - before}
        for k in added:
            delattr(model, k)
    return graph, added


class TracedUnits:
    """The units of ``model`` (module docstring) and how to run a range of them."""

    def __init__(self, model: nn.Module) -> None:
        self.model_name = type(model).__name__
        self.layers = tuple(transformer_layers(model))
        if not self.layers:
            raise UnsupportedModelError(
                f"pipeline parallelism cannot run {self.model_name}: it has no nn.ModuleList of repeated layers to "
                "cut between (supported layouts: OPT, Llama/Mistral/Mixtral, GPT-2, or any model whose forward "
                f"runs the layers of one nn.ModuleList in order); {FIX}"
            )
        self.graph, self.constants = trace_forward(model)
        nodes = list(self.graph.nodes)
        self._order = {n: i for i, n in enumerate(nodes)}
        self.placeholders = [n for n in nodes if n.op == "placeholder"]
        self.units = self._partition(model, nodes)
        self._producer = {n: u for u, unit in enumerate(self.units) for n in unit.nodes}
        self._tainted = self._taint(model, nodes)
        self.crossing = [self._crossing(b) for b in range(1, len(self.units))]
        """For each boundary ``b`` (between unit ``b - 1`` and ``b``, from 1): the one node crossing it."""

    # --- partition ------------------------------------------------------------------------------------------

    def _partition(self, model: nn.Module, nodes: list[fx.Node]) -> list[Unit]:
        layer_set = set(self.layers)
        calls: dict[str, int] = {}
        for i, n in enumerate(nodes):
            if n.op == "call_module" and n.target in layer_set:
                if n.target in calls:
                    raise UnsupportedModelError(
                        f"pipeline parallelism cannot run {self.model_name}: its forward calls layer {n.target!r} "
                        f"more than once, so no cut gives each layer to one stage; {FIX}"
                    )
                calls[n.target] = i
        missing = [f for f in self.layers if f not in calls]
        if missing:
            raise UnsupportedModelError(
                f"pipeline parallelism cannot run {self.model_name}: its forward does not call layer(s) "
                f"{missing[:3]} as modules of the root's forward (layers called from inside another module are not "
                f"cut points); {FIX}"
            )
        order = sorted(self.layers, key=calls.__getitem__)
        if order != list(self.layers):
            raise UnsupportedModelError(
                f"pipeline parallelism cannot run {self.model_name}: its forward runs the layers in the order "
                f"{order[:4]}..., not as registered; {FIX}"
            )
        last = calls[self.layers[-1]]
        post_calls = [i for i in range(last + 1, len(nodes)) if nodes[i].op == "call_module"]
        starts = [(0, "<embedding>")] + [(calls[f], f) for f in self.layers]
        seen: dict[str, int] = {}
        for i in post_calls:
            target = str(nodes[i].target)
            seen[target] = seen.get(target, 0) + 1
            starts.append((i, target if seen[target] == 1 else f"{target}#{seen[target]}"))
        units = []
        for k, (start, name) in enumerate(starts):
            end = starts[k + 1][0] if k + 1 < len(starts) else len(nodes)
            units.append(Unit(name=name, nodes=nodes[start:end]))
        for unit in units:
            self._references(model, unit)
        self._check_layer_reads(units)
        return units

    def _references(self, model: nn.Module, unit: Unit) -> None:
        unit.modules, attrs = self.chunk_references(unit.nodes)
        unit.root_attrs.extend(attrs)

    def _check_layer_reads(self, units: list[Unit]) -> None:
        for unit in units:
            for fqn in unit.modules:
                owner = next((l for l in self.layers if fqn == l or fqn.startswith(l + ".")), None)
                if owner is not None and owner != unit.name:
                    raise UnsupportedModelError(
                        f"pipeline parallelism cannot run {self.model_name}: the root's forward reads {fqn!r} of "
                        f"layer {owner!r} outside that layer's call, so that layer would be needed on two stages; "
                        f"{FIX}"
                    )

    # --- the chain check ------------------------------------------------------------------------------------

    def _taint(self, model: nn.Module, nodes: list[fx.Node]) -> set[fx.Node]:
        """Nodes computed from the input or from parameters (what must travel between stages)."""
        tainted: set[fx.Node] = set()
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        for n in nodes:
            if n.op == "placeholder":
                if self.placeholders and n is self.placeholders[0]:
                    tainted.add(n)
            elif n.op == "get_attr":
                if str(n.target) in params:
                    tainted.add(n)
            elif n.op == "call_module":
                mod = model.get_submodule(str(n.target))
                if any(True for _ in mod.parameters()) or any(a in tainted for a in n.all_input_nodes):
                    tainted.add(n)
            elif any(a in tainted for a in n.all_input_nodes):
                tainted.add(n)
        return tainted

    def _crossing(self, boundary: int) -> fx.Node:
        later = [n for unit in self.units[boundary:] for n in unit.nodes]
        crossing: dict[fx.Node, None] = {}
        for n in later:
            for a in n.all_input_nodes:
                if self._producer[a] < boundary and a in self._tainted:
                    crossing[a] = None
        if len(crossing) == 1:
            return next(iter(crossing))
        where = f"between {self.units[boundary - 1].name!r} and {self.units[boundary].name!r}"
        if not crossing:
            raise UnsupportedModelError(
                f"pipeline parallelism cannot run {self.model_name}: nothing computed before {where} is used after "
                f"it, so the stages would not be a chain; {FIX}"
            )
        names = ", ".join(f"{a.name!r} (from {self.units[self._producer[a]].name})" for a in crossing)
        raise UnsupportedModelError(
            f"pipeline parallelism cannot run {self.model_name}: its forward is not a chain of its layers: "
            f"{len(crossing)} values cross the cut {where} ({names}), and a pipeline stage passes one tensor to "
            f"the next (a skip connection around layers, or a layer's extra output used later); {FIX}"
        )

    # --- chunks ---------------------------------------------------------------------------------------------

    def unit_of(self, fqn: str) -> int:
        """The unit a plan's stage module FQN stands for (the first that reads it, or one of its submodules)."""
        for i, unit in enumerate(self.units):
            if i > 0 and i <= len(self.layers) and fqn.startswith(unit.name + "."):
                raise PlanMismatchError(
                    f"stage module {fqn!r} is part of {unit.name!r}: pipeline cuts are at whole layers; "
                    f"name {unit.name!r} instead"
                )
            refs = [*unit.modules, *unit.root_attrs]
            if any(fqn == r or fqn.startswith(r + ".") for r in refs):
                return i
        raise PlanMismatchError(
            f"stage module {fqn!r} is not used by {self.model_name}'s forward; expected one of "
            f"{self.units[0].modules + [self.layers[0], '...', self.layers[-1]] + [u.name for u in self.post_units]}"
        )

    @property
    def post_units(self) -> list[Unit]:
        return self.units[len(self.layers) + 1:]

    def chunk_nodes(self, lo: int, hi: int) -> list[fx.Node]:
        """Nodes a chunk of units ``[lo, hi)`` runs: theirs, after the constant-only nodes they read from earlier
        units (recomputed here), in graph order."""
        body = [n for unit in self.units[lo:hi] for n in unit.nodes]
        inside = set(body)
        extra: set[fx.Node] = set()
        todo = [a for n in body for a in n.all_input_nodes if a not in inside]
        entry = self.crossing[lo - 1] if lo > 0 else None
        while todo:
            a = todo.pop()
            if a in extra or a in inside or a is entry:
                continue
            if a in self._tainted:  # the chain check allows only the entry: guards that invariant
                raise UnsupportedModelError(f"{self.model_name}: chunk of units {lo}..{hi - 1} needs {a.name!r}")
            extra.add(a)
            todo.extend(a.all_input_nodes)
        return sorted(extra | inside, key=self._order.__getitem__)

    def chunk_references(self, nodes: list[fx.Node]) -> tuple[list[str], list[str]]:
        """(module FQNs, root attribute names) the nodes read."""
        mods: dict[str, None] = {}
        attrs: dict[str, None] = {}
        for n in nodes:
            if n.op == "call_module":
                mods[str(n.target)] = None
            elif n.op == "get_attr":
                owner, _, attr = str(n.target).rpartition(".")
                if owner:
                    mods[owner] = None
                elif attr not in self.constants:
                    attrs[attr] = None
        return list(mods), list(attrs)

    def run(self, chunk: nn.Module, nodes: list[fx.Node], lo: int, hi: int, x: Any, *, on_entry: Any = None,
            on_exit: Any = None) -> Any:
        """Run ``nodes`` (``chunk_nodes(lo, hi)``) with ``x`` as the chunk's input: the model's input for
        ``lo == 0``, else the value crossing boundary ``lo``. ``on_entry`` maps the hidden states as the first
        layer / post unit gets them (after unit 0 when the chunk holds it), ``on_exit`` the chunk's output when it
        is not the model's output (both: sequence parallelism)."""
        env: dict[fx.Node, Any] = {}
        if lo > 0:
            env[self.crossing[lo - 1]] = on_entry(x) if on_entry is not None else x
        entry_after = self.crossing[0] if lo == 0 and hi > 1 else None
        result = None
        for n in nodes:
            if n in env:
                continue
            if n.op == "placeholder":
                env[n] = x if n is self.placeholders[0] else _default(n)
                continue
            if n.op == "output":
                result = fx.node.map_arg(n.args[0], env.__getitem__)
                continue
            args = fx.node.map_arg(n.args, env.__getitem__)
            kwargs = fx.node.map_arg(n.kwargs, env.__getitem__)
            if n.op == "call_module":
                env[n] = chunk.get_submodule(str(n.target))(*args, **kwargs)
            elif n.op == "call_function":
                env[n] = n.target(*args, **kwargs)
            elif n.op == "call_method":
                env[n] = getattr(args[0], str(n.target))(*args[1:], **kwargs)
            elif n.op == "get_attr":
                env[n] = self._attr(chunk, str(n.target))
            else:
                raise UnsupportedModelError(f"{self.model_name}: fx node {n.name} has op {n.op!r}")
            if n is entry_after and on_entry is not None:
                env[n] = on_entry(env[n])
        if hi < len(self.units):
            out = env[self.crossing[hi - 1]]
            return on_exit(out) if on_exit is not None else out
        return result

    def _attr(self, chunk: nn.Module, target: str) -> Any:
        if target in self.constants:
            return self.constants[target]
        obj: Any = chunk
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj


def _default(node: fx.Node) -> Any:
    """A placeholder other than the input: its argument's default (fx records it as the node's only arg)."""
    return node.args[0] if node.args else None


def graft_attrs(chunk: nn.Module, model: nn.Module, attrs: list[str]) -> None:
    """Register the model's root-level parameters / buffers ``attrs`` on ``chunk`` (the same tensor objects)."""
    for attr in attrs:
        value = getattr(model, attr)
        if isinstance(value, nn.Parameter):
            chunk.register_parameter(attr, value)
        elif attr in model._buffers:
            chunk.register_buffer(attr, value, persistent=attr not in model._non_persistent_buffers_set)
        elif isinstance(value, torch.Tensor) or not callable(value):
            chunk.__dict__[attr] = value
        else:
            raise UnsupportedModelError(f"{type(model).__name__}: the forward reads {attr!r}, which is not a "
                                        f"tensor attribute; {FIX}")

"""Model-family adapters: how to run embedding -> layers[i:j] -> final norm + head for one pipeline chunk.

A pipeline chunk holds a contiguous run of *units* of the model:

    unit 0          the embedding (token embedding, learned positions, input projection: all of them together)
    units 1..L      the transformer layers, in order
    units L+1..     the modules after the layers, each applied to the hidden states in turn
                    (final norm, output projection, LM head)

An adapter knows a family's unit FQNs and the per-chunk context the layers need (causal mask, position ids,
rotary position embeddings), computed from the hidden states exactly as the family's own ``forward`` does, so
that the chunks chained together compute what the full model computes. Families:

- ``opt``: transformers ``OPTForCausalLM`` (the GPT presets: gelu, learned positions, separate q/k/v);
- ``llama``: ``LlamaForCausalLM`` and the same layout (``MixtralForCausalLM``, Mistral, Qwen2): rotary
  embeddings from ``model.rotary_emb`` in every chunk, sliding-window mask where the config asks for it;
- ``gpt2``: ``GPT2LMHeadModel``.

Any other model gets ``TracedAdapter`` for pipeline parallelism (``adapter_for(..., traced=True)``): its units
come from a torch.fx trace of its forward (``runtime.traced_units``), and a chunk runs the traced nodes.

Only the unpadded causal-LM path is supported (no attention mask, no KV cache), which is what training uses.
The Mixtral load-balancing auxiliary loss is not part of the chunk outputs (the LM logits are).

Context parallel (``runtime.context_parallel``) asks an adapter for the attention modules whose attention function
it replaces (``attention_modules``) and for the keyword arguments that give the whole model the global position
ids of a rank's tokens (``cp_model_kwargs``): every family here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from costmodel.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

EMBED_UNIT = "<embedding>"


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """The unit FQNs of one model: see the module docstring."""

    family: str
    embed: tuple[str, ...]
    """Modules of unit 0 (only the ones present in this model)."""
    layers: tuple[str, ...]
    post: tuple[str, ...]
    """Modules after the layers, applied in this order."""
    aux: tuple[str, ...] = ()
    """Parameter-free helpers that every chunk with layers needs (rotary embedding)."""

    @property
    def units(self) -> tuple[str, ...]:
        return (EMBED_UNIT, *self.layers, *self.post)


class ModelAdapter:
    """Base adapter; subclasses set ``family`` and implement ``layout``, ``embed`` and ``layer_context``."""

    family = ""

    def __init__(self, model: nn.Module) -> None:
        self.config = getattr(model, "config", None)
        self.layout = self._layout(model)

    def _layout(self, model: nn.Module) -> Layout:
        raise NotImplementedError

    def embed(self, chunk: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, H) hidden states."""
        raise NotImplementedError

    def layer_context(self, chunk: nn.Module, hidden: torch.Tensor) -> dict[str, Any]:
        """Keyword arguments every layer of the chunk gets besides the hidden states."""
        raise NotImplementedError

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, context: dict[str, Any]) -> torch.Tensor:
        out = layer(hidden, **context)
        return out[0] if isinstance(out, tuple) else out

    attention_child = ""
    """Name of the attention module inside each layer; empty where context parallel is not supported."""

    def attention_modules(self, model: nn.Module) -> list[nn.Module]:
        """Every layer's attention module (what context parallel hooks)."""
        if not self.attention_child:
            raise UnsupportedModelError(
                f"context parallelism does not support the {self.family} family yet: use cp=1 (supported: "
                "OPT, Llama/Mistral/Mixtral/Qwen2 and GPT-2 layouts)"
            )
        return [model.get_submodule(f"{fqn}.{self.attention_child}") for fqn in self.layout.layers]

    def cp_model_kwargs(self, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        """Forward keyword arguments that set the global position ids ((1, T_local)) of a rank's tokens."""
        return {"position_ids": positions}


def _present(model: nn.Module, fqns: tuple[str, ...]) -> tuple[str, ...]:
    found = []
    for fqn in fqns:
        try:
            mod = model.get_submodule(fqn)
        except AttributeError:
            continue
        if mod is not None:
            found.append(fqn)
    return tuple(found)


def _layer_fqns(model: nn.Module, container: str) -> tuple[str, ...]:
    layers = model.get_submodule(container)
    return tuple(f"{container}.{name}" for name, _ in layers.named_children())


class OptAdapter(ModelAdapter):
    family = "opt"
    attention_child = "self_attn"

    def _layout(self, model: nn.Module) -> Layout:
        if getattr(self.config, "layerdrop", 0.0):
            raise UnsupportedModelError(
                f"OPT layerdrop={self.config.layerdrop} skips layers at random, which a pipeline cannot "
                "reproduce: set config.layerdrop=0"
            )
        d = "model.decoder"
        return Layout(
            family=self.family,
            embed=_present(model, (f"{d}.embed_tokens", f"{d}.embed_positions", f"{d}.project_in")),
            layers=_layer_fqns(model, f"{d}.layers"),
            post=_present(model, (f"{d}.final_layer_norm", f"{d}.project_out", "lm_head")),
        )

    def embed(self, chunk: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        d = "model.decoder"
        embeds = chunk.get_submodule(f"{d}.embed_tokens")(input_ids)  # (B, T, E)
        ones = torch.ones(input_ids.shape, device=input_ids.device)
        position_ids = (torch.cumsum(ones, dim=1) * ones - 1).long()  # as OPTDecoder.forward
        pos = chunk.get_submodule(f"{d}.embed_positions")(ones, 0, position_ids=position_ids)
        if f"{d}.project_in" in self.layout.embed:
            embeds = chunk.get_submodule(f"{d}.project_in")(embeds)
        return embeds + pos.to(embeds.device)

    def layer_context(self, chunk: nn.Module, hidden: torch.Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask

        ones = torch.ones(hidden.shape[:2], device=hidden.device)
        position_ids = (torch.cumsum(ones, dim=1) * ones - 1).long()
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None)
        return {"attention_mask": mask, "position_ids": position_ids}


class LlamaAdapter(ModelAdapter):
    """Llama / Mistral / Mixtral / Qwen2 layout: model.embed_tokens, model.layers, model.norm, lm_head."""

    family = "llama"
    attention_child = "self_attn"

    def _layout(self, model: nn.Module) -> Layout:
        return Layout(
            family=self.family,
            embed=("model.embed_tokens",),
            layers=_layer_fqns(model, "model.layers"),
            post=_present(model, ("model.norm", "lm_head")),
            aux=("model.rotary_emb",),
        )

    def embed(self, chunk: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        return chunk.get_submodule("model.embed_tokens")(input_ids)

    def layer_context(self, chunk: nn.Module, hidden: torch.Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)  # (1, T)
        make_mask = create_causal_mask
        if getattr(self.config, "sliding_window", None) is not None and getattr(
            self.config, "use_sliding_window", True
        ):
            make_mask = create_sliding_window_causal_mask  # as MixtralModel / MistralModel.forward
        mask = make_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=position_ids
        )
        rotary = chunk.get_submodule("model.rotary_emb")
        return {
            "attention_mask": mask,
            "position_ids": position_ids,
            "position_embeddings": rotary(hidden, position_ids=position_ids),
        }


class Gpt2Adapter(ModelAdapter):
    family = "gpt2"
    attention_child = "attn"

    def _layout(self, model: nn.Module) -> Layout:
        return Layout(
            family=self.family,
            embed=("transformer.wte", "transformer.wpe", "transformer.drop"),
            layers=_layer_fqns(model, "transformer.h"),
            post=("transformer.ln_f", "lm_head"),
        )

    def embed(self, chunk: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        hidden = chunk.get_submodule("transformer.wte")(input_ids)
        hidden = hidden + chunk.get_submodule("transformer.wpe")(position_ids)
        return chunk.get_submodule("transformer.drop")(hidden)

    def layer_context(self, chunk: nn.Module, hidden: torch.Tensor) -> dict[str, Any]:
        from transformers.masking_utils import create_causal_mask

        position_ids = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=position_ids
        )
        return {"attention_mask": mask}


def _has(model: nn.Module, fqn: str) -> bool:
    try:
        model.get_submodule(fqn)
    except AttributeError:
        return False
    return True


class TracedAdapter(ModelAdapter):
    """Any model whose forward is a chain of its layers: the units of a torch.fx trace (``runtime.traced_units``).
    ``PipelineChunk`` runs the traced nodes of its units instead of ``embed`` / ``layer_context`` / ``run_layer``."""

    family = "traced"

    def __init__(self, model: nn.Module) -> None:
        from runtime.traced_units import TracedUnits

        self.traced = TracedUnits(model)
        super().__init__(model)

    def _layout(self, model: nn.Module) -> Layout:
        t = self.traced
        return Layout(family=f"{self.family} {t.model_name}", embed=tuple(t.units[0].modules), layers=t.layers,
                      post=tuple(u.name for u in t.post_units))

    def unit_of(self, fqn: str) -> int:
        return self.traced.unit_of(fqn)


def adapter_for(model: nn.Module, *, purpose: str = "pipeline parallelism", traced: bool = False) -> ModelAdapter:
    """Pick the adapter from the module structure; without a family layout, ``traced=True`` gives the
    ``TracedAdapter`` (which raises UnsupportedModelError naming why when the forward is no chain of its layers),
    else raise UnsupportedModelError naming the supported layouts (``purpose``: what needs the adapter)."""
    if _has(model, "model.decoder.layers") and _has(model, "model.decoder.embed_positions"):
        return OptAdapter(model)
    if _has(model, "model.layers") and _has(model, "model.rotary_emb") and _has(model, "model.embed_tokens"):
        return LlamaAdapter(model)
    if _has(model, "transformer.h") and _has(model, "transformer.wpe"):
        return Gpt2Adapter(model)
    if traced:
        return TracedAdapter(model)
    raise UnsupportedModelError(
        f"{purpose} cannot run {type(model).__name__}: supported layouts are OPT "
        "(model.decoder.layers), Llama/Mistral/Mixtral (model.layers + model.rotary_emb) and GPT-2 "
        f"(transformer.h); use a plan without {purpose} ({'pp' if 'pipeline' in purpose else 'cp'}=1) for other models"
    )

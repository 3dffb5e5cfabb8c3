"""Models a user can name: presets, inline dimensions, a Hugging Face ``config.json``, or user code.

``build_model(spec, batch=, seq=)`` returns a ``ModelBundle``: the ``nn.Module`` (built on the meta device by
default, so a 405B model costs no memory), example inputs of shape ``(batch, seq)`` and the ``ModelDims`` that
the cost model and the analytic checks need. For user code the dims are what is known before tracing (layers,
token seq, the spec's ``heads=``); ``planner.dims.complete_dims`` fills the rest from the traced graph.

Spec forms (see ``list_presets()`` for the preset names):

- a preset: ``gpt2``, ``gpt3-175b``, ``llama3-8b``, ``llama3-70b``, ``llama3-405b``, ``mixtral-8x7b``, and the
  Megatron-LM SC21 GPT sizes ``megatron-1.7b`` ... ``megatron-1t`` (Table 1) and ``megatron-530b`` (Table 2);
- inline dimensions: ``gpt:layers=96,hidden=12288,heads=96,vocab=51200,seq=2048[,ffn=49152]``,
  ``llama:layers=..,hidden=..,ffn=..,heads=..,kv_heads=..,vocab=..,seq=..``,
  ``mixtral:layers=..,hidden=..,ffn=..,heads=..,kv_heads=..,vocab=..,seq=..,experts=8,topk=2``;
- a path to a Hugging Face ``config.json`` (or a directory holding one): the causal-LM class of its
  ``model_type``, random init, nothing downloaded; the sequence length is the config's
  ``max_position_embeddings`` (Qwen2: 131,072) unless ``seq`` says otherwise; attention through sdpa, GPT-OSS's
  attention with sinks (which transformers runs only eagerly or with flex / flash kernels) through
  ``planner.sink_attention``, attention with a v head dim narrower than q / k (DeepSeek's multi-head latent
  attention, which the fused sdpa kernels refuse) with v zero-padded through ``planner.mla_attention``;
- ``module.path:function[:key=value,...]``: user code returning ``(model, example_inputs)``, imported from the
  current directory and called with meta as the default device (``planner.user_code``); it may accept ``batch``,
  ``seq`` and the spec's keys as keyword arguments.

GPT-family models follow Megatron / GPT-2 (learned positions, GeLU, 4h MLP, pre-LayerNorm, tied embeddings) and
are built as ``transformers.OPTForCausalLM`` so every projection is an ``nn.Linear`` with separate q/k/v (what
DTensor Colwise/Rowwise sharding expects). ``gpt2`` is HF ``GPT2LMHeadModel`` (Conv1D projections).

Every problem with a spec raises ``ConfigError`` naming the value and the allowed ones.
"""

from __future__ import annotations

import difflib
import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable

from costmodel.errors import ConfigError, UnsupportedModelError
from planner import mla_attention, sink_attention
from planner.dims import Arch, ModelDims
from planner.user_code import build_user_model, looks_like_user_spec

log = logging.getLogger(__name__)

@dataclass(frozen=True, kw_only=True, slots=True)
class ModelBundle:
    """A built model with inputs for one micro-batch."""

    name: str
    model: Any
    """The ``torch.nn.Module`` (on the meta device unless asked otherwise)."""
    example_inputs: tuple
    """Positional inputs of one micro-batch: ``(input_ids,)`` of shape (batch, seq) for the built-in models."""
    dims: ModelDims
    labels: Any = None
    """Targets for the loss (same shape as ``input_ids``) or None."""
    rebuild: Callable[[int], Any] | None = field(default=None, repr=False)
    """``rebuild(layers)`` builds the same model with another depth (the tracer's shortcut), or None."""


# --- presets ------------------------------------------------------------------------------------------------

_GPT_VOCAB = 51200
_GPT_SEQ = 2048

# Megatron-LM SC21 (Narayanan et al. 2021), Table 1 (weak scaling) and Table 2 (175B / 530B):
# name -> (layers, hidden, heads). Matches benchmarks/data/megatron_sc21.json.
_MEGATRON = MappingProxyType({
    "megatron-1.7b": (24, 2304, 24),
    "megatron-3.6b": (30, 3072, 32),
    "megatron-7.5b": (36, 4096, 32),
    "megatron-18b": (40, 6144, 48),
    "megatron-39b": (48, 8192, 64),
    "megatron-76b": (60, 10240, 80),
    "megatron-145b": (80, 12288, 96),
    "megatron-310b": (96, 16384, 128),
    "megatron-530b": (105, 20480, 128),
    "megatron-1t": (128, 25600, 160),
    "gpt3-175b": (96, 12288, 96),
})

# Llama 3 (Grattafiori et al. 2024, Table 3) and Mixtral 8x7B (Jiang et al. 2024, Table 1).
_LLAMA = MappingProxyType({
    "llama3-8b": dict(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256, seq=8192),
    "llama3-70b": dict(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256, seq=8192),
    "llama3-405b": dict(layers=126, hidden=16384, ffn=53248, heads=128, kv_heads=8, vocab=128256, seq=8192),
})
_MIXTRAL = MappingProxyType({
    "mixtral-8x7b": dict(
        layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=32000, seq=4096, experts=8, topk=2
    ),
})

_INLINE_KEYS = MappingProxyType({
    "gpt": (("layers", "hidden", "heads"), ("vocab", "seq", "ffn")),
    "llama": (("layers", "hidden", "ffn", "heads"), ("kv_heads", "vocab", "seq")),
    "mixtral": (("layers", "hidden", "ffn", "heads", "experts", "topk"), ("kv_heads", "vocab", "seq")),
})
_INLINE_DEFAULTS = MappingProxyType({"vocab": _GPT_VOCAB, "seq": _GPT_SEQ})


def list_presets() -> tuple[str, ...]:
    """Names accepted as ``--model`` presets."""
    return ("gpt2", *_MEGATRON, *_LLAMA, *_MIXTRAL)


# --- public entry -------------------------------------------------------------------------------------------


def build_model(spec: str, *, batch: int = 1, seq: int | None = None, device: str = "meta") -> ModelBundle:
    """Build the model ``spec`` names (see the module docstring), with inputs of shape (batch, seq)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"model spec must be a non-empty string, got {spec!r}; presets: {_preset_list()}")
    _check_positive("batch", batch)
    if seq is not None:
        _check_positive("seq", seq)
    spec = spec.strip()
    dims, make = _resolve(spec)
    if dims is None:  # user code
        return _build_user(spec, batch=batch, seq=seq, device=device)
    if seq is not None:
        dims = replace(dims, seq=seq)
    model = _on_device(lambda: make(dims, dims.layers), device)
    ids = _make_ids(batch, dims.seq, device)
    return ModelBundle(
        name=spec,
        model=model,
        example_inputs=(ids,),
        dims=dims,
        labels=_make_ids(batch, dims.seq, device),
        rebuild=lambda layers: _on_device(lambda: make(dims, layers), device),
    )


def model_dims(spec: str, *, seq: int | None = None) -> ModelDims:
    """The dimensions ``spec`` names, without building the model (not for ``module.path:function`` specs)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"model spec must be a non-empty string, got {spec!r}; presets: {_preset_list()}")
    dims, _ = _resolve(spec.strip())
    if dims is None:
        raise ConfigError(f"{spec!r} is user code: its dimensions are known only after build_model()")
    if seq is not None:
        _check_positive("seq", seq)
        dims = replace(dims, seq=seq)
    return dims


def _resolve(spec: str) -> tuple[ModelDims | None, Callable | None]:
    """(dims, maker) for every form but user code, which gives (None, None)."""
    if spec in _MEGATRON:
        layers, hidden, heads = _MEGATRON[spec]
        return _gpt_dims(layers=layers, hidden=hidden, heads=heads), _make_gpt
    if spec == "gpt2":
        return _gpt2_dims(), _make_gpt2
    if spec in _LLAMA:
        return _llama_dims(**_LLAMA[spec]), _make_llama
    if spec in _MIXTRAL:
        return _mixtral_dims(**_MIXTRAL[spec]), _make_mixtral
    head = spec.split(":", 1)[0]
    if head in _INLINE_KEYS and ":" in spec:
        return _parse_inline(head, spec.split(":", 1)[1])
    if spec.endswith(".json") or Path(spec).is_dir():
        return _hf_config_dims(spec)
    if ":" in spec and looks_like_user_spec(spec):
        return None, None
    raise ConfigError(
        f"unknown model spec {spec!r}: use a preset ({_preset_list()}), inline dims "
        "('gpt:layers=..,hidden=..,heads=..', 'llama:...', 'mixtral:...'), a config.json path, "
        "or 'module.path:function'"
    )


def _preset_list() -> str:
    return ", ".join(list_presets())


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name}={value!r} must be a positive integer")


def _on_device(fn: Callable[[], Any], device: str) -> Any:
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device={device!r} is not a torch device ({e}); use 'meta' or 'cpu'") from None
    with dev:
        model = fn()
    model.train()
    return model


def _make_ids(batch: int, seq: int, device: str) -> Any:
    import torch

    return torch.zeros(batch, seq, dtype=torch.long, device=device)


# --- inline specs -------------------------------------------------------------------------------------------


def _parse_inline(arch: str, body: str) -> tuple[ModelDims, Callable]:
    required, optional = _INLINE_KEYS[arch]
    allowed = required + optional
    values: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise ConfigError(f"{arch} spec item {item!r} is not key=value; keys: {', '.join(allowed)}")
        if key not in allowed:
            raise ConfigError(f"{arch} spec: unknown key {key!r}; allowed keys: {', '.join(allowed)}")
        try:
            values[key] = int(raw.strip())
        except ValueError:
            raise ConfigError(f"{arch} spec: {key}={raw!r} is not an integer") from None
        _check_positive(f"{arch} spec {key}", values[key])
    missing = [k for k in required if k not in values]
    if missing:
        raise ConfigError(f"{arch} spec misses {', '.join(missing)}; required keys: {', '.join(required)}")
    for k, v in _INLINE_DEFAULTS.items():
        values.setdefault(k, v)
    if arch == "gpt":
        return _gpt_dims(**values), _make_gpt
    values.setdefault("kv_heads", values["heads"])
    if arch == "llama":
        return _llama_dims(**values), _make_llama
    return _mixtral_dims(**values), _make_mixtral


def _check_heads(hidden: int, heads: int, kv_heads: int) -> None:
    if hidden % heads:
        raise ConfigError(f"hidden={hidden} is not divisible by heads={heads}; pick heads dividing hidden")
    if heads % kv_heads:
        raise ConfigError(f"heads={heads} is not divisible by kv_heads={kv_heads}; pick kv_heads dividing heads")


def _gpt_dims(*, layers: int, hidden: int, heads: int, vocab: int = _GPT_VOCAB, seq: int = _GPT_SEQ,
              ffn: int | None = None) -> ModelDims:
    _check_heads(hidden, heads, heads)
    return ModelDims(arch="gpt", layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
                     ffn_hidden=ffn or 4 * hidden, vocab=vocab, seq=seq, glu=False, tied_embeddings=True)


def _llama_dims(*, layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int, seq: int,
                arch: Arch = "llama", experts: int = 0, topk: int = 0) -> ModelDims:
    _check_heads(hidden, heads, kv_heads)
    return ModelDims(arch=arch, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn_hidden=ffn,
                     vocab=vocab, seq=seq, experts=experts, topk=topk, glu=True, tied_embeddings=False)


def _mixtral_dims(*, experts: int, topk: int, **kw: int) -> ModelDims:
    if topk > experts:
        raise ConfigError(f"mixtral spec: topk={topk} exceeds experts={experts}; pick topk <= experts")
    return _llama_dims(arch="mixtral", experts=experts, topk=topk, **kw)


def _gpt2_dims() -> ModelDims:
    return ModelDims(arch="gpt", layers=12, hidden=768, heads=12, kv_heads=12, ffn_hidden=3072, vocab=50257,
                     seq=1024, glu=False, tied_embeddings=True)


# --- makers: (dims, layers) -> nn.Module ---------------------------------------------------------------------


def _make_gpt(dims: ModelDims, layers: int) -> Any:
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        vocab_size=dims.vocab, hidden_size=dims.hidden, num_hidden_layers=layers, ffn_dim=dims.ffn_hidden,
        num_attention_heads=dims.heads, max_position_embeddings=dims.seq, activation_function="gelu",
        word_embed_proj_dim=dims.hidden, do_layer_norm_before=True, dropout=0.1, attention_dropout=0.0,
        tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa",
    )
    return OPTForCausalLM(cfg)


def _make_gpt2(dims: ModelDims, layers: int) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=layers, n_embd=dims.hidden, n_head=dims.heads, n_positions=dims.seq,
                     vocab_size=dims.vocab, attn_pdrop=0.0, use_cache=False, attn_implementation="sdpa")
    return GPT2LMHeadModel(cfg)


def _make_llama(dims: ModelDims, layers: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.ffn_hidden,
        num_hidden_layers=layers, num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
        max_position_embeddings=dims.seq, rope_theta=500000.0, tie_word_embeddings=False, use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def _make_mixtral(dims: ModelDims, layers: int) -> Any:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=dims.vocab, hidden_size=dims.hidden, intermediate_size=dims.ffn_hidden,
        num_hidden_layers=layers, num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
        max_position_embeddings=dims.seq, num_local_experts=dims.experts, num_experts_per_tok=dims.topk,
        tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa",
        experts_implementation="batched_mm", output_router_logits=False,
    )
    return MixtralForCausalLM(cfg)


# --- Hugging Face config.json -------------------------------------------------------------------------------


def _hf_config_dims(spec: str) -> tuple[ModelDims, Callable]:
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read model config {path}: {e.strerror}; give a config.json path") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(f"{path}: no 'model_type' key; a Hugging Face config.json names its model_type")
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    kind = data.pop("model_type")
    if kind not in CONFIG_MAPPING_NAMES:
        close = difflib.get_close_matches(str(kind), list(CONFIG_MAPPING_NAMES), n=5, cutoff=0.6)
        hint = f"close matches: {', '.join(close)}" if close else "check the spelling"
        raise ConfigError(f"{path}: model_type {kind!r} is unknown to transformers; {hint}")
    try:
        cfg = AutoConfig.for_model(kind, **data)
    except ValueError as e:
        raise ConfigError(f"{path}: model_type {kind!r} is unknown to transformers ({e})") from None
    cfg.use_cache = False
    text = getattr(cfg, "get_text_config", lambda: cfg)()
    g = lambda *names, default=0: next((getattr(text, n) for n in names if getattr(text, n, None)), default)  # noqa: E731
    hidden = g("hidden_size", "n_embd", "d_model")
    heads = g("num_attention_heads", "n_head")
    experts = g("num_local_experts", "num_experts", "n_routed_experts")
    dims = ModelDims(
        arch="hf", layers=g("num_hidden_layers", "n_layer"), hidden=hidden, heads=heads,
        kv_heads=g("num_key_value_heads", default=heads), ffn_hidden=g("intermediate_size", "ffn_dim", "n_inner",
                                                                       default=4 * hidden),
        vocab=g("vocab_size"), seq=g("max_position_embeddings", "n_positions", default=2048),  # --seq overrides
        experts=experts, topk=g("num_experts_per_tok", "top_k") if experts else 0,
        glu=hasattr(text, "hidden_act") and "gelu" not in str(getattr(text, "hidden_act", "")),
        tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
    )
    if not dims.layers:
        raise ConfigError(f"{path}: cannot find the number of layers (num_hidden_layers / n_layer)")

    def make(d: ModelDims, layers: int) -> Any:
        from transformers import AutoModelForCausalLM

        c = cfg.__class__.from_dict(cfg.to_dict())
        for name in ("num_hidden_layers", "n_layer"):
            if hasattr(text, name):
                setattr(c.get_text_config() if hasattr(c, "get_text_config") else c, name, layers)
        kwargs = {"attn_implementation": "sdpa"}
        if kind in sink_attention.MODEL_TYPES:  # softmax with per-head sinks: no sdpa in transformers
            kwargs["attn_implementation"] = sink_attention.register()
        elif mla_attention.needs_padded_v(text):  # narrower v than q / k: one fused sdpa with v padded
            kwargs["attn_implementation"] = mla_attention.register()
        if experts:
            kwargs["experts_implementation"] = "batched_mm"
        try:
            return AutoModelForCausalLM.from_config(c, **kwargs)
        except (ValueError, KeyError) as e:
            raise UnsupportedModelError(
                f"{path}: transformers cannot build a causal LM for model_type {kind!r} ({e}); "
                "wrap the model in a 'module.path:function' spec instead"
            ) from None

    return dims, make


# --- user code ----------------------------------------------------------------------------------------------


def _build_user(spec: str, *, batch: int, seq: int | None, device: str) -> ModelBundle:
    built = build_user_model(spec, batch=batch, seq=seq, device=device)
    heads = int(built.hints.get("heads", 0))
    dims = ModelDims(arch="custom", layers=_count_layers(built.model), hidden=0, heads=heads,
                     kv_heads=int(built.hints.get("kv_heads", heads)), ffn_hidden=0, vocab=0,
                     seq=_token_seq(built.example_inputs))
    return ModelBundle(name=spec, model=built.model, example_inputs=built.example_inputs, dims=dims)


def _token_seq(inputs: tuple) -> int:
    """S of the first (batch, seq) integer input; 0 (known only after tracing) when there is none."""
    import torch

    for x in inputs:
        if isinstance(x, torch.Tensor) and x.dim() == 2 and not x.dtype.is_floating_point:
            return int(x.shape[1])
    return 0


def _count_layers(model: Any) -> int:
    from planner.trace import find_layer_list

    found = find_layer_list(model)
    return len(found[1]) if found else 0

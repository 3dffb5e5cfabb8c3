"""Shared pieces of the runtime tests: tiny transformers models, data, the single-process reference, comparisons.

Every check compares a parallel run with the single-process model built from the same seed (runtime.materialize
seeds each module from its FQN), over ``STEPS`` SGD-with-momentum steps: loss each step, every gathered gradient each step,
and the parameters at the end. Tolerances (float32): rtol=1e-4, atol=1e-5 (reduction order differs between a
sharded matmul / reduce-scatter and the dense one; errors seen are ~1e-7).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 3
RTOL, ATOL = 1e-4, 1e-5
VOCAB, HIDDEN, SEQ = 128, 64, 8


def opt_model(*, device: str = "meta", tie: bool = False) -> nn.Module:
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, ffn_dim=4 * HIDDEN, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=HIDDEN, activation_function="gelu", dropout=0.0,
        attention_dropout=0.0, tie_word_embeddings=tie, pad_token_id=1,
    )
    with torch.device(device):
        return OPTForCausalLM(cfg)


def llama_model(*, device: str = "meta") -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )
    with torch.device(device):
        return LlamaForCausalLM(cfg)


def mixtral_model(*, device: str = "meta") -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=False, router_jitter_noise=0.0,
    )
    with torch.device(device):
        return MixtralForCausalLM(cfg)


def mixtral_window_model(*, device: str = "meta") -> nn.Module:
    """Mixtral with a sliding window of half the sequence, so the window changes the attention."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, num_local_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=False, router_jitter_noise=0.0, sliding_window=SEQ // 2,
    )
    with torch.device(device):
        return MixtralForCausalLM(cfg)


def gpt2_model(*, device: str = "meta") -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
    )
    with torch.device(device):
        return GPT2LMHeadModel(cfg)


def opt_tied_model(*, device: str = "meta") -> nn.Module:
    return opt_model(device=device, tie=True)


def handwritten_gpt_model(*, device: str = "meta") -> nn.Module:
    """The plain-torch GPT of tests/models/gpt.py (no transformers), at this file's sizes; its head is tied."""
    from tests.models.gpt import GPT

    with torch.device(device):
        return GPT(layers=2, hidden=HIDDEN, heads=4, vocab=VOCAB, max_seq=64)


MODELS: dict[str, Callable[..., nn.Module]] = {
    "opt": opt_model, "opt_tied": opt_tied_model, "llama": llama_model, "mixtral": mixtral_model,
    "mixtral_window": mixtral_window_model, "gpt2": gpt2_model, "handwritten_gpt": handwritten_gpt_model,
}


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def batches(global_batch: int, *, steps: int = STEPS, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(2, VOCAB, (global_batch, SEQ + 1), generator=gen)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    # SGD + momentum, not Adam: Adam divides by sqrt(v) and turns gradients that are zero in exact arithmetic
    # (the key bias: softmax ignores a per-query constant) but ~1e-9 in float32 into lr-sized steps of noise.
    return torch.optim.SGD(params, lr=0.5, momentum=0.9, foreach=False)


@functools.lru_cache(maxsize=None)
def reference_run(model_name: str, global_batch: int, *, seed: int = 0) -> dict[str, Any]:
    """The single-process run: losses, gradients per step, final parameters."""
    from runtime.materialize import materialize

    model = materialize(MODELS[model_name](), device="cpu", seed=seed)
    opt = make_optimizer(model.parameters())
    losses, grads = [], []
    for inputs, targets in batches(global_batch):
        out = model(inputs)
        loss = loss_fn(getattr(out, "logits", out), targets)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def parallel_run(pm: Any, global_batch: int) -> dict[str, Any]:
    """The same steps through a ParallelModel; gradients and parameters gathered (collective: all ranks)."""
    opt = make_optimizer(pm.parameters())
    losses, grads = [], []
    for inputs, targets in batches(global_batch):
        losses.append(pm.step(inputs, targets))
        grads.append({n: full(p.grad) for n, p in pm.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads, "params": {n: full(p) for n, p in pm.named_parameters()}}


def compare(got: dict[str, Any], want: dict[str, Any], *, what: str) -> None:
    """assert_close of losses, per-step gradients and final parameters; names must match exactly."""
    for step, (g, w) in enumerate(zip(got["losses"], want["losses"], strict=True)):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} loss step {step}: {m}")
    for step, (g, w) in enumerate(zip(got["grads"], want["grads"], strict=True)):
        if set(g) != set(w):
            raise AssertionError(f"{what}: gradient names differ: {sorted(set(g) ^ set(w))}")
        for n in w:
            torch.testing.assert_close(g[n], w[n], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} grad {n} step {step}: {m}")
    for n, w in want["params"].items():
        torch.testing.assert_close(got["params"][n], w, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} param {n}: {m}")


def restrict(want: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """The reference cut down to the parameters a rank holds (a pipeline rank reports only its stage's)."""
    names = set(got["params"])
    if not names <= set(want["params"]):
        raise AssertionError(f"unknown parameters {sorted(names - set(want['params']))}")
    return {
        "losses": want["losses"],
        "grads": [{n: g[n] for n in names} for g in want["grads"]],
        "params": {n: want["params"][n] for n in names},
    }


def count_attention_calls(layers: dict, family: str) -> dict:
    """Forward calls of each layer's attention module (twice per micro-batch where the layer is recomputed)."""
    calls = {f: 0 for f in layers}
    child = "attn" if family == "gpt2" else "self_attn"
    for f, layer in layers.items():
        def hook(*_args, _f=f):
            calls[_f] += 1
        layer.get_submodule(child).register_forward_hook(hook)
    return calls

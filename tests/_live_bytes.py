"""A live-storage counter for the memory-truth tests: the peak of the bytes every live tensor storage holds, and
at that peak the split into parameters, gradients, optimizer states, activations and temporaries.

``torch.distributed._tools.mem_tracker.MemTracker`` refuses a root module called once per micro-batch (the
runtime's gradient accumulation), so this counts by itself: a ``TorchDispatchMode`` registers the storage of
every op's output (and of the tensors alive when it starts) by weak reference, and after every op sums their
current sizes (``UntypedStorage.nbytes()``: FSDP2 frees and re-allocates its unsharded parameters with
``storage.resize_``, which no op records). At each new peak the live storages are split:

- parameters: the storages of the modules' current parameters (FSDP2's unsharded parameters while gathered,
  which it sets on the modules) and of FSDP2's sharded parameters;
- gradients: ``.grad`` of those, and FSDP2's unsharded accumulated gradients;
- optimizer: the tensors of ``optimizer.state``;
- activations: what autograd saved for the backward (``saved_tensors_hooks``) that is none of the above;
- temporaries: everything else (all-gather / reduce-scatter staging buffers, logits, the loss, scratch).

``temporaries_at_peak`` lists those by size with the op that made each storage, ``peak_op`` the op at the peak.
(``runtime/measure/live_bytes.py`` is ``autopar check``'s own counter, with its own labels; this one is the tests'.)
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries")


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return t.to_local() if hasattr(t, "to_local") else t


def _fsdp_params(modules: Iterable[nn.Module]) -> list:
    try:
        from torch.distributed.fsdp import FSDPModule, fully_shard
    except ImportError:  # pragma: no cover
        return []
    out = []
    for root in modules:
        for m in root.modules():
            if isinstance(m, FSDPModule):
                group = fully_shard.state(m)._fsdp_param_group
                if group is not None:
                    out.extend(group.fsdp_params)
    return out


class LiveBytes(TorchDispatchMode):
    """Count live storage bytes while active; ``peak`` (bytes) and ``at_peak`` (bytes per category)."""

    def __init__(self, modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None = None) -> None:
        super().__init__()
        self.modules = list(modules)
        self.optimizer = optimizer
        self._live: dict[int, weakref.ref] = {}
        self._saved: dict[int, weakref.ref] = {}
        self.peak = 0
        self._op = self.peak_op = ""
        self.made_by: dict[int, str] = {}
        self.temporaries_at_peak: list[tuple[int, str]] = []
        self.at_peak: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    # --- what is alive ---------------------------------------------------------------------------------
    def _add(self, t: torch.Tensor) -> None:
        t = _local(t)
        if not isinstance(t, torch.Tensor) or t.is_meta:
            return
        st = t.untyped_storage()
        k = st._cdata
        if k not in self._live or self._live[k]() is None:
            self._live[k] = weakref.ref(st)
            self.made_by[k] = self._op

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            st = _local(t).untyped_storage()
            self._saved[st._cdata] = weakref.ref(st)
        return t

    def _state_tensors(self) -> list[torch.Tensor]:
        out = []
        for m in self.modules:
            out += [t for t in m.parameters()] + [t for t in m.buffers()]
            out += [p.grad for p in m.parameters() if p.grad is not None]
        for fp in _fsdp_params(self.modules):
            out += [fp.sharded_param]
            if fp.sharded_param.grad is not None:
                out.append(fp.sharded_param.grad)
        if self.optimizer is not None:
            out += [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return out

    def __enter__(self):
        for t in self._state_tensors():
            self._add(t)
        self._hooks.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._op = str(func)
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self._update()
        return out

    def sample(self) -> None:
        """Count now (between ops: e.g. after the optimizer made its states)."""
        for t in self._state_tensors():
            self._add(t)
        self._update()

    def _alive(self) -> dict[int, int]:
        out, dead = {}, []
        for k, ref in self._live.items():
            st = ref()
            if st is None:
                dead.append(k)
            else:
                out[k] = st.nbytes()
        for k in dead:
            del self._live[k]
        return out

    def _update(self) -> None:
        alive = self._alive()
        total = sum(alive.values())
        if total > self.peak:
            self.peak = total
            self.at_peak = self._split(alive)
            self.peak_op = self._op

    # --- categories ------------------------------------------------------------------------------------
    def _split(self, alive: dict[int, int]) -> dict[str, int]:
        params, grads, opt = set(), set(), set()
        for m in self.modules:
            for p in m.parameters():
                params.add(_key(_local(p)))
                if p.grad is not None:
                    grads.add(_key(_local(p.grad)))
        for fp in _fsdp_params(self.modules):
            params.add(_key(_local(fp.sharded_param)))
            if fp.sharded_param.grad is not None:
                grads.add(_key(_local(fp.sharded_param.grad)))
            if fp.unsharded_accumulated_grad is not None:
                grads.add(_key(_local(fp.unsharded_accumulated_grad)))
            up = getattr(fp, "_unsharded_param", None)
            if up is not None and up.grad is not None:
                grads.add(_key(_local(up.grad)))
        if self.optimizer is not None:
            for s in self.optimizer.state.values():
                for v in s.values():
                    if isinstance(v, torch.Tensor) and v.numel() > 1:
                        opt.add(_key(_local(v)))
        saved = {k for k, r in self._saved.items() if r() is not None}
        out = dict.fromkeys(CATEGORIES, 0)
        temps: list[tuple[int, str]] = []
        for k, n in alive.items():
            if k in params:
                out["parameters"] += n
            elif k in grads:
                out["gradients"] += n
            elif k in opt:
                out["optimizer"] += n
            elif k in saved:
                out["activations"] += n
            else:
                out["temporaries"] += n
                temps.append((n, self.made_by.get(k, "")))
        self.temporaries_at_peak = sorted(temps, reverse=True)
        return out

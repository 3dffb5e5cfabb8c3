"""Live tensor bytes by category, counted as PyTorch allocates them: ``LiveBytes``, a ``TorchDispatchMode``.

Every tensor an op returns inside the mode has its untyped storages counted once (a storage shared by views
counts once) until the storage is freed (a weakref finalizer on the storage object, as
``torch.distributed._tools.mem_tracker.MemTracker`` keeps its accounting); ``UntypedStorage.resize_`` (how FSDP2
frees and re-allocates its gathered parameters) is followed while the mode is active. Each storage has one
category (``CATEGORIES``): the one in force when it was made (``mt.category``, set by the caller per phase:
``activations`` in forward, ``temporaries`` in backward, ``optimizer`` in the optimizer step), until ``relabel``
moves it: a parameter's gradient becomes ``gradients`` when autograd accumulates it (``track_grads`` installs
the hooks), what FSDP2's collectives allocate is ``comm_buffers`` (``fsdp_comm_labels``).

``peak`` is the largest total seen and ``peak_by_category`` the split at that moment; ``peak_where`` names the
phase the peak fell in. With a ``FakeTensorMode`` active when the mode is entered, fake tensors are counted
(nothing is allocated) and DTensor's own sharding propagation (a nested fake mode) is not.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Iterable, Iterator

import torch
import torch.distributed._tools.fake_collectives  # noqa: F401 - fake impls of c10d ops under FakeTensorMode
from torch._guards import active_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)
"""Tensor types whose storage is their own (``untyped_storage()``); other subclasses go through
``get_untyped_storages`` (wrapper subclasses: their inner tensors)."""

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporaries", "comm_buffers", "other")
"""parameters: this rank's local parameter shards; gradients: their gradients (and FSDP2's unsharded,
accumulated ones); optimizer: optimizer states; activations: forward allocations still alive; temporaries:
backward / optimizer-step allocations that are none of these; comm_buffers: FSDP2 all-gather / reduce-scatter
buffers and gathered parameters, DDP buckets, pipeline send / receive buffers; other: module buffers and the
rest."""


class LiveBytes(TorchDispatchMode):
    """See the module docstring. ``mt.category`` is the category of new storages; ``mt.where`` a label of the
    current phase (recorded with the peak)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, list] = {}  # storage key -> [nbytes, category]
        self._refs: dict[int, weakref.ref] = {}  # storage key -> weak reference to the storage
        self.by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.peak = 0
        self.peak_by_category: dict[str, int] = dict(self.by_category)
        self.peak_where = ""
        self.category = "other"
        self.where = ""
        self._fake_on_entry: Any = None
        self._orig_resize = None
        self._depth = 0

    # --- accounting ---------------------------------------------------------------------------------------
    def _key(self, st: torch.UntypedStorage) -> int:
        return st._cdata

    def _add_storage(self, st: torch.UntypedStorage, category: str) -> None:
        key = st._cdata
        entry = self._live.get(key)
        nbytes = st.nbytes()
        if entry is not None:
            if entry[0] != nbytes:  # resized
                self._change(entry, nbytes - entry[0])
            return
        entry = [0, category]
        self._live[key] = entry
        # a plain weak reference with a callback (what weakref.finalize wraps, without its registry): the
        # storage's Python object lives as long as the storage
        self._refs[key] = weakref.ref(st, functools.partial(self._freed, key))
        self._change(entry, nbytes)

    def _add_tensor(self, x: torch.Tensor, category: str) -> None:
        if type(x) in _PLAIN:
            self._add_storage(x.untyped_storage(), category)
        else:  # a wrapper subclass (DTensor): its inner tensors' storages
            for st in get_untyped_storages(x):
                self._add_storage(st, category)

    def _add_out(self, out: Any, category: str) -> None:
        """Count what an op returned: a tensor or a (nested) tuple / list of them, else any pytree."""
        if isinstance(out, torch.Tensor):
            self._add_tensor(out, category)
        elif isinstance(out, (tuple, list)):
            for x in out:
                if isinstance(x, torch.Tensor):
                    self._add_tensor(x, category)
                elif x is not None and not isinstance(x, (int, float, bool)):
                    self._add_out(x, category)
        elif out is not None and not isinstance(out, (int, float, bool)):
            tree_map_only(torch.Tensor, lambda x: self._add_tensor(x, category), out)

    def _change(self, entry: list, delta: int) -> None:
        entry[0] += delta
        self.by_category[entry[1]] += delta
        self.total += delta
        if delta > 0 and self.total > self.peak:
            self.peak = self.total
            self.peak_by_category = dict(self.by_category)
            self.peak_where = self.where

    def _freed(self, key: int, ref: Any) -> None:
        if self._refs.get(key) is ref:
            del self._refs[key]
            self._free(key)

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.by_category[entry[1]] -= entry[0]
            self.total -= entry[0]

    def add(self, t: Any, category: str | None = None) -> None:
        """Count the storages of ``t`` (tensors in any nesting, DTensor's local shards) if not yet counted."""
        self._add_out(t, category or self.category)

    def relabel(self, t: Any, category: str) -> None:
        """Move the storages of ``t`` to ``category`` (counting them first if they are not yet counted)."""
        def one(x: torch.Tensor) -> None:
            for st in get_untyped_storages(x):
                entry = self._live.get(self._key(st))
                if entry is None:
                    self._add_storage(st, category)
                elif entry[1] != category:
                    self.by_category[entry[1]] -= entry[0]
                    self.by_category[category] += entry[0]
                    entry[1] = category
        tree_map_only(torch.Tensor, one, t)

    def bytes_of(self, t: Any) -> int:
        """Bytes of the distinct storages of ``t`` (counted or not)."""
        seen: dict[int, int] = {}
        tree_map_only(torch.Tensor, lambda x: seen.update(
            {self._key(st): st.nbytes() for st in get_untyped_storages(x)}), t)
        return sum(seen.values())

    def reset_peak(self) -> None:
        """Start a new peak at the current total (what was allocated so far stays counted)."""
        self.peak = self.total
        self.peak_by_category = dict(self.by_category)
        self.peak_where = self.where

    @contextlib.contextmanager
    def phase(self, category: str, where: str) -> Iterator[None]:
        """New storages are ``category`` inside the block; ``where`` labels it."""
        before = self.category, self.where
        self.category, self.where = category, where
        try:
            yield
        finally:
            self.category, self.where = before

    # --- the mode -----------------------------------------------------------------------------------------
    def __enter__(self) -> "LiveBytes":
        if self._depth == 0:
            self._fake_on_entry = active_fake_mode()
            self._orig_resize = orig = torch.UntypedStorage.resize_
            tracker = self

            def resize_(st: torch.UntypedStorage, size: int) -> Any:
                out = orig(st, size)
                entry = tracker._live.get(tracker._key(st))
                if entry is None:
                    tracker._add_storage(st, tracker.category)
                elif entry[0] != st.nbytes():
                    tracker._change(entry, st.nbytes() - entry[0])
                return out

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        self._depth -= 1
        if self._depth == 0 and self._orig_resize is not None:
            torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if DTensor in types:
            return NotImplemented  # let DTensor run its local ops, which come back here
        out = func(*args, **(kwargs or {}))
        # an op returns tensors, a tuple / list of them, or values without storage (sizes, a device: half the
        # ops of a fake step are prim.device, asked by autograd and DTensor), which are not looked at further
        if isinstance(out, (torch.Tensor, tuple, list)) and active_fake_mode() is self._fake_on_entry:
            self._add_out(out, self.category)
        return out


def track_grads(mt: LiveBytes, params: Iterable[torch.nn.Parameter]) -> list:
    """Hooks that relabel each parameter's gradient as ``gradients`` when autograd accumulates it; the handles."""
    handles = []
    for p in params:
        if p.requires_grad:
            handles.append(p.register_post_accumulate_grad_hook(
                lambda q: mt.relabel(q.grad, "gradients") if q.grad is not None else None))
    return handles


@contextlib.contextmanager
def fsdp_comm_labels(mt: LiveBytes) -> Iterator[None]:
    """While active: FSDP2's all-gathers, their copy-out and its gradient reduce-scatters allocate
    ``comm_buffers``; the gathered parameters are ``comm_buffers`` and their gradients ``gradients`` (hooks on each
    unsharded parameter as FSDP2 makes it); the sharded gradients a reduce-scatter leaves are ``gradients``."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    saved = {name: getattr(_fsdp_param_group, name)
             for name in ("foreach_all_gather", "foreach_all_gather_copy_out", "foreach_reduce")}

    def labelled(fn: Any, name: str) -> Any:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with mt.phase("comm_buffers", mt.where):
                out = fn(*args, **kwargs)
            if name == "foreach_reduce":
                for fp in args[0]:
                    g = fp.sharded_param.grad
                    if g is not None:
                        mt.relabel(g, "gradients")
            return out
        return run

    orig_init = _fsdp_param.FSDPParam.init_unsharded_param

    def init_unsharded_param(self: Any) -> Any:
        fresh = not hasattr(self, "_unsharded_param")
        out = orig_init(self)
        if fresh and hasattr(self, "_unsharded_param"):
            track_grads(mt, [self._unsharded_param])
        mt.relabel(self._unsharded_param, "comm_buffers")
        return out

    for name, fn in saved.items():
        setattr(_fsdp_param_group, name, labelled(fn, name))
    _fsdp_param.FSDPParam.init_unsharded_param = init_unsharded_param
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(_fsdp_param_group, name, fn)
        _fsdp_param.FSDPParam.init_unsharded_param = orig_init


def fsdp_params(modules: Iterable[torch.nn.Module]) -> list:
    """The ``FSDPParam`` objects of every FSDP2 module among ``modules`` (and their submodules), each once."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    out, seen = [], set()
    for root in modules:
        for m in root.modules():
            if not isinstance(m, FSDPModule):
                continue
            state = fully_shard.state(m)
            for group in getattr(state, "_fsdp_param_groups", []):
                for fp in group.fsdp_params:
                    if id(fp) not in seen:
                        seen.add(id(fp))
                        out.append(fp)
    return out


def label_gradients(mt: LiveBytes, params: Iterable[torch.nn.Parameter], modules: Iterable[torch.nn.Module]) -> None:
    """Relabel every gradient the parameters (and FSDP2's unsharded / accumulated ones) hold as ``gradients``."""
    for p in params:
        if p.grad is not None:
            mt.relabel(p.grad, "gradients")
    for fp in fsdp_params(modules):
        acc = getattr(fp, "unsharded_accumulated_grad", None)
        if acc is not None:
            mt.relabel(acc, "gradients")
        up = getattr(fp, "_unsharded_param", None)
        if up is not None and up.grad is not None:
            mt.relabel(up.grad, "gradients")

"""Distributed checkpoints of a ``ParallelModel`` and its optimizer: save every N steps, resume, reshard on load.

    ckpt = Checkpointer(directory, every_steps=2)          # every rank; collective (makes a gloo group)
    start = ckpt.load_latest(pm, opt)                      # 0 when there is no checkpoint yet
    for step in range(start, total):
        loss = pm.step(*batch(step)); opt.step(); opt.zero_grad()
        ckpt.maybe_save(pm, opt, step=step + 1)            # after every_steps completed steps
    ckpt.wait()

Format: one ``torch.distributed.checkpoint`` (DCP) directory per save, ``<directory>/step_<n>/``, holding the
model state (``model.<fqn>``: DTensor shards under TP / FSDP2, plain tensors under DDP, each pipeline rank its
stage's) and the optimizer state per parameter FQN (``optim.<fqn>.<key>``: ``exp_avg``, ``momentum_buffer``, ...;
tensors shaped like the parameter are placed like it). Keys are the model's FQNs, independent of the plan, so DCP
reshards on load: a checkpoint saved as tp2 x pp2 on 4 ranks loads into dp2 on 2 ranks (each rank reads the
pieces of the global tensors it now holds). Optimizer hyperparameters (param_groups: lr, betas) are not saved: the
training script recreates them. ``autopar.json`` (written by rank 0 once every rank's data and the DCP metadata
are on disk, through a temporary file renamed into place) marks a save complete: only marked saves are ever
loaded, so a run killed during a save resumes from the previous complete one; an unmarked directory is removed
when the same step is saved again or a later save completes.

Async: saves use ``dcp.async_save`` (thread mode: the state is staged to CPU memory, training continues while a
background thread writes) on a dedicated gloo process group, so the training collectives and the checkpoint's
never interleave on one group. This works on CPU/gloo and on CUDA/NCCL. ``async_save=False`` saves synchronously.

Resuming under another plan or world size: build the model with the plan for the ranks that are left (e.g.
``auto_wrap(..., plan=None)`` re-plans for the running world size) and call ``load_latest``; the checkpoint's
model fingerprint must match (``PlanMismatchError`` otherwise).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from costmodel.errors import ConfigError, PlanMismatchError

log = logging.getLogger(__name__)

MARKER = "autopar.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointInfo:
    step: int
    """Completed optimizer steps at save time (training resumes at this step index)."""
    path: Path
    world_size: int
    degrees: dict[str, int]
    fingerprint: str


def latest_checkpoint(directory: str | Path) -> CheckpointInfo | None:
    """The complete checkpoint with the most steps under ``directory`` (None if there is none)."""
    root = Path(directory)
    best: CheckpointInfo | None = None
    if not root.is_dir():
        return None
    for sub in root.iterdir():
        m = _STEP_DIR.match(sub.name)
        if not m or not (sub / MARKER).is_file():
            continue
        meta = json.loads((sub / MARKER).read_text())
        info = CheckpointInfo(step=int(meta["step"]), path=sub, world_size=int(meta["world_size"]),
                              degrees=dict(meta["degrees"]), fingerprint=str(meta["fingerprint"]))
        if best is None or info.step > best.step:
            best = info
    return best


def _param_names(pm: Any) -> dict[int, str]:
    return {id(p): n for n, p in pm.named_parameters()}


def training_state(pm: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The flat state DCP saves: ``model.<fqn>`` and ``optim.<fqn>.<key>`` (see the module docstring)."""
    out: dict[str, Any] = {f"model.{k}": v for k, v in pm.state_dict().items()}
    names = _param_names(pm)
    for p, st in optimizer.state.items():
        name = names.get(id(p))
        if name is None:
            raise ConfigError("the optimizer holds a parameter that is not in the ParallelModel: build it from "
                              "pm.parameters()")
        for key, val in st.items():
            if isinstance(val, torch.Tensor):
                out[f"optim.{name}.{key}"] = val
    return out


def _empty_optimizer_state(pm: Any, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Create the optimizer state tensors the checkpoint holds (a fresh optimizer has none yet)."""
    wanted = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for name, p in pm.named_parameters():
        if id(p) not in wanted:
            continue
        prefix = f"optim.{name}."
        state = optimizer.state[p]
        for key, md in saved.items():
            if not key.startswith(prefix) or "." in key[len(prefix):]:
                continue
            sub = key[len(prefix):]
            shape = tuple(md.size) if hasattr(md, "size") else None
            if shape is None:
                continue
            if shape == tuple(p.shape):
                state[sub] = torch.zeros_like(p, dtype=md.properties.dtype)
            else:
                state[sub] = torch.zeros(shape, dtype=md.properties.dtype)


class Checkpointer:
    """Save every ``every_steps`` steps under ``directory`` (async by default); load the latest. Collective:
    construct, save and load on every rank."""

    def __init__(self, directory: str | Path, *, every_steps: int, async_save: bool = True, keep: int = 2) -> None:
        if every_steps < 1 or keep < 1:
            raise ConfigError(f"every_steps={every_steps} and keep={keep} must be >= 1")
        if not dist.is_initialized():
            raise ConfigError("Checkpointer needs torch.distributed: call runtime.init_distributed() first")
        self.directory = Path(directory)
        self.every_steps = every_steps
        self.async_save = async_save
        self.keep = keep
        self._group = dist.new_group(backend="gloo") if async_save else None
        self._pending: tuple[Future, dict[str, Any], Path] | None = None

    def maybe_save(self, pm: Any, optimizer: torch.optim.Optimizer, *, step: int) -> bool:
        """Save if ``step`` (completed steps) is a multiple of ``every_steps``; True if a save started."""
        if step % self.every_steps:
            return False
        self.save(pm, optimizer, step=step)
        return True

    def save(self, pm: Any, optimizer: torch.optim.Optimizer, *, step: int) -> Path:
        """Start saving (async: staged to CPU memory now, written in the background); collective."""
        path = self.directory / f"step_{step:08d}"
        if dist.get_rank() == 0 and path.exists() and not (path / MARKER).is_file():
            shutil.rmtree(path, ignore_errors=True)  # an interrupted save of this step: never mixed into the new one
        self.wait()
        meta = {
            "step": step, "world_size": dist.get_world_size(), "fingerprint": pm.plan.model.fingerprint,
            "degrees": {k: getattr(pm.plan.degrees, k) for k in ("tp", "cp", "pp", "dp", "ep")},
        }
        state = training_state(pm, optimizer)
        if self.async_save:
            resp = dcp.async_save(state, checkpoint_id=str(path), process_group=self._group)
            fut = resp.upload_completion if hasattr(resp, "upload_completion") else resp
            self._pending = (fut, meta, path)
        else:
            dcp.save(state, checkpoint_id=str(path))
            self._mark(meta, path)
            dist.barrier()
        log.info("checkpoint step %d -> %s (%s)", step, path, "async" if self.async_save else "sync")
        return path

    def poll(self) -> None:
        """Mark the in-flight async save complete if it is (non-blocking; any rank may call it at any time).
        DCP's coordinator writes the metadata only after gathering every rank's write result, so any rank's
        save future being done means the whole checkpoint is on disk: rank 0 writes the marker on its own."""
        if self._pending is None or not self._pending[0].done():
            return
        fut, meta, path = self._pending
        self._pending = None
        fut.result()
        self._mark(meta, path)

    def wait(self) -> None:
        """Block until the in-flight async save is on disk and marked complete; collective (a barrier)."""
        if self._pending is not None:
            fut, meta, path = self._pending
            self._pending = None
            fut.result()
            self._mark(meta, path)
        dist.barrier(group=self._group)

    def _mark(self, meta: dict[str, Any], path: Path) -> None:
        if dist.get_rank() == 0:
            tmp = path / (MARKER + ".tmp")
            tmp.write_text(json.dumps(meta, indent=1))
            tmp.replace(path / MARKER)
            self._prune()

    def _prune(self) -> None:
        """Keep the newest ``keep`` complete saves; drop older ones and unmarked (interrupted) ones below them."""
        steps = sorted((int(m.group(1)), p) for p in self.directory.iterdir() if (m := _STEP_DIR.match(p.name)))
        done = [(n, p) for n, p in steps if (p / MARKER).is_file()]
        for _, p in done[:-self.keep]:
            shutil.rmtree(p, ignore_errors=True)
        newest = done[-1][0] if done else -1
        for n, p in steps:
            if n < newest and not (p / MARKER).is_file():
                shutil.rmtree(p, ignore_errors=True)

    def load_latest(self, pm: Any, optimizer: torch.optim.Optimizer) -> int:
        """Load the latest complete checkpoint into ``pm`` and ``optimizer`` (resharding to the running plan);
        the step to resume at (0 without a checkpoint)."""
        info = latest_checkpoint(self.directory)
        if dist.get_world_size() > 1:  # every rank must agree on which checkpoint (rank 0's view)
            box = [info]
            dist.broadcast_object_list(box, src=0)
            info = box[0]
        if info is None:
            return 0
        load_checkpoint(pm, optimizer, info=info)
        return info.step


def load_checkpoint(pm: Any, optimizer: torch.optim.Optimizer, *, info: CheckpointInfo) -> None:
    """Load ``info``'s checkpoint into ``pm`` / ``optimizer`` under the running plan (DCP reshards)."""
    if info.fingerprint != pm.plan.model.fingerprint:
        raise PlanMismatchError(
            f"checkpoint {info.path} is of another model (fingerprint {info.fingerprint[:12]}..., this model "
            f"{pm.plan.model.fingerprint[:12]}...): point the run at this model's checkpoint directory"
        )
    if info.world_size != dist.get_world_size():
        log.info("resharding checkpoint of %d ranks %s onto %d ranks %s", info.world_size, info.degrees,
                 dist.get_world_size(), pm.plan.degrees)
    saved = dcp.FileSystemReader(str(info.path)).read_metadata().state_dict_metadata
    _empty_optimizer_state(pm, optimizer, saved)
    state = training_state(pm, optimizer)
    missing = sorted(k for k in state if k not in saved)
    if missing:
        raise PlanMismatchError(f"checkpoint {info.path} lacks {len(missing)} entries, e.g. {missing[:3]}")
    dcp.load(state, checkpoint_id=str(info.path))
    pm.load_state_dict({k[len("model."):]: v for k, v in state.items() if k.startswith("model.")})

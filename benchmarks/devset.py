"""The public development set: published pre-training runs, one frozen case per table row, with its source line.

``load_devset()`` reads the transcriptions in ``benchmarks/data/`` (Megatron-Bridge performance summary and
archive, NeMo 24.07 performance summary, torchtitan's Llama 3.1 8B H200 benchmark; each file's ``source`` block
says the repository, commit, what the columns mean and how cells were parsed) and returns ``DevCase`` records.
A table cell "a (b)" gives two cases from one row (``variant`` "plain" / "parenthesized"). The SC21 runs stay in
``megatron_sc21.json``, read by ``benchmarks/fidelity.py``.

``python -m benchmarks.devset [--rows] [--source NAME] [--release R]`` prints the counts per source / release /
system / precision / model, or one line per case, to check the transcription against the sources.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from costmodel.errors import ConfigError

DATA = Path(__file__).resolve().parent / "data"
MODELS = DATA / "models"
SOURCES = ("megatron_bridge_performance", "nemo_performance", "torchtitan_llama3_8b_h200")
_INT_FIELDS = ("line", "num_gpus", "num_nodes", "global_batch", "micro_batch", "seq_len", "tp", "pp", "cp", "vp",
               "ep", "etp", "dp", "fsdp", "grad_accum")
_FLOAT_FIELDS = ("tokens_per_s_per_gpu", "model_tflops_per_gpu", "step_time_s", "memory_gib")
_TEXT_FIELDS = ("id", "path", "variant", "release", "table", "model", "model_label", "system", "system_label",
                "precision", "precision_recipe", "precision_label", "quantization_note", "recompute", "optimizer")
_BOOL_FIELDS = ("moe_token_drop", "moe_force_balanced", "mtp")


@dataclass(frozen=True, kw_only=True, slots=True)
class DevCase:
    """One published measurement. None means the source does not give the value (never a guess)."""

    source: str  # transcription file stem, e.g. "megatron_bridge_performance"
    repository: str  # upstream repository of the table
    commit: str  # upstream commit the table was read at
    path: str  # file in that repository
    line: int  # line of the table row in that file at that commit
    id: str
    variant: str  # "plain", or "parenthesized" for the "(b)" figures of a cell "a (b)"
    release: str  # NeMo container release, or the torchtitan commit of the run
    table: str  # the heading of the table the row is in
    model: str  # benchmarks/data/models/<model>.json
    model_label: str  # the model as the table names it
    system: str  # dgx-h100, dgx-b200, dgx-b300, gb200-nvl72, gb300-nvl72, h200-8gpu-cx7
    system_label: str
    num_gpus: int
    num_nodes: int | None
    precision: str | None  # bf16, fp8, nvfp4
    precision_recipe: str | None  # current-scaling, mxfp8, nvfp4; None where the source says only FP8
    precision_label: str | None  # the cell as printed
    quantization_note: str | None
    global_batch: int  # sequences
    micro_batch: int  # sequences
    seq_len: int  # tokens
    tp: int
    pp: int
    cp: int
    vp: int | None  # virtual pipeline size (model chunks per pipeline rank)
    ep: int | None
    etp: int | None
    dp: int | None  # only where the source gives it
    fsdp: int | None  # Megatron-Bridge: 0 = DDP, > 0 = FSDP sharding group size; torchtitan: shard degree
    grad_accum: int | None
    recompute: str | None
    optimizer: str | None
    moe_token_drop: bool | None
    moe_force_balanced: bool | None
    mtp: bool | None
    tokens_per_s_per_gpu: float | None
    model_tflops_per_gpu: float | None  # 1e12 model FLOP/s per GPU, as printed
    step_time_s: float | None
    memory_gib: float | None
    footnotes: tuple[str, ...] = ()
    inconsistencies: tuple[str, ...] = ()  # codes of printed settings that contradict each other
    cells: tuple[tuple[str, str], ...] = ()  # (column header, raw cell) as printed
    extra: tuple[tuple[str, object], ...] = ()
    derived: tuple[tuple[str, str], ...] = field(default=())  # field -> where a value not in the table came from

    @property
    def model_parallel(self) -> int:
        """GPUs of one model replica: tp * pp * cp."""
        return self.tp * self.pp * self.cp

    @property
    def data_parallel(self) -> int:
        """dp as given, else GPUs / (tp * pp * cp) (ep folds inside dp x cp x tp, as Megatron-Core forms it)."""
        return self.dp if self.dp is not None else self.num_gpus // self.model_parallel

    @property
    def model_config(self) -> Path:
        return MODELS / f"{self.model}.json"

    @property
    def precision_key(self) -> str:
        """precision with its recipe when one is named, e.g. "fp8/mxfp8", "fp8", "bf16"; "?" when not given."""
        if self.precision is None:
            return "?"
        named = self.precision_recipe and self.precision_recipe != self.precision
        return f"{self.precision}/{self.precision_recipe}" if named else self.precision


def _case(source: str, src: dict, row: dict) -> DevCase:
    where = f"{source}.json row {row.get('id', '?')}"
    try:
        kw = {k: row[k] for k in _INT_FIELDS + _FLOAT_FIELDS + _TEXT_FIELDS + _BOOL_FIELDS}
        kw.update(
            source=source, repository=src["repository"], commit=src["commit"],
            footnotes=tuple(row["footnotes"]), inconsistencies=tuple(i["code"] for i in row["inconsistencies"]),
            cells=tuple(row["cells"].items()), extra=tuple(row["extra"].items()),
            derived=tuple(row["derived"].items()),
        )
    except KeyError as e:
        raise ConfigError(f"{where}: missing field {e}; regenerate the row with every DevCase field") from None
    for name in _INT_FIELDS:
        if kw[name] is not None and (not isinstance(kw[name], int) or isinstance(kw[name], bool)):
            raise ConfigError(f"{where}: {name}={kw[name]!r} is not an integer")
    for name in _FLOAT_FIELDS:
        if kw[name] is not None and not isinstance(kw[name], (int, float)):
            raise ConfigError(f"{where}: {name}={kw[name]!r} is not a number")
    return DevCase(**kw)


def load_source(name: str) -> tuple[dict, list[DevCase]]:
    """One transcription file: its ``source`` block and its cases."""
    path = DATA / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    return data["source"], [_case(name, data["source"], r) for r in data["rows"]]


RECIPES = "megatron_bridge_recipes"
"""``benchmarks/data/megatron_bridge_recipes.json``: the Megatron-Bridge performance recipe that ran each
Megatron-Bridge row, read at the tag of the row's container release (its speed settings: CUDA graphs, MoE
all-to-all overlap, fused grouped MLP, fp8 attention, recomputation)."""


def load_recipes(name: str = RECIPES) -> dict[str, dict]:
    """{case id: the recipe settings of that row} (``RECIPES``); rows it does not list ran none of them."""
    path = DATA / f"{name}.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from None
    rows = data.get("rows")
    if not isinstance(rows, dict):
        raise ConfigError(f"{path}: 'rows' must map case ids to recipe settings")
    return rows


def load_devset(sources: tuple[str, ...] = SOURCES) -> list[DevCase]:
    """Every case of the given transcription files, in file order."""
    cases: list[DevCase] = []
    for name in sources:
        cases += load_source(name)[1]
    return cases


def _counts(cases: list[DevCase], *keys: str) -> list[str]:
    got = Counter(tuple(str(getattr(c, k)) for k in keys) for c in cases)
    width = [max(len(k), *(len(g[i]) for g in got)) for i, k in enumerate(keys)]
    lines = ["  ".join(k.ljust(w) for k, w in zip(keys, width)) + "  cases"]
    lines += ["  ".join(v.ljust(w) for v, w in zip(g, width)) + f"  {n:5d}" for g, n in sorted(got.items())]
    return lines


def _row_line(c: DevCase) -> str:
    par = f"tp{c.tp} pp{c.pp} cp{c.cp} vp{c.vp or '-'} ep{c.ep or '-'} fsdp{'-' if c.fsdp is None else c.fsdp}"
    figs = f"tok/s/gpu {c.tokens_per_s_per_gpu} tflops {c.model_tflops_per_gpu}"
    if c.memory_gib is not None:
        figs += f" mem {c.memory_gib} GiB"
    flag = f"  !{','.join(c.inconsistencies)}" if c.inconsistencies else ""
    return (f"{c.path.split('/')[-1]}:{c.line:<4d} {c.variant[:5]:5s} {c.release:9s} {c.system:12s} {c.num_gpus:5d} "
            f"{c.model:22s} {c.precision_label or '-':7s} gbs{c.global_batch} mbs{c.micro_batch} seq{c.seq_len} "
            f"{par} {figs}{flag}")


def summary(cases: list[DevCase], header: dict[str, dict]) -> list[str]:
    """Counts per source (table rows against the rows counted in the source), release, system, precision, model."""
    lines = ["source                         table rows (counted in source)  cases"]
    for name, src in header.items():
        mine = [c for c in cases if c.source == name]
        rows = len({(c.path, c.line) for c in mine})
        lines.append(f"{name:30s} {rows:4d} ({src['row_counts']['table_rows']:4d})"
                     f"{'':22s}{len(mine):5d}   {src['repository']} @ {src['commit'][:10]} ({src['commit_date']})")
    for keys in (("source", "release"), ("system", "precision_key"), ("model",),
                 ("source", "system", "model", "precision_key")):
        lines += ["", *_counts(cases, *keys)]
    flagged = [c for c in cases if c.inconsistencies]
    lines += ["", f"{len(flagged)} cases print settings that contradict each other:"]
    lines += [f"  {c.id}: {', '.join(c.inconsistencies)}" for c in flagged]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", action="store_true", help="one line per case instead of the counts")
    ap.add_argument("--source", choices=SOURCES, help="only this transcription file")
    ap.add_argument("--release", help="only this release (e.g. 26.04.01)")
    args = ap.parse_args(argv)
    names = (args.source,) if args.source else SOURCES
    header, cases = {}, []
    for name in names:
        src, got = load_source(name)
        header[name] = src
        cases += got
    if args.release:
        cases = [c for c in cases if c.release == args.release]
    print("\n".join(_row_line(c) for c in cases) if args.rows else "\n".join(summary(cases, header)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The development set in benchmarks/data: every case has its source line, its numbers are the printed cells,
each file holds as many table rows as its source block says were counted in the upstream file, and the parallel
degrees multiply to the GPU count unless the row is recorded as printing contradictory settings."""

import json
import re

import pytest

from benchmarks.devset import DATA, MODELS, SOURCES, load_devset, load_source

# column header as printed -> DevCase field, per source
_COLUMNS = {
    "#-GPUs": "num_gpus", "GBS": "global_batch", "MBS": "micro_batch", "Sequence Length": "seq_len", "TP": "tp",
    "PP": "pp", "CP": "cp", "VP": "vp", "EP": "ep", "FSDP": "fsdp", "GA": "grad_accum",
    "Tokens / sec / GPU": "tokens_per_s_per_gpu", "Model TFLOP / sec / GPU": "model_tflops_per_gpu",
    "NUM_NODES": "num_nodes", "TPS/GPU": "tokens_per_s_per_gpu", "Memory(GiB)": "memory_gib",
}
_MEASURED = {"tokens_per_s_per_gpu", "model_tflops_per_gpu", "memory_gib"}
_PRECISION = {"BF16": ("bf16", None), "FP8": ("fp8", None), "FP8-CS": ("fp8", "current-scaling"),
              "FP8-MX": ("fp8", "mxfp8"), "MXFP8": ("fp8", "mxfp8"), "NVFP4": ("nvfp4", "nvfp4")}


def _plain(cell):
    """The cell without footnote marks and with a linked number as its number: '[888](url)' -> '888'."""
    return re.sub(r"\[([^\]^]+)\]\([^)]*\)", r"\1", re.sub(r"\[\^[^\]]+\]", "", cell)).strip()


def _number(text):
    if text == "n/a":
        return None
    return float(text) if "." in text else int(text)


def _split(cell):
    """'4 (8)' -> ('4', '8'); '64' -> ('64', None)."""
    m = re.fullmatch(r"(.*?)\s*(?:\(([^()]*)\))?", _plain(cell))
    return m.group(1), m.group(2)


@pytest.fixture(scope="module")
def files():
    return {name: load_source(name) for name in SOURCES}


@pytest.fixture(scope="module")
def cases():
    return load_devset()


def test_every_case_has_a_source_line(files):
    for name, (src, got) in files.items():
        assert len(src["commit"]) == 40, name
        paths = {f["path"] for f in src["files"]}
        for c in got:
            assert c.path in paths, c.id
            assert c.line > 0, c.id
        keys = [(c.path, c.line, c.variant) for c in got]
        assert len(keys) == len(set(keys)), f"{name}: two cases claim one row and variant"
        assert len({c.id for c in got}) == len(got), f"{name}: ids repeat"


def test_row_counts_equal_the_rows_counted_in_the_source(files):
    for name, (src, got) in files.items():
        for f in src["files"]:
            rows = {c.line for c in got if c.path == f["path"]}
            assert len(rows) == f["pretraining_table_rows"], (name, f["path"])
            for release, n in f["pretraining_table_rows_per_release"].items():
                assert len({c.line for c in got if c.path == f["path"] and c.release == release}) == n, release
        assert len(got) == src["row_counts"]["cases"], name
        # a second case comes from a row only where a cell prints "a (b)"
        for c in got:
            if c.variant == "parenthesized":
                assert any(_split(v)[1] is not None for k, v in c.cells if k not in ("Model", "System")), c.id


def test_parsed_numbers_are_the_printed_cells(cases):
    for c in cases:
        for header, raw in c.cells:
            name = _COLUMNS.get(header)
            if name is None:
                continue
            plain, paren = _split(raw)
            want = plain if c.variant == "plain" else paren
            if want is None and name not in _MEASURED:
                want = plain  # a configuration cell without parentheses holds for both variants
            assert getattr(c, name) == (None if want is None else _number(want)), (c.id, header, raw)
        printed = dict(c.cells).get("Precision")
        if printed is not None:
            plain, paren = _split(printed)
            label = plain if c.variant == "plain" or paren is None else paren
            assert (c.precision, c.precision_recipe) == _PRECISION[label], (c.id, printed)


def test_numbers_are_positive_and_every_case_has_a_measurement(cases):
    for c in cases:
        for name in ("num_gpus", "global_batch", "micro_batch", "seq_len", "tp", "pp", "cp"):
            assert isinstance(getattr(c, name), int) and getattr(c, name) > 0, (c.id, name)
        for name in ("vp", "ep", "grad_accum", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "memory_gib"):
            assert getattr(c, name) is None or getattr(c, name) > 0, (c.id, name)
        assert c.tokens_per_s_per_gpu or c.model_tflops_per_gpu or c.memory_gib, c.id


def _contradictions(c):
    found = set()
    if c.num_gpus % c.model_parallel:
        return {"model_parallel"}
    dp = c.num_gpus // c.model_parallel
    if c.grad_accum is not None and c.global_batch != c.micro_batch * dp * c.grad_accum:
        found.add("grad_accum")
    elif c.global_batch % (c.micro_batch * dp):
        found.add("global_batch")
    if c.ep and (c.num_gpus // c.pp) % c.ep:  # EP groups form inside the GPUs of one pipeline stage
        found.add("expert_parallel")
    return found


def test_parallel_degrees_multiply_to_the_gpu_count(cases):
    """tp*pp*cp*dp == GPUs with dp from GA (GBS / (MBS*GA)) where the table prints GA, or as given; every row
    that breaks a rule is recorded as inconsistent, and every recorded inconsistency is real."""
    for c in cases:
        assert _contradictions(c) == set(c.inconsistencies), c.id
        if "model_parallel" in c.inconsistencies:
            continue
        if c.dp is not None:
            assert c.model_parallel * c.dp == c.num_gpus, c.id
        if c.grad_accum is not None and "grad_accum" not in c.inconsistencies:
            dp = c.global_batch // (c.micro_batch * c.grad_accum)
            assert c.model_parallel * dp == c.num_gpus, c.id
        if c.vp is not None and c.vp > 1:
            assert c.pp > 1, c.id


def test_megatron_bridge_fsdp_is_the_sharding_group_the_nomenclature_defines(cases):
    for c in cases:
        if c.source == "megatron_bridge_performance" and c.fsdp:
            assert c.fsdp == c.num_gpus // (c.tp * c.pp), c.id  # "#GPUs / (TP x PP)"


def test_every_model_has_a_config_with_its_source(cases):
    for model in {c.model for c in cases}:
        path = MODELS / f"{model}.json"
        if not path.exists():
            continue  # listed in the source block as a model without a readable configuration
        cfg = json.loads(path.read_text())
        assert cfg["model_type"] and cfg["_source"]["numbers_from"], model
        for ref in cfg["_source"]["numbers_from"]:
            assert ref["repository"] and ref["path"] and ref["commit"], model
    missing = {c.model for c in cases if not c.model_config.exists()}
    listed = set(json.loads((DATA / "megatron_bridge_performance.json").read_text())["source"]["models_without_config"])
    assert missing == listed

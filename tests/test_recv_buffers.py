"""Pipeline receive buffers and boundary bytes as the frameworks keep and send them: the step model's
``recv_buffer_bytes`` against the buffers torch.distributed.pipelining's ``PipelineStage`` allocates (what the
autopar runtime and torchtitan run), on the fake process group."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from costmodel.analytic import gpt_workload
from costmodel.profiles import make_cluster
from costmodel.step import ParallelConfig, estimate_step, p2p_boundary_bytes, recv_buffer_bytes
from costmodel.targets import load_target

H, SEQ, MB = 64, 32, 2


@pytest.fixture
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(rank: int, world: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


def _torch_recv_bytes(stage_indices: list[int], num_stages: int, m: int) -> int:
    """Bytes of the distinct receive buffers the ``PipelineStage`` objects of one rank hold for a step of ``m``
    micro-batches (static shapes: what a schedule's first step prepares)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import InferenceMode

    x = torch.empty(MB, SEQ, H, dtype=torch.bfloat16)
    storages: dict[int, int] = {}
    stages = []  # alive until counted: a freed buffer's address is reused by the next stage's
    for i in stage_indices:
        st = PipelineStage(torch.nn.Linear(H, H, dtype=torch.bfloat16), stage_index=i, num_stages=num_stages,
                           device=torch.device("cpu"), input_args=(x,), output_args=(x,), output_grads=(x,),
                           input_grads=(x,))
        st._inference_mode = InferenceMode.STATIC  # what the schedule's warm-up vote sets for static shapes
        stages.append(st)
        st._prepare_forward_infra(m, (x,), None, has_backward=True)
        st._prepare_backward_infra(m)
        for infos in (*st.args_recv_info.values(), *st.grad_recv_info.values()):
            for info in infos:
                if info.buffer is not None:
                    storages[info.buffer.untyped_storage().data_ptr()] = info.buffer.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize(("pp", "v", "m"), [(3, 1, 5), (2, 2, 4)])
def test_receive_buffers_are_what_pipeline_stage_allocates(fake_world, pp, v, m):
    wl = gpt_workload(layers=2 * pp * v, hidden=H, heads=4, vocab=256, seq=SEQ)
    assert wl.dtype_bytes == 2  # the bf16 buffers below
    cfg = ParallelConfig(pp=pp, microbatch=MB, global_batch=MB * m, virtual_stages=v,
                         schedule="1f1b" if v == 1 else "interleaved-1f1b")
    k = load_target("autopar").constants
    priced = recv_buffer_bytes(wl, cfg, k, m)
    fake_world(0, pp)
    for rank in range(pp):
        assert priced[rank] == _torch_recv_bytes([rank + c * pp for c in range(v)], pp * v, m), rank
    # the step estimate carries them: against the same target keeping buffers for the micro-batches in flight
    target = load_target("autopar")
    in_flight = dataclasses.replace(target, constants=dataclasses.replace(k, recv_buffers_per_microbatch=False))
    cluster = make_cluster("local", 1, gpus_per_node=pp)
    kept, not_kept = (estimate_step(wl, cfg, cluster, target=t).stage_memory_gb for t in (target, in_flight))
    assert [(a - b) * 1e9 for a, b in zip(kept, not_kept)] == pytest.approx(priced.tolist(), rel=1e-9)


def test_megatron_keeps_in_flight_buffers_and_slices_the_boundary_over_tp():
    wl = gpt_workload(layers=8, hidden=H, heads=4, vocab=256, seq=SEQ)
    cfg = ParallelConfig(tp=2, pp=2, microbatch=MB, global_batch=8 * MB, sequence_parallel=False)
    whole = MB * SEQ * H * wl.dtype_bytes
    mega, ours, titan = (load_target(t).constants for t in ("megatron", "autopar", "torchtitan"))
    assert not recv_buffer_bytes(wl, cfg, mega, 8).any()
    assert recv_buffer_bytes(wl, cfg, ours, 8).tolist() == [8 * whole, 8 * whole]
    assert p2p_boundary_bytes(wl, mb=MB, tp=2, cp=1, sp=False, k=mega) == whole / 2  # scatter / gather
    assert p2p_boundary_bytes(wl, mb=MB, tp=2, cp=1, sp=True, k=ours) == whole  # runtime/pipeline.py: whole
    assert p2p_boundary_bytes(wl, mb=MB, tp=2, cp=1, sp=True, k=titan) == whole / 2  # sequence shard
    assert p2p_boundary_bytes(wl, mb=MB, tp=2, cp=1, sp=False, k=titan) == whole


def test_stage_outputs_are_what_pipeline_stage_keeps(fake_world):
    """torch's ``PipelineStage`` keeps each micro-batch's output in its forward cache until that micro-batch's
    backward: ``stage_output_bytes`` prices one boundary tensor per micro-batch in flight on every chunk but the
    last (the autopar runtime, torchtitan); Megatron pseudo-frees its sent outputs."""
    import numpy as np
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._utils import InferenceMode

    from costmodel.step import stage_output_bytes

    pp, inflight = 2, 3
    wl = gpt_workload(layers=2 * pp, hidden=H, heads=4, vocab=256, seq=SEQ)
    cfg = ParallelConfig(pp=pp, microbatch=MB, global_batch=MB * 4, schedule="1f1b")
    fake_world(0, pp)
    x = torch.empty(MB, SEQ, H, dtype=torch.bfloat16)
    st = PipelineStage(torch.nn.Linear(H, H, dtype=torch.bfloat16), stage_index=0, num_stages=pp,
                       device=torch.device("cpu"), input_args=(x,), output_args=(x,), output_grads=(x,),
                       input_grads=(x,))
    st._inference_mode = InferenceMode.STATIC
    st._prepare_forward_infra(4, (x,), None, has_backward=True)
    for i in range(inflight):
        st.forward_one_chunk(i, (torch.randn(MB, SEQ, H, dtype=torch.bfloat16),))
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for outputs, _ in st.fwd_cache.values() for t in outputs}
    priced = stage_output_bytes(wl, cfg, load_target("autopar").constants, np.array([inflight, 1.0]))
    assert priced.tolist() == [sum(kept.values()), 0.0]
    assert not stage_output_bytes(wl, cfg, load_target("megatron").constants, np.array([inflight, 1.0])).any()

"""The shared-memory paths of tensor parallelism without Ray, in real processes: ShmQueue carries messages in
order to every reader, larger ones across several slots and around the ring (workers/shm_broadcast.py); the
CPU ranks' ShmCommunicator all-reduce equals gloo's all-reduce bit for bit (fp32, bf16, a non-contiguous input,
a tensor over the slot falling back to gloo) and its all-gather gloo's all-gather (workers/shm_collectives.py)."""
from __future__ import annotations

import json

import torch.multiprocessing as mp

from workers.ray_utils import free_port
from workers.shm_broadcast import ShmQueue

MESSAGES = [("step", list(range(n))) for n in (0, 1, 10, 5000, 3, 20000, 7)]   # 5000 / 20000 ints: many slots


def _reader(rank: int, steps, answers) -> None:
    steps, answer = ShmQueue.open(steps, rank), ShmQueue.open(answers[rank], None)
    while (message := steps.get(timeout_s=60)) is not None:
        answer.put((rank, message[0], sum(message[1])), timeout_s=60)
    steps.close()
    answer.close()


def test_queue_delivers_every_message_to_every_reader_across_slots():
    steps = ShmQueue.create(readers=2, slots=4, slot_bytes=1024)
    answers = [ShmQueue.create(readers=1, slots=2, slot_bytes=256) for _ in range(2)]
    context = mp.get_context("spawn")
    procs = [context.Process(target=_reader, args=(r, steps.handle, [a.handle for a in answers])) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = []
        for message in MESSAGES:
            steps.put(message, timeout_s=60)
            got.append([a.get(timeout_s=60) for a in answers])
        steps.put(None, timeout_s=60)
        assert got == [[(r, m[0], sum(m[1])) for r in range(2)] for m in MESSAGES]
    finally:
        for p in procs:
            p.join(60)
        for queue in [steps, *answers]:
            queue.close()
    assert [p.exitcode for p in procs] == [0, 0]


def _rank(rank: int, port: int, segment: str, slot_bytes: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from workers.parallel import TPGroup
    from workers.shm_collectives import ShmCommunicator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shm = ShmCommunicator(segment, rank, 2, slot_bytes)
    tp = TPGroup(rank, 2, dist.group.WORLD, shm=shm)
    generator = torch.Generator().manual_seed(rank)   # each rank its own values: a real reduction
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 8, 32, 64):   # 64 rows of fp32: over the slot, gloo's path
            x = torch.randn(rows, 256, generator=generator).to(dtype)
            if rows == 8:
                x = x.t()   # non-contiguous
            reference = x.contiguous().clone()   # x itself when contiguous: all_reduce writes in place
            dist.all_reduce(reference)
            gathered = [torch.empty_like(x) for _ in range(2)]
            dist.all_gather(gathered, x.contiguous())
            for _ in range(3):   # both buffers, then the first again
                got = tp.all_reduce(x.clone())
                cat = tp.all_gather_last(x)
            results[f"{dtype}-{rows}"] = {
                "equal": torch.equal(got, reference), "same_form": (got.shape, got.dtype) == (x.shape, x.dtype),
                "gather_equal": torch.equal(cat, torch.cat(gathered, dim=-1)), "shm": shm.fits(x),
                "checksum": got.double().sum().item()}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def test_shm_all_reduce_and_gather_equal_gloos_on_both_ranks(tmp_path):
    from workers.shm_collectives import create_segment

    slot_bytes = 32 * 256 * 4
    segment = create_segment(2, slot_bytes)
    try:
        mp.spawn(_rank, args=(free_port(), segment.name, slot_bytes, str(tmp_path)), nprocs=2)
    finally:
        segment.close()
        segment.unlink()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) == 8
    for case in ranks[0]:
        for r in ranks:
            assert r[case]["equal"] and r[case]["same_form"] and r[case]["gather_equal"], (case, r[case])
        assert ranks[0][case]["checksum"] == ranks[1][case]["checksum"], case
    assert {r["shm"] for r in ranks[0].values()} == {True, False}   # both paths were taken

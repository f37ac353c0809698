"""TPGroup.all_reduce on gloo (CPU ranks) in two real processes: a small tensor goes as one all-gather and a
local sum, which equals gloo's all-reduce bit for bit (fp32, bf16, a non-contiguous input) and gives both ranks
the same result; a tensor over GATHER_MAX_BYTES goes through gloo's all-reduce."""
from __future__ import annotations

import json

import torch.multiprocessing as mp

from workers.ray_utils import free_port


def _rank(rank: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from workers.parallel import GATHER_MAX_BYTES, TPGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    gathers = []
    real_gather = dist.all_gather_into_tensor

    def counted_gather(*args, **kwargs):
        gathers.append(1)
        return real_gather(*args, **kwargs)

    dist.all_gather_into_tensor = counted_gather   # this child process only: which path each call took
    tp = TPGroup(rank, 2, dist.group.WORLD, gather_small=True)
    generator = torch.Generator().manual_seed(rank)   # each rank its own values: a real reduction
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        row_bytes = 1024 * torch.empty(0, dtype=dtype).element_size()
        for rows in (1, 8, GATHER_MAX_BYTES // row_bytes, GATHER_MAX_BYTES // row_bytes + 1):
            x = torch.randn(rows, 1024, generator=generator).to(dtype)
            if rows == 8:
                x = x.t()   # non-contiguous
            before = len(gathers)
            got = tp.all_reduce(x.clone())
            reference = x.contiguous()
            dist.all_reduce(reference)
            results[f"{dtype}-{rows}"] = {
                "equal": torch.equal(got, reference), "same_form": (got.shape, got.dtype) == (x.shape, x.dtype),
                "gathered": len(gathers) > before, "small": x.numel() * x.element_size() <= GATHER_MAX_BYTES,
                "checksum": got.double().sum().item()}
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def test_small_all_reduces_gather_and_equal_gloos_all_reduce_on_both_ranks(tmp_path):
    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0].keys() == ranks[1].keys() and len(ranks[0]) == 8
    for case, result in ranks[0].items():
        for r in ranks:
            assert r[case]["equal"] and r[case]["same_form"], (case, r[case])
            assert r[case]["gathered"] == r[case]["small"], (case, r[case])
        assert ranks[0][case]["checksum"] == ranks[1][case]["checksum"], case
    assert {r["small"] for r in ranks[0].values()} == {True, False}   # both paths were taken

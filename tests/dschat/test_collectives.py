"""dschat's collectives on a world group with no CPU backend, as NCCL has none (``dschat/engine.py``).

A ``cuda:gloo`` group is such a group on a CPU machine: a CPU tensor's ``all_reduce`` over it raises ``No backend
type associated with device type cpu``, and an object collective asks for CUDA, exactly as on NCCL. Two ranks
initialise one and run every collective helper of the engine with the CPU tensors and objects the library passes
them; a lint finds any ``torch.distributed`` or DeepSpeed use outside the engine. The stages' own two-rank tests
run under ``tests/cuda_only_world`` (``CUDA_ONLY_WORLD``), which makes the launched world group CUDA-only for
dschat's collectives.
"""

from __future__ import annotations

import ast
import multiprocessing as mp
import os
import socket
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, backend: str, queue) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from dschat import engine as E

        E.setup_distributed()
        out: dict = {"world_serves_cpu": E.serves_cpu(), "cpu_group": E._CPU_GROUP is not None}
        out["sum"] = E.all_reduce_sum(torch.tensor([rank + 1.0, 10.0])).tolist()
        out["mean"] = E.all_reduce_mean(torch.tensor(float(rank))).item()
        out["max"] = int(E.all_reduce_max(torch.tensor(rank * 7)).item())
        out["count"] = E.all_reduce_sum(torch.tensor(3, dtype=torch.float64)).item()
        out["broadcast"] = E.broadcast_object({"from": rank} if rank == 0 else None)
        out["gathered"] = E.gather_objects(("rank", rank))
        E.barrier()
        with E.main_process_first():
            out["first"] = True
        model = torch.nn.Linear(3, 2)
        with torch.no_grad():
            model.weight.copy_(torch.arange(6.0).view(2, 3))
            model.bias.fill_(1.0)
        layout = E.own_shards(model)
        whole = E.gather_shards({k: s.live * 2 for k, s in layout.items()}, layout)
        out["shards"] = {k: v.tolist() for k, v in whole.items()}
        queue.put((rank, out))
    except Exception as e:  # noqa: BLE001 - the parent reports it
        queue.put((rank, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
    finally:
        from dschat import engine as E

        E.teardown_distributed()


def _two_ranks(backend: str) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, backend, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    failed = {r: v for r, v in got.items() if isinstance(v, str)}
    assert not failed, failed
    return got


@pytest.mark.parametrize("backend", ["cuda:gloo", "cpu:gloo,cuda:gloo"])
def test_every_collective_helper_runs_on_a_world_group_without_a_cpu_backend(backend):
    """``cuda:gloo`` stands for NCCL alone: the engine adds a gloo group for CPU tensors and objects. A world with
    both (``cpu:gloo,cuda:...``, what dschat makes on CUDA) needs none."""
    got = _two_ranks(backend)
    for rank in (0, 1):
        r = got[rank]
        assert r["world_serves_cpu"] == (backend != "cuda:gloo")
        assert r["cpu_group"] == (backend == "cuda:gloo")
        assert r["sum"] == [3.0, 20.0] and r["mean"] == 0.5 and r["max"] == 7 and r["count"] == 6.0
        assert r["broadcast"] == {"from": 0} and r["gathered"] == [["rank", 0], ["rank", 1]] or \
            r["gathered"] == [("rank", 0), ("rank", 1)]
        assert r["first"]
    assert got[0]["shards"] == {"weight": [[0.0, 2.0, 4.0], [6.0, 8.0, 10.0]], "bias": [2.0, 2.0]}
    assert got[1]["shards"] == {}  # whole tensors on rank 0 only


def test_on_cuda_the_world_group_has_gloo_for_cpu_tensors_beside_nccl():
    from dschat import engine as E

    assert E.process_group_backend(cuda=True) == "cpu:gloo,cuda:nccl"
    assert E.process_group_backend(cuda=False) == "gloo"


@pytest.mark.parametrize("config,serves", [("nccl", False), ("cuda:nccl", False), ("cuda:gloo", False),
                                           ("gloo", True), ("cpu:gloo,cuda:nccl", True),
                                           ("cpu:gloo,cuda:gloo", True), ("mpi", True)])
def test_which_backends_serve_cpu_tensors(config, serves):
    from dschat import engine as E

    assert E.backend_serves_cpu(config) is serves


# ------------------------------------------------------------------------------------------------------ lint
FORBIDDEN = ("torch.distributed", "deepspeed")


def distributed_uses(path: Path, source: str | None = None) -> list[str]:
    """``file:line`` of each import of ``torch.distributed`` or DeepSpeed, and each ``torch.distributed``
    attribute, in one file."""
    tree = ast.parse(source if source is not None else path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [f"{node.module}.{a.name}" for a in node.names] if node.module else []
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = [f"{node.value.id}.{node.attr}"]
        if any(n == f or n.startswith(f + ".") for n in names for f in FORBIDDEN):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_only_the_engine_touches_torch_distributed_or_deepspeed():
    """Every collective the library makes goes through ``dschat/engine.py``, so one place decides the group and
    device of each; no other module of the library or a stage main imports ``torch.distributed`` or DeepSpeed."""
    files = [p for p in sorted((ROOT / "dschat").rglob("*.py")) if p != ROOT / "dschat" / "engine.py"]
    files += sorted(ROOT.glob("step*_*/*.py"))
    bad = [u for p in files for u in distributed_uses(p)]
    assert len(files) > 50 and not bad, bad
    # the lint sees each spelling
    for planted in ("import torch.distributed as dist", "from torch import distributed",
                    "from torch.distributed import all_reduce", "import deepspeed.comm",
                    "import torch\ntorch.distributed.barrier()"):
        assert distributed_uses(Path("x.py"), planted), planted

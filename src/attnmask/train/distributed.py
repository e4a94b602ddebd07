"""Data-parallel plumbing for ``torchrun``: who am I, and the few collectives training needs.

``torchrun --nproc-per-node N -m attnmask train ...`` sets ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``; :func:`setup` reads them and starts the
process group (gloo on CPU, nccl on CUDA). Without them everything degrades to one process and
every collective here is the identity, so the training loop has a single code path. Sharded
training (``--fsdp``, :mod:`attnmask.train.fsdp`) needs the group even for one process, and refuses
to start without torchrun.
"""

from __future__ import annotations

import gc
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from attnmask.errors import UserError


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    started_group: bool = False  # True when setup() created the process group (so teardown ends it)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device: str = "auto", *, fsdp: bool = False) -> Dist:
    """Join the process group if launched by torchrun; pick this rank's device.

    ``fsdp``: start the group for a single process too (FSDP shards over it), and refuse to run
    outside torchrun (or a group the caller started).

    ``device``: ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
    Under torchrun with CUDA, each rank takes ``cuda:LOCAL_RANK``; with more local ranks than GPUs,
    ``auto`` runs every rank on the CPU (one notice) and ``cuda`` is an error naming the numbers.

    Raises:
        ValueError: ``device`` asks for CUDA but none is available (or fewer GPUs than local
            ranks), or is not a device name; ``fsdp`` without torchrun.
    """
    try:
        want = torch.device(
            "cuda" if device == "auto" and torch.cuda.is_available() else ("cpu" if device == "auto" else device)
        )
    except RuntimeError as err:
        raise UserError(f"--device {device!r} is not a device name; expected auto, cpu, cuda or cuda:N") from err
    if want.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device!r} asks for CUDA, but torch.cuda.is_available() is False")
    if fsdp:
        require_launcher()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if fsdp and dist.is_initialized():
        world_size = dist.get_world_size()
    if world_size <= 1 and not fsdp:
        return Dist(device=want)
    rank = dist.get_rank() if fsdp and dist.is_initialized() else int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if want.type == "cuda":
        want = _rank_device(device, rank, local_rank)
    if want.type == "cuda":
        torch.cuda.set_device(want)
    started = False
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if want.type == "cuda" else "gloo")
        started = True
    return Dist(rank=rank, world_size=world_size, local_rank=local_rank, device=want, started_group=started)


def require_launcher() -> None:
    """``--fsdp`` needs a process group: torchrun's environment, or one the caller started.

    Raises:
        ValueError: neither (a plain ``python -m attnmask train --fsdp``).
    """
    if dist.is_available() and dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise UserError(
            f"--fsdp shards the model over torchrun's processes, but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set; launch with "
            "torchrun --nproc-per-node N -m attnmask train ... --fsdp"
        )


def _rank_device(device: str, rank: int, local_rank: int) -> torch.device:
    """``cuda:LOCAL_RANK``, when this machine has a GPU for every local rank.

    With more local ranks (torchrun's ``LOCAL_WORLD_SIZE``) than GPUs, ``--device auto`` puts every
    rank on the CPU (gloo), with a one-line notice from rank 0 -- all ranks decide alike, since they
    read the same numbers -- and an explicit ``--device cuda`` stops with a one-line error.
    """
    gpus = torch.cuda.device_count()
    local_ranks = max(int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)), local_rank + 1)
    if local_ranks <= gpus:
        return torch.device("cuda", local_rank)
    numbers = f"{local_ranks} local ranks (torchrun --nproc-per-node) but {gpus} GPU{'s' if gpus != 1 else ''}"
    if device != "auto":
        raise UserError(
            f"--device {device}: {numbers}; start at most {gpus} processes per node, or use --device auto (CPU) or cpu"
        )
    if rank == 0:
        print(f"distributed: {numbers}: every rank runs on the CPU (gloo)", file=sys.stderr, flush=True)
    return torch.device("cpu")


def teardown(ctx: Dist, *, finished: bool = False) -> None:
    """End the process group :func:`setup` started (a group the caller started is the caller's to end).

    ``finished``: this rank got here by the normal path, so it first waits for every other rank to get
    here too, and no rank ends its group (or exits) while a peer may still be in a collective with it.
    After an error there is no such wait: a peer may be in a collective this rank will never join, and
    would wait for it until the group's timeout; ending the group ends that collective with an error.
    """
    if not (ctx.started_group and dist.is_initialized()):
        return
    try:
        if finished and ctx.enabled:
            dist.barrier()
    finally:
        dist.destroy_process_group()
        _release_groups()


def _release_groups() -> None:
    """Free the destroyed groups now, which joins their worker threads, rather than at interpreter exit.

    ``destroy_process_group`` forgets a group, but the modules FSDP sharded hold it until the garbage
    collector frees them, and a ``DeviceMesh`` (kept alive by DTensor's caches) for good: gloo's worker
    threads would outlive the interpreter's shutdown. One of them dropping a finished collective's last
    reference then (a barrier keeps the collectives issued before it, and their tensors) needs the GIL,
    which a finalizing interpreter answers with ``pthread_exit``: the process aborts with "terminate
    called without an active exception".
    """
    from torch.distributed.device_mesh import DeviceMesh

    gc.collect()  # the modules and optimizer of a run that has returned
    for obj in gc.get_objects():
        if DeviceMesh in type(obj).__mro__:  # not isinstance: its metaclass hook reads every object
            getattr(obj, "_pg_registry", {}).clear()  # its groups by name (PyTorch 2.13); destroyed already
    gc.collect()


def all_reduce_sum(ctx: Dist, values: list[float]) -> list[float]:
    """Element-wise sum of ``values`` over ranks (float64, so token counts stay exact)."""
    if not ctx.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)  # (n,)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_gather_objects(ctx: Dist, obj) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` on every rank (picklable objects)."""
    if not ctx.enabled:
        return [obj]
    out = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def barrier(ctx: Dist) -> None:
    if ctx.enabled:
        dist.barrier()

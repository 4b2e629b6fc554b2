"""Several processes (GPUs, nodes) through ``torch.distributed``.

``torchrun --nproc-per-node K prism-select score ...`` (or ``accelerate launch``) sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``;
:func:`init_from_env` joins that process group (``env://``, NCCL on CUDA, gloo on
CPU) and pins the process to its local GPU. Then:

* the curvature fit runs each rank's share of the fit batches and sums the factor
  statistics across ranks (all-reduce) before the eigendecompositions;
* scoring gives chunk ``k`` of the length-sorted pool to rank ``k % world``, and the
  scores are gathered in pool order on every rank; rank 0 writes the outputs.

Multi-node is the same command on each node with torchrun's rendezvous flags
(``--nnodes N --node-rank i --master-addr HOST --master-port PORT``, or
``--rdzv-backend c10d --rdzv-endpoint HOST:PORT``); ``--out`` must then be on a
filesystem every node sees (resumable chunks are written there by their rank).

With one process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) every helper is a no-op.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def world() -> int:
    return dist.get_world_size() if active() else 1


def is_main() -> bool:
    return rank() == 0


def init_from_env(device: str = "auto") -> bool:
    """Join the process group described by torchrun's environment variables.

    Returns True when running with more than one process. Safe to call twice.
    """
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but torch.distributed is not available in this build")
    if dist.is_initialized():
        return dist.get_world_size() > 1
    use_cuda = torch.cuda.is_available() and device not in ("cpu",)
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
    backend = "nccl" if use_cuda else "gloo"
    kw = {}
    if use_cuda:
        kw["device_id"] = torch.device("cuda", torch.cuda.current_device())
    try:
        dist.init_process_group(backend=backend, init_method="env://",
                                timeout=datetime.timedelta(minutes=60), **kw)
    except TypeError:  # older torch: no device_id
        dist.init_process_group(backend=backend, init_method="env://",
                                timeout=datetime.timedelta(minutes=60))
    return dist.get_world_size() > 1


def local_device(device: str = "auto") -> str:
    """The device string a rank should load its model on."""
    if active() and torch.cuda.is_available() and device in ("auto", "cuda"):
        return f"cuda:{torch.cuda.current_device()}"
    return device


def shard(items: list) -> list:
    """This rank's share: items ``r, r + K, r + 2K, ...``."""
    return items[rank()::world()] if active() else items


def owner(k: int) -> int:
    return k % world()


def barrier():
    if active():
        dist.barrier()


def _comm_device(t: torch.Tensor) -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensors: list):
    """Sum each tensor across ranks, in place (flattened into one buffer per dtype)."""
    if not active() or not tensors:
        return
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype, ts in by_dtype.items():
        dev = _comm_device(ts[0])
        # bounded buffers: ~256 MiB at a time
        limit = (1 << 28) // max(ts[0].element_size(), 1)
        group, size = [], 0
        for t in ts + [None]:
            if t is not None and (size + t.numel() <= limit or not group):
                group.append(t)
                size += t.numel()
                continue
            flat = torch.cat([g.reshape(-1).to(dev) for g in group])
            dist.all_reduce(flat)
            off = 0
            for g in group:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()
            if t is not None:
                group, size = [t], t.numel()


def broadcast(tensors: list, src: int = 0):
    """Overwrite each tensor with rank ``src``'s copy."""
    if not active():
        return
    for t in tensors:
        dev = _comm_device(t)
        buf = t.to(dev).contiguous()
        dist.broadcast(buf, src)
        t.copy_(buf)


def all_or_nothing(flag: bool) -> bool:
    """True only if ``flag`` is true on every rank."""
    if not active():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_comm_device(torch.empty(0)))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() > 0.5)


def gather_scores(n: int, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Every rank contributes ``values`` at pool positions ``index``; returns the full
    (n,) float64 tensor in pool order on every rank."""
    out = torch.full((n,), float("nan"), dtype=torch.float64)
    if not active():
        out[index] = values.double()
        return out
    dev = _comm_device(values)
    full = torch.zeros(n, dtype=torch.float64, device=dev)
    cnt = torch.zeros(n, dtype=torch.float64, device=dev)
    full[index.to(dev)] = values.double().to(dev)
    cnt[index.to(dev)] = 1
    dist.all_reduce(full)
    dist.all_reduce(cnt)
    full = full.cpu()
    cnt = cnt.cpu()
    out[cnt > 0] = full[cnt > 0]
    return out


def destroy():
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

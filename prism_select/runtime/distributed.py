"""Several processes (GPUs, nodes) through ``torch.distributed``.

``torchrun --nproc-per-node K prism-select score ...`` (or ``accelerate launch``) sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``;
:func:`init_from_env` joins that process group (``env://``, NCCL on CUDA, gloo on
CPU) and pins the process to its local GPU. Then:

* work is cut into contiguous, cost-balanced shares of a length-sorted order
  (:func:`contiguous_owners`): each rank sees about ``1/world`` of the distinct
  sequence lengths, so per-shape setup (CUDA graph captures) divides too;
* the curvature fit runs each rank's share of the fit batches and sums the factor
  statistics across ranks (all-reduce); the eigendecompositions are spread over the
  ranks by cost (:func:`balance`) and each result is broadcast by the rank that made it;
* scoring gives each rank a contiguous share of the length-sorted pool (in chunks), and
  the scores are gathered in pool order on every rank; rank 0 writes the outputs.

Multi-node is the same command on each node with torchrun's rendezvous flags
(``--nnodes N --node-rank i --master-addr HOST --master-port PORT``, or
``--rdzv-backend c10d --rdzv-endpoint HOST:PORT``); ``--out`` must then be on a
filesystem every node sees (resumable chunks are written there by their rank), and so
should ``--cache-dir`` (each rank saves a share of the curvature there).

With one process (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) every helper is a no-op.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys

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


def say(text: str, on: bool = True) -> None:
    """One console line (stderr) from the main rank, where ``on`` (a run's ``progress``): a
    stage that ended, with its time, or what a resumed run reuses."""
    if on and is_main():
        print(text, file=sys.stderr, flush=True)


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
    # the group is torn down before the interpreter's own teardown: left to the C++ static
    # destructors, gloo's threads could abort the process after a finished run
    # ("terminate called without an active exception", exit status 134)
    atexit.register(destroy)
    return dist.get_world_size() > 1


def local_device(device: str = "auto") -> str:
    """The device string a rank should load its model on."""
    if active() and torch.cuda.is_available() and device in ("auto", "cuda"):
        return f"cuda:{torch.cuda.current_device()}"
    return device


def contiguous_owners(costs: list, parts: int | None = None) -> list:
    """The part (rank) of each item when a sequence is cut into ``parts`` (default: the
    world size) contiguous runs of near-equal total cost.

    An item goes to the part its cost midpoint falls in, so the runs differ by at most
    about one item's cost; the result is non-decreasing and deterministic. With zero
    total cost the items are split by count.
    """
    parts = world() if parts is None else parts
    n = len(costs)
    if parts <= 1 or n == 0:
        return [0] * n
    total = float(sum(costs))
    if total <= 0:
        return [min(parts - 1, i * parts // n) for i in range(n)]
    out, before = [], 0.0
    for c in costs:
        out.append(min(parts - 1, int((before + 0.5 * float(c)) * parts / total)))
        before += float(c)
    return out


def shard(items: list, costs: list | None = None) -> list:
    """This rank's contiguous share of ``items`` (balanced by ``costs``, default equal)."""
    if not active():
        return items
    owners = contiguous_owners([1.0] * len(items) if costs is None else costs)
    return [x for x, o in zip(items, owners) if o == rank()]


def round_robin(items: list) -> list:
    """This rank's items of a length-sorted list dealt in turn: ``items[rank::world]``.
    Under FSDP's lockstep (:func:`lockstep`) every step then runs batches of about the
    same length on all ranks, and the step counts differ by at most one; contiguous
    shares (:func:`shard`) would give one rank the short batches and another the long
    ones, which the short ones would wait for at every step's collectives."""
    if not active():
        return items
    return items[rank()::world()]


def balance(costs: list, parts: int | None = None) -> list:
    """Assign independent tasks to ``parts`` ranks, largest first to the least loaded
    (longest-processing-time rule); returns each task's rank. Deterministic."""
    parts = world() if parts is None else parts
    load = [0.0] * max(parts, 1)
    out = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-float(costs[i]), i)):
        r = min(range(len(load)), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += float(costs[i])
    return out


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


def broadcast_from(t: torch.Tensor | None, src: int, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """Rank ``src``'s ``t`` on every rank, on ``device`` (the other ranks pass None, or
    anything: their ``t`` is not read); ``shape`` and ``dtype`` are ``t``'s."""
    if not active():
        return t
    comm = _comm_device(torch.empty(0))
    if rank() == src:
        buf = t.to(device=comm, dtype=dtype).contiguous()
    else:
        buf = torch.empty(shape, dtype=dtype, device=comm)
    dist.broadcast(buf, src)
    return buf.to(device)


def share_from_owners(tensors: list, owners: list):
    """Every rank ends with rank ``owners[i]``'s value of ``tensors[i]`` (same shapes
    and dtypes on every rank): one broadcast per (owner, dtype), of that owner's tensors
    packed into one buffer."""
    if not active() or not tensors:
        return
    groups: dict = {}
    for t, o in zip(tensors, owners):
        groups.setdefault((o, t.dtype), []).append(t)
    for (o, _), ts in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        dev = _comm_device(ts[0])
        if rank() == o:
            flat = torch.cat([t.reshape(-1).to(dev) for t in ts])
        else:
            flat = torch.empty(sum(t.numel() for t in ts), dtype=ts[0].dtype, device=dev)
        dist.broadcast(flat, o)
        if rank() != o:
            off = 0
            for t in ts:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()


def reduce_sum_to(t: torch.Tensor, dst: int) -> torch.Tensor | None:
    """The sum of every rank's ``t`` (same shape and dtype everywhere) on rank ``dst``,
    returned there; the other ranks get None (their ``t`` is used as the send buffer)."""
    return reduce_sum_to_async(t, dst)()


def reduce_sum_to_async(t: torch.Tensor, dst: int):
    """:func:`reduce_sum_to` started in the background: returns a function that waits for
    it and gives the sum on rank ``dst`` (None elsewhere). Until then ``t`` must not
    change, and the work queued on the device meanwhile overlaps the collective (NCCL
    runs it on its own stream; the wait makes the current stream wait for it)."""
    if not active():
        return lambda: t
    comm = _comm_device(t)
    buf = t.contiguous() if t.device == comm else t.to(comm)
    work = dist.reduce(buf, dst=dst, op=dist.ReduceOp.SUM, async_op=True)

    def finish():
        work.wait()
        return buf.to(t.device) if rank() == dst else None
    return finish


def merge_dicts(d: dict) -> dict:
    """The union of every rank's ``d`` (small, picklable values; on a key present on
    several ranks the lowest rank's value wins)."""
    if not active():
        return dict(d)
    parts: list = [None] * world()
    dist.all_gather_object(parts, d)
    out: dict = {}
    for p in reversed(parts):
        out.update(p)
    return out


def all_or_nothing(flag: bool) -> bool:
    """True only if ``flag`` is true on every rank."""
    if not active():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=_comm_device(torch.empty(0)))
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() > 0.5)


def gather_scores(n: int, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Every rank contributes ``values`` at pool positions ``index``; returns the full
    ``(n,)`` float64 tensor in pool order on every rank (``(n, K)`` for ``(m, K)`` values:
    one column per stacked direction)."""
    out = torch.full((n, *values.shape[1:]), float("nan"), dtype=torch.float64)
    if not active():
        out[index] = values.double()
        return out
    dev = _comm_device(values)
    full = torch.zeros((n, *values.shape[1:]), dtype=torch.float64, device=dev)
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


def lockstep(items: list, filler=None, together: bool = True):
    """Yield ``(item, real)`` for this rank's ``items``, then, under ``together`` with
    several ranks, ``(stand_in, False)`` until every rank has had as many steps as the
    busiest: FSDP's collectives run inside each forward and backward, so every rank must
    run the same number of them. The stand-in is this rank's last item (or ``filler``
    when it has none); what a stand-in step computes is discarded by the caller."""
    steps = len(items)
    if together and active():
        t = torch.tensor([steps], dtype=torch.int64, device=_comm_device(torch.empty(0)))
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        steps = int(t.item())
    for i in range(steps):
        if i < len(items):
            yield items[i], True
        else:
            yield (items[-1] if items else filler), False


def gather_values(x) -> list:
    """Every rank's ``x`` (a small picklable value), in rank order, on every rank."""
    if not active():
        return [x]
    out = [None] * world()
    dist.all_gather_object(out, x)
    return out

"""The model, the target direction and ``v`` sharded over the ranks with FSDP2
(``--shard fsdp`` under torchrun or ``accelerate launch``).

Why
    A model whose weights, target direction and ``v`` do not fit one GPU (or leave too
    little room for activations and curvature) is split across the ranks of one job.
    Sharding is PyTorch's own (``torch.distributed.fsdp.fully_shard``); nothing here
    moves a weight by hand.

How
    * :func:`shard_model`: every decoder block and then the root module become FSDP2
      units over a one-dimensional device mesh of all ranks. Each rank keeps rows
      ``row_range(out, rank, world)`` of every parameter (``torch.chunk`` on dim 0);
      a block's full weights exist only while it computes, all-gathered by FSDP.
      Before sharding, each tracked layer gets two frozen parameters of its own shape,
      ``prism_v`` (``out x in``) and, with a bias, ``prism_vb`` (``out``): ``v`` lives
      there, sharded and all-gathered with the weights of its block, so the exact
      scorer (:class:`prism_select.engine.ExactScorer`) reads the full ``V`` of a layer
      exactly when it reads the full weight.
    * The target direction: the batches of target pairs are dealt to the ranks in turn
      (:func:`prism_select.preference.compute_preference` with ``share``), each rank's
      losses scaled by the number of ranks; FSDP reduce-scatters the gradients, whose
      average over the ranks is then the one-GPU gradient, and each rank takes its rows
      (:func:`local`).
    * Preconditioning (:func:`precondition_rows`): layer by layer, the rows are
      all-gathered into the full gradient, ``H^-1`` is applied by the rank that holds
      that layer's curvature (:func:`curvature_owners`), the result is broadcast and each
      rank keeps its rows of ``v``.
    * Every loop that runs the model runs the same number of steps on every rank
      (:func:`prism_select.runtime.distributed.lockstep`): a rank with less work repeats a batch
      and discards what it computed. The length-sorted batches are dealt to the ranks in
      turn (:func:`prism_select.runtime.distributed.round_robin`,
      :func:`prism_select.scoring.plan_chunks` with ``interleave``), so the batches of
      one step are about as long on every rank and no rank waits long at the step's
      collectives.

Correctness
    The same arithmetic as one GPU on the same examples: the tests run two CPU
    processes (gloo) on a float64 model and compare with the one-process scores
    (``tests/test_sharding.py``).

Limits
    No CUDA graphs (FSDP's collectives run inside the step), the direction methods only
    (prism, equal, unpaired).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..errors import ConfigError
from ..settings import FSDP_SUMS, KEEP_GATHERED, SHARDS, check_shard  # noqa: F401 (re-exported)
from . import distributed
from .layers import has_bias, layer_shape, local

log = logging.getLogger(__name__)

def is_sharded(module: torch.nn.Module) -> bool:
    """Whether ``module``'s weight (or, for a whole model, its first parameter) is an FSDP2
    shard (a DTensor)."""
    w = getattr(module, "weight", None)
    if w is None:
        w = next(module.parameters(), None)
    return isinstance(w, DTensor)


def row_range(rows: int, rank: int, world: int) -> tuple[int, int]:
    """The rows ``[start, stop)`` that rank ``rank`` of ``world`` keeps of a parameter with
    ``rows`` rows: FSDP2 cuts dim 0 as ``torch.chunk`` does (``ceil(rows / world)`` per
    rank, the last ranks possibly fewer or none)."""
    per = -(-rows // world)
    start = min(rank * per, rows)
    return start, min(start + per, rows)


def decoder_blocks(model: torch.nn.Module) -> list:
    """The repeated blocks of a causal LM: the longest ``nn.ModuleList`` of same-type
    modules (``model.model.layers`` for Llama/Qwen, also inside a PEFT wrapper)."""
    best: list = []
    for _, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) > len(best):
            kinds = {type(c) for c in m}
            if len(kinds) == 1:
                best = list(m)
    return best


def shard_model(model: torch.nn.Module, modules: dict, device) -> torch.nn.Module:
    """Attach the ``v`` parameters to the tracked layers and shard ``model`` with FSDP2 (in
    place): one unit per decoder block, then the root. ``model`` may sit on the host; its
    shards move to ``device``. Needs an initialised process group
    (:func:`prism_select.runtime.distributed.init_from_env`)."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
    except ImportError as e:  # pragma: no cover - torch < 2.6
        raise ConfigError("shard", f"this PyTorch has no FSDP2 ({e})", "use PyTorch >= 2.6, or leave --shard out")
    if not distributed.active():
        raise ConfigError("shard", "--shard fsdp needs several processes",
                          "launch with torchrun --nproc-per-node K (K >= 2), or leave --shard out")
    dev = torch.device(device)
    for m in modules.values():
        w = m.weight
        # torch.empty: pages of a large host tensor are only touched by the rows copied out
        m.register_parameter("prism_v", torch.nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device=w.device),
                                                            requires_grad=False))
        if has_bias(m):
            m.register_parameter("prism_vb", torch.nn.Parameter(torch.empty(m.bias.shape, dtype=w.dtype,
                                                                            device=w.device), requires_grad=False))
    mesh = init_device_mesh(dev.type, (distributed.world(),))
    blocks = decoder_blocks(model)
    if not blocks:
        raise ConfigError("shard", f"{type(model).__name__} has no list of decoder blocks to shard",
                          "leave --shard out (one GPU, or data-parallel ranks)")
    for block in blocks:
        fully_shard(block, mesh=mesh)
    # explicit prefetching: the next block's all-gather (its weights and V) is issued as
    # this block starts, in either direction, so the transfer overlaps this block's compute
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks) and hasattr(block, "set_modules_to_forward_prefetch"):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0 and hasattr(block, "set_modules_to_backward_prefetch"):
            block.set_modules_to_backward_prefetch([blocks[i - 1]])
    # the root unit (embeddings, head) computes first and its backward comes last: gathering
    # it once per step instead of twice costs only its own size
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    for m in model.modules():  # fully_shard moves what it manages; any other buffer follows
        for k, b in m._buffers.items():
            if b is not None and b.device != dev:
                m._buffers[k] = b.to(dev)
    log.info("sharded the model over %d ranks with FSDP2 (%d blocks)", distributed.world(), len(blocks))
    return model


@contextmanager
def weights_gathered(model: torch.nn.Module, on: bool):
    """Inside the ``with``, each decoder block of a sharded ``model`` keeps the weights (and
    ``V``) it gathers for its forward until its backward has run, which then needs no
    second all-gather (FSDP2's ``set_reshard_after_forward``): one transfer of the model per
    step instead of two, for a whole unsharded model on every rank at the end of each
    forward. The blocks are resharded when it ends. ``on`` False (or a PyTorch without the
    setter): nothing changes."""
    blocks = [b for b in decoder_blocks(model) if hasattr(b, "set_reshard_after_forward")] \
        if on and is_sharded(model) else []
    for b in blocks:
        b.set_reshard_after_forward(False)
    try:
        yield
    finally:
        for b in blocks:
            b.set_reshard_after_forward(True)
            b.reshard()


def set_v(modules: dict, v_rows: dict) -> None:
    """Copy this rank's rows of ``v`` (``out_rows x (in [+1])`` per layer) into the tracked
    layers' ``prism_v`` / ``prism_vb`` shards."""
    with torch.no_grad():
        for n, m in modules.items():
            rows = v_rows[n]
            pv = local(m.prism_v)
            pv.copy_(rows[:, :m.in_features].to(pv.dtype))
            if has_bias(m):
                pb = local(m.prism_vb)
                pb.copy_(rows[:, -1].to(pb.dtype))


def gather_rows(rows: torch.Tensor, total: int) -> torch.Tensor:
    """The full ``total x cols`` matrix from every rank's rows (``row_range``), on every rank."""
    world = distributed.world()
    per = -(-total // world)
    dev = distributed._comm_device(rows)
    buf = torch.zeros(per, *rows.shape[1:], dtype=rows.dtype, device=dev)
    buf[:rows.shape[0]] = rows.to(dev)
    out = torch.empty(per * world, *rows.shape[1:], dtype=rows.dtype, device=dev)
    dist.all_gather_into_tensor(out, buf)
    return out[:total]


def curvature_owners(layers: list, sizes: dict) -> dict:
    """The rank that keeps each layer's curvature: balanced by the cost of its
    preconditioning (``~out^3 + in^3``), so the kept factors divide over the ranks."""
    where = distributed.balance([sizes[n] for n in layers])
    return dict(zip(layers, where))


def factor_owners(layers: list, modules: dict) -> dict:
    """The rank that accumulates, decomposes and keeps each layer's curvature factors in a
    sharded fit (:mod:`prism_select.curvature.fit`): ``layers`` (one fit group, in model
    order) cut into contiguous runs of near-equal factor size (``in^2 + out^2``), so
    each rank holds about ``1/K`` of the group's factors and layers reading one input
    (q/k/v, gate/up) mostly share an owner, which then receives that input once."""
    costs = [i * i + o * o for o, i in (layer_shape(modules[n]) for n in layers)]
    return dict(zip(layers, distributed.contiguous_owners(costs)))


def keep_owned(curvature, owners: dict):
    """Drop the tensors of the layers this rank does not own (in place); returns it."""
    me = distributed.rank()
    for name in list(curvature.tensors):
        if owners.get(name.split("::")[0], me) != me:
            del curvature.tensors[name]
    return curvature


def precondition_rows(curvature, direction_rows: dict, modules: dict, owners: dict, device) -> dict:
    """This rank's rows of ``v = H^-1 g`` for the layers of ``curvature``: per layer, the
    rows of ``g`` are gathered, the owner of the layer's curvature preconditions the full
    matrix on ``device`` and broadcasts it, and each rank keeps its rows."""
    me, world = distributed.rank(), distributed.world()
    out = {}
    for n in curvature.layers:
        m = modules[n]
        rows = direction_rows[n]
        full = gather_rows(rows, m.out_features)
        if owners[n] == me:
            v = curvature.precondition({n: full}, device=device)[n]
        else:
            v = torch.empty_like(full)
        v = v.to(distributed._comm_device(v)).contiguous()
        dist.broadcast(v, owners[n])
        a, b = row_range(m.out_features, me, world)
        out[n] = v[a:b].to(rows.device).clone()
        del full, v
    return out

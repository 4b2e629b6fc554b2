"""The score loop: ``s(z) = g_z . v`` for every candidate, without per-example gradients.

For each tracked layer with preconditioned target ``V = (H^-1 g_KL)_l``:
``g_z . v = sum_l sum_t b_t^T V_l a_t``.

The scorer is :class:`prism_select.engine.ExactScorer`: one forward
and one backward *to the activations* (parameters frozen, no weight gradients, nothing
below the first tracked layer), with each tracked layer contracting ``V`` in the
model's dtype on tensor cores and the token dot products accumulated in float32
(float64 models: exact in float64). ``impl="hooks"`` is a hook-based reference route
(float32 ``u = V a`` in a forward hook).

Examples are processed in length-sorted chunks; each finished chunk is written to
``<out>/.partial/chunk_NNNNNN.safetensors``, so a killed run resumes where it was.
A chunk holds at most ``chunk_size`` examples and, on the CPU, at most
``CPU_CHUNK_FLOPS`` of work (:func:`chunk_token_limit`), so a slow CPU run keeps its
work about every minute; the cut depends only on the pool's token counts, the model's
size and the device type, so a resumed run sees the same chunks.
Under ``torchrun`` each rank owns the chunks of one contiguous, token-balanced share
of the length-sorted pool (:func:`plan_chunks`) and the scores are gathered in pool
order (:mod:`prism_select.runtime.distributed`). :func:`score_stream` scores a pool file a
window at a time (host memory flat in pool size).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .data.readers import iter_pool
from .data.records import InvalidRecord
from .data.tokenize import collate, encode, token_losses
from .engine import ExactScorer, collate_to, cpu_response_split
from .engine.policy import precision_policy
from .errors import CacheError, ConfigError, InputError
from .gradients import activation_grad_mode, check_finite
from .io import atomic_open, atomic_write_json, read_saved_state
from .model.moe import layer_mask
from .runtime import distributed, profiling
from .runtime.execution import ExecutionContext
from .runtime.graphs import GraphedScorer, graphs_wanted
from .runtime.layers import has_bias
from .settings import DEFAULT_CHUNK_SIZE

#: On the CPU a chunk also holds at most this many FLOPs of scoring work, counted as
#: ``4 x parameters`` per token (a forward and an activation-only backward): 1e12 is
#: about 1,850 tokens of the embedded 135M model, 20-40 s on 2 busy CPU cores, so a
#: killed CPU run keeps its work at least every minute or so. A GPU scores 1024
#: examples in seconds and needs no such cap.
CPU_CHUNK_FLOPS = 1e12


class _ScoreHooks:
    def __init__(self, modules: dict, V: dict, compute_dtype):
        self.modules, self.V, self.dt = modules, V, compute_dtype
        self.mask = None
        self.scores = None
        self.handles = []

    def __enter__(self):
        for name, m in self.modules.items():
            self.handles.append(m.register_forward_hook(self._hook(name, m)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _hook(self, name, module):
        V = self.V[name]
        bias = has_bias(module)

        def fwd(mod, inputs, output):
            a = inputs[0].detach().to(self.dt)
            u = a @ V[:, : a.shape[-1]].T
            if bias:
                u = u + V[:, -1]
            u = u * layer_mask(module, self.mask)[..., None].to(self.dt)  # an expert's: at its slots

            def grad_hook(g):
                self.scores += (g.detach().to(self.dt) * u).sum(dim=(1, 2)).to(self.scores.dtype)

            if output.requires_grad:
                output.register_hook(grad_hook)
        return fwd


def score_batch(model, hooks: _ScoreHooks, batch: list, pad_id: int, device) -> torch.Tensor:
    """The original hook-based exact route (``impl="hooks"``), kept as a reference."""
    b = collate(batch, pad_id, device)
    hooks.mask = b["attention_mask"]
    hooks.scores = torch.zeros(len(batch), dtype=torch.float64, device=device)
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
    losses, _ = token_losses(out.logits, b["labels"])
    losses.sum().backward()
    return hooks.scores.detach()


class _HookScorer:
    def __init__(self, model, modules, V, pad_id, device):
        compute = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
        self.model, self.pad_id, self.device = model, pad_id, device
        self.Vd = {n: V[n].to(device=device, dtype=compute) for n in modules}
        self.hooks = _ScoreHooks(modules, self.Vd, compute)

    def __enter__(self):
        self._grad = activation_grad_mode(self.model)
        self._grad.__enter__()
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)
        self._grad.__exit__(*exc)

    def score(self, b):
        self.hooks.mask = b["attention_mask"]
        self.hooks.scores = torch.zeros(b["input_ids"].shape[0], dtype=torch.float64, device=self.device)
        with torch.enable_grad():
            out = self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
            losses, _ = token_losses(out.logits, b["labels"])
            losses.sum().backward()
        return self.hooks.scores


def plan_chunks(encoded: list, chunk_size: int, parts: int = 1, max_tokens: int | None = None,
                align: int = 1, interleave: bool = False) -> tuple:
    """Length-sorted index chunks and the rank that owns each: ``(chunks, owners)``.

    The length-sorted order is first cut into ``parts`` contiguous shares of near-equal
    token count (:func:`prism_select.runtime.distributed.contiguous_owners`), then each share
    into chunks of ``chunk_size`` examples; with ``max_tokens`` a chunk also ends before
    it would exceed that many tokens (it always holds at least one example). So each rank
    meets only its own range of lengths (graph captures divide with the work).
    ``align`` (the batch size) moves each share's first example to a multiple of ``align``
    in the sorted order: when it also divides ``chunk_size`` and no token limit applies,
    every batch holds the same examples on any number of ranks as on one, and
    half-precision scores, which depend slightly on the batch an example is padded with,
    match the one-rank run's.
    ``interleave`` (FSDP2, whose ranks run their batches in lockstep): the runs of
    ``align`` examples of the sorted order are dealt to the ranks in turn instead, so each
    step's batches are about as long on every rank and the ranks' step counts differ by
    at most one; each rank's runs then fill its chunks in order. The batches are still
    the one-rank run's under the same condition.
    Deterministic: the same pool, ``parts`` and limits give the same chunks, which is what
    resuming relies on (a resumed run with another world size or limit recomputes the
    chunks whose contents differ).
    """
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i].input_ids), i))
    align = max(1, int(align))
    if interleave and parts > 1:
        return _dealt_chunks(encoded, order, chunk_size, parts, max_tokens, align)
    share = distributed.contiguous_owners([len(encoded[i].input_ids) for i in order], parts)
    share = [share[k - k % align] for k in range(len(share))]  # a batch-sized run stays together
    chunks, owners = [], []
    for k, i in enumerate(order):
        n = len(encoded[i].input_ids)
        if (not chunks or share[k] != owners[-1] or len(chunks[-1]) >= chunk_size
                or (max_tokens is not None and tokens + n > max_tokens)):
            chunks.append([])
            owners.append(share[k])
            tokens = 0
        chunks[-1].append(i)
        tokens += n
    return chunks, owners


def _dealt_chunks(encoded, order, chunk_size, parts, max_tokens, align) -> tuple:
    """:func:`plan_chunks` with ``interleave``: run ``j`` of ``align`` sorted examples goes
    to rank ``j % parts``; a rank's chunk ends at ``chunk_size`` examples or before
    ``max_tokens``. Chunks are numbered in the order they are opened (deterministic)."""
    chunks, owners = [], []
    open_: dict = {}  # rank -> (index of its open chunk, its tokens)
    for k, i in enumerate(order):
        r, n = (k // align) % parts, len(encoded[i].input_ids)
        c, tokens = open_.get(r, (None, 0))
        if (c is None or len(chunks[c]) >= chunk_size
                or (max_tokens is not None and tokens + n > max_tokens)):
            chunks.append([])
            owners.append(r)
            c, tokens = len(chunks) - 1, 0
        chunks[c].append(i)
        open_[r] = (c, tokens + n)
    return chunks, owners


def chunk_token_limit(model, device) -> int | None:
    """Tokens per chunk on the CPU (``CPU_CHUNK_FLOPS`` of work for this model); None on
    other devices."""
    if torch.device(device).type != "cpu":
        return None
    params = sum(p.numel() for p in model.parameters())
    return max(1, int(CPU_CHUNK_FLOPS // (4 * max(params, 1))))


def make_scorer(model, modules: dict, V: dict, *, pad_id: int = 0, impl: str = "auto", batch_size: int | None = None,
                execution: ExecutionContext | None = None):
    """A context-managed object with ``score(collated_batch) -> (B,) tensor`` (``(B, K)``
    when ``V`` stacks K directions per layer).

    impl: ``auto`` (one forward + one activation-only backward) or ``hooks`` (the
    reference route). ``execution`` (default: :meth:`ExecutionContext.of` the model, CUDA
    graphs off): the device; ``cuda_graphs``: ``auto`` (on for CUDA devices and models
    below ``graphs.AUTO_MAX_PARAMS``) | ``on`` | ``off``; graphs capture the whole batch
    computation once per padded shape (:mod:`prism_select.runtime.graphs`) and need
    ``batch_size`` (every batch is padded to it); ``precision``: ``model`` |
    ``residual32`` | ``split32`` (half-precision models: float32 residual stream, or
    float32 activations everywhere with split half-precision GEMMs;
    :mod:`prism_select.runtime.precision`); ``kernels``: the kernel choices
    (:class:`prism_select.runtime.execution.Kernels`).
    """
    execution = execution or ExecutionContext.of(model, cuda_graphs="off")
    device, precision, kernels = execution.device, execution.precision, execution.kernels
    cuda_graphs = execution.cuda_graphs
    if V is None and impl == "hooks":  # FSDP2: v lives in the layers
        raise ConfigError("shard", "a sharded model scores with the fused route only, not impl='hooks'",
                          "leave impl at auto")
    if impl == "hooks":
        return _HookScorer(model, modules, V, pad_id, device)
    # on the CPU the logits only at response positions
    sc = ExactScorer(model, modules, V, kernels=kernels, fused_loss=cpu_response_split(model, modules) is not None)
    if precision != "model":
        sc = _WithPrecision(sc, model, execution)
    if batch_size is not None and V is not None and graphs_wanted(cuda_graphs, device, model):
        return GraphedScorer(sc, batch_size, pad_id)
    return sc


class _WithPrecision:
    """Runs ``scorer`` under a precision policy (:func:`precision.precision_policy`)."""

    def __init__(self, scorer, model, execution: ExecutionContext):
        self.inner, self.model, self.execution = scorer, model, execution

    def __enter__(self):
        self._policy = precision_policy(self.model, self.execution)
        self._policy.__enter__()
        if hasattr(self.inner, "__enter__"):
            self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            if hasattr(self.inner, "__exit__"):
                self.inner.__exit__(*exc)
        finally:
            self._policy.__exit__(*exc)

    def __getattr__(self, name):  # neutral(), captures, ...: whatever the inner scorer has
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def score(self, batch):
        return self.inner.score(batch)


class _Plain:
    def __init__(self, scorer):
        self.scorer = scorer

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def score(self, b):
        return self.scorer.score(b)


def _chunk_path(partial_dir: Path, k: int) -> Path:
    return partial_dir / f"chunk_{k:06d}.safetensors"


def _save_chunk(partial_dir: Path, k: int, chunk, out: torch.Tensor):
    f = _chunk_path(partial_dir, k)
    tmp = partial_dir / f".chunk_{k:06d}.{distributed.rank()}.tmp"
    save_file({"index": torch.as_tensor(chunk, dtype=torch.int64), "score": out}, str(tmp))
    tmp.replace(f)


def _load_chunk(partial_dir: Path, k: int, chunk):
    f = _chunk_path(partial_dir, k)
    if not f.exists():
        return None
    try:
        t = load_file(str(f))
    except Exception:  # a torn file cannot exist (atomic rename), but be safe
        return None
    if t["index"].tolist() != list(chunk):
        return None
    return t["score"]


@dataclass(frozen=True)
class Chunking:
    """How the scores are cut and kept: at most ``size`` examples a chunk; with ``dir``,
    every finished chunk is saved there and reused by a later call with the same ``key``
    (the run's settings; a mismatched key raises :class:`CacheError`)."""

    size: int = DEFAULT_CHUNK_SIZE
    dir: Path | str | None = None
    key: dict | None = None


@dataclass
class ChunkLayout:
    """The chunks of one call of :func:`score_chunks`: ``chunks`` (index lists into its
    examples), ``owners`` (the rank that scores each; default all rank 0), ``together``
    (the model is sharded with FSDP2, so every rank runs as many batches), and where the
    chunks sit in the whole pool: ``index_base`` (the first example's position) and
    ``chunk_base`` (the first chunk's global number, the name of its saved file)."""

    chunks: list
    owners: list | None = None
    together: bool = False
    index_base: int = 0
    chunk_base: int = 0

    def saved_as(self, k: int) -> tuple:
        """Chunk ``k``'s global number and the pool positions of its examples."""
        return self.chunk_base + k, [self.index_base + i for i in self.chunks[k]]


def _open_partial(chunking: Chunking):
    """The directory of the finished chunks (made, with the run key, by the main process),
    or None when nothing is kept."""
    if chunking.dir is None:
        return None
    partial_dir = Path(chunking.dir)
    state = partial_dir / "state.json"
    if distributed.is_main():
        partial_dir.mkdir(parents=True, exist_ok=True)
        if state.exists():
            old = read_saved_state(state)
            if old != chunking.key:
                raise CacheError(
                    f"{partial_dir} holds an unfinished run with other settings; "
                    "use the same command to resume it, or --overwrite to start again")
        else:
            atomic_write_json(state, chunking.key)
    distributed.barrier()
    return partial_dir


def _count_batch(stats: dict, scorer, items: list, batch) -> None:
    """Add one scored batch to ``stats``: examples, real tokens, and the tokens computed
    (padding included; a graphed scorer pads further)."""
    stats["examples"] = stats.get("examples", 0) + len(items)
    stats["real_tokens"] = stats.get("real_tokens", 0) + sum(len(e.input_ids) for e in items)
    computed = getattr(scorer, "computed_tokens", None)
    stats["padded_tokens"] = stats.get("padded_tokens", 0) + (
        computed(batch) if computed else batch["input_ids"].numel())


def _finish_chunk(parts: list, chunk: list, ids) -> torch.Tensor:
    """One chunk's scores, float64 on the host (one device sync per chunk); a non-finite
    score raises, naming its records."""
    out = torch.cat(parts).to("cpu", torch.float64)
    bad = (~torch.isfinite(out.reshape(len(out), -1))).any(1).nonzero().flatten().tolist()
    if bad:
        check_finite(out, "candidate scores", record=[ids[chunk[i]] if ids is not None else chunk[i] for i in bad])
    return out


def _reuse_saved(layout: ChunkLayout, mine: list, partial_dir, progress: bool) -> tuple:
    """``(results, todo)``: the scores of this rank's chunks already saved in
    ``partial_dir``, and the chunks still to score."""
    results, todo = {}, []
    for k in mine:
        got = _load_chunk(partial_dir, *layout.saved_as(k)) if partial_dir is not None else None
        if got is not None:
            results[k] = got
        else:
            todo.append(k)
    if results:  # what a resumed run reuses, on the console
        chunks = layout.chunks
        distributed.say(f"scoring: {sum(len(chunks[k]) for k in results)} of {sum(len(chunks[k]) for k in mine)} "
                        f"examples reused from the finished chunks in {partial_dir}", progress)
    return results, todo


def score_chunks(scorer, encoded: list, layout: ChunkLayout, *, pad_id: int, batch_size: int,
                 execution: ExecutionContext, partial_dir=None, ids=None, stats: dict | None = None) -> dict:
    """Score this rank's chunks of ``layout`` that are not saved in ``partial_dir`` yet.

    Returns ``{k: scores (float64, chunk order)}`` for this rank's chunks. ``stats``,
    if given, accumulates ``examples``, ``real_tokens`` and ``padded_tokens``.
    """
    chunks, device, progress = layout.chunks, execution.device, execution.progress
    owners = layout.owners if layout.owners is not None else [0] * len(chunks)
    mine = [k for k in range(len(chunks)) if owners[k] == distributed.rank()]
    results, todo = _reuse_saved(layout, mine, partial_dir, progress)
    bar = tqdm(total=sum(len(chunks[k]) for k in todo), desc="scoring", unit="ex",
               disable=not progress or not distributed.is_main())
    # (chunk, first example) of every batch to run; under FSDP2 every rank runs as many
    # (distributed.lockstep), a rank with less work repeating a batch it discards
    steps = [(k, s) for k in todo for s in range(0, len(chunks[k]), batch_size)]
    together = layout.together and distributed.active()
    parts: list = []
    with (scorer if todo or together else _Plain(None)):
        for (k, s), real in profiling.steps("scoring", distributed.lockstep(steps, (None, None), together)):
            if k is None:  # a rank without any chunk keeping in step: any example will do
                scorer.score(collate_to([encoded[0]], pad_id, device))
                continue
            chunk = chunks[k]
            items = [encoded[i] for i in chunk[s:s + batch_size]]
            b = collate_to(items, pad_id, device)
            got = scorer.score(b).detach()
            if not real:
                continue
            parts.append(got)
            if stats is not None:
                _count_batch(stats, scorer, items, b)
            bar.update(len(items))
            if s + batch_size < len(chunk):
                continue
            results[k], parts = _finish_chunk(parts, chunk, ids), []
            if partial_dir is not None:
                _save_chunk(partial_dir, *layout.saved_as(k), results[k])
    bar.close()
    return results


def _gather(n: int, layout: ChunkLayout, results: dict, columns: tuple = ()) -> torch.Tensor:
    """Every rank's chunk scores of ``n`` examples, in input order, on every rank
    (``(n,)``, or ``(n, K)`` for ``K`` stacked directions)."""
    if results:
        index = torch.cat([torch.as_tensor(layout.chunks[k], dtype=torch.int64) for k in results])
        values = torch.cat([results[k] for k in results])
    else:
        index, values = torch.zeros(0, dtype=torch.int64), torch.zeros((0, *columns), dtype=torch.float64)
    return distributed.gather_scores(n, index, values)


def score_encoded(model, modules: dict, encoded: list, V: dict, *, pad_id: int, batch_size: int = 8,
                  chunking: Chunking = Chunking(), ids=None, impl: str = "auto", stats: dict | None = None,
                  execution: ExecutionContext | None = None) -> torch.Tensor:
    """Scores ``g_z . V`` for every encoded example (float64, input order): ``(N,)``, or
    ``(N, K)`` when ``V`` stacks ``K`` directions per layer (``K x out x in [+1]``, all
    scored from one forward and backward per batch).

    ``chunking``: the chunk size, and where finished chunks are kept for a later call
    (:class:`Chunking`). ``execution``: device, precision, CUDA graphs, kernels and
    progress (default: :meth:`ExecutionContext.of` the model). Under ``torchrun`` each
    rank scores its share of the chunks and every rank returns the full, gathered scores.
    """
    execution = execution or ExecutionContext.of(model)
    chunks, owners = plan_chunks(encoded, chunking.size, distributed.world(),
                                 chunk_token_limit(model, execution.device), align=batch_size, interleave=V is None)
    partial_dir = _open_partial(chunking)
    scorer = make_scorer(model, modules, V, pad_id=pad_id, impl=impl, batch_size=batch_size, execution=execution)
    layout = ChunkLayout(chunks, owners, together=V is None)
    results = score_chunks(scorer, encoded, layout, pad_id=pad_id, batch_size=batch_size, execution=execution,
                           partial_dir=partial_dir, ids=ids, stats=stats)
    return _gather(len(encoded), layout, results, _columns(V))


def _columns(V: dict | None) -> tuple:
    """``(K,)`` when ``V`` stacks ``K`` directions per layer (``K x out x in [+1]``), else ``()``."""
    first = next(iter(V.values()), None) if V else None
    return (first.shape[0],) if first is not None and first.dim() == 3 else ()


def score_directions(model, modules: dict, encoded: list, Vs: list, *, pad_id: int, batch_size: int = 8,
                     execution: ExecutionContext | None = None) -> torch.Tensor:
    """Scores ``g_z . V_k`` of every encoded example for each direction of ``Vs`` (a list
    of ``{layer: V}``): ``(N, K)`` float64, input order, on one process.

    The directions are stacked per layer and scored together, from one forward and one
    backward per batch (:class:`~prism_select.engine.ExactScorer` with stacked ``V``),
    except under precision ``split32``, where each is scored on its own
    (:func:`score_encoded`). Sorted by length into batches, padded to
    ``batch_size`` rows under CUDA graphs."""
    execution = execution or ExecutionContext.of(model)
    if execution.precision == "split32" or len(Vs) == 1:
        return torch.stack([score_encoded(model, modules, encoded, V, pad_id=pad_id, batch_size=batch_size,
                                          execution=execution) for V in Vs], dim=1)
    stacked = {n: torch.stack([V[n] for V in Vs]) for n in modules}
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i].input_ids))
    out = torch.empty(len(encoded), len(Vs), dtype=torch.float64)
    scorer = make_scorer(model, modules, stacked, pad_id=pad_id, batch_size=batch_size, execution=execution)
    del stacked  # the scorer holds its own layout of them
    with scorer as sc:
        for s in range(0, len(order), batch_size):
            idx = order[s:s + batch_size]
            out[idx] = sc.score(collate_to([encoded[i] for i in idx], pad_id, execution.device)).double().cpu()
    check_finite(out, "scores")
    return out


# ----------------------------------------------------------------------------- streaming

def _stream_windows(tokenizer, pool_path, window: int, max_length: int, skip_invalid: bool, invalid: list):
    """Yield lists of ``(id, Encoded)`` of at most ``window`` valid records, in file order."""
    def bad(err):
        invalid.append(InvalidRecord.of(err, pool_path))

    buf = []
    for ex in iter_pool(pool_path, on_invalid=bad if skip_invalid else None):
        try:
            enc = encode(tokenizer, ex.prompt, ex.response, max_length, path=pool_path, row=ex.row, line=ex.line)
        except InputError as e:
            if not skip_invalid:
                raise
            bad(e)
            continue
        buf.append((ex.id, enc))
        if len(buf) >= window:
            yield buf
            buf = []
    if buf:
        yield buf


def _write_ranked(scores, ids_path, out_path, tasks: list | None = None) -> None:
    """``scores.jsonl`` lines (``id``, ``score``, ``rank``: 1 is the highest, ties in input
    order), the ids streamed back from ``ids_path``; written by the main process. With
    ``tasks`` (``scores`` is then ``(n, len(tasks))``), also ``scores`` (``{task: score}``)
    and ``ranks`` (``{task: rank}``); ``score`` / ``rank`` are the first task's."""
    n = len(scores)
    cols = scores.reshape(n, -1) if n else scores.reshape(0, max(1, len(tasks or ())))
    rank = np.empty(cols.shape, dtype=np.int64)
    for k in range(cols.shape[1]):
        order = np.lexsort((np.arange(n), -cols[:, k]))
        rank[order, k] = np.arange(1, n + 1)
        del order
    if distributed.is_main():
        with open(ids_path) as src, atomic_open(out_path) as dst:
            for i, line in enumerate(src):
                row = {"id": json.loads(line), "score": float(cols[i, 0]), "rank": int(rank[i, 0])}
                if tasks:
                    row["scores"] = {t: float(cols[i, k]) for k, t in enumerate(tasks)}
                    row["ranks"] = {t: int(rank[i, k]) for k, t in enumerate(tasks)}
                dst.write(json.dumps(row) + "\n")


def score_stream(model, tokenizer, modules: dict, V: dict, pool_path, out_path, *, max_length: int = 2048,
                 batch_size: int = 8, window: int = 65536, chunking: Chunking = Chunking(),
                 skip_invalid: bool = False, execution: ExecutionContext | None = None,
                 tasks: list | None = None) -> dict:
    """Score a pool file without holding it in memory; write ``scores.jsonl`` lines
    (``id``, ``score``, ``rank``) to ``out_path``. ``V`` may stack one direction per
    target set (``K x out x in [+1]``); ``tasks`` names them, and each line then also
    carries ``scores`` and ``ranks`` per task (:func:`_write_ranked`).

    The file is read ``window`` records at a time; each window is tokenised, cut into
    length-sorted chunks (numbered globally, so resuming and sharding work as in
    :func:`score_encoded`) and scored; the window's tokens are then dropped. Host memory
    is bounded by the window plus 16 bytes per record (the float64 score and the int64
    rank order, needed for the ranks). Ids go to a side file and are streamed back for
    the output. Scores equal those of :func:`score_encoded` on the same records for
    ``window >= len(pool)`` (same chunks); with smaller windows each example's score
    is the same function of the same tokens (batch composition differs, so expect
    agreement to float rounding).

    Returns ``count`` (records scored), ``invalid`` (records skipped under
    ``skip_invalid``), ``truncated`` (prompts cut to ``max_length``) and this rank's
    ``examples``, ``real_tokens`` and ``padded_tokens``. Ids are not checked for
    uniqueness here: :func:`prism_select.data.readers.scan_pool` does that in one pass.
    """
    execution = execution or ExecutionContext.of(model)
    pad_id = tokenizer.pad_token_id
    partial_dir = _open_partial(chunking)
    scorer = make_scorer(model, modules, V, pad_id=pad_id, batch_size=batch_size, execution=execution)
    max_tokens = chunk_token_limit(model, execution.device)
    invalid: list = []
    columns = _columns(V)
    if tasks and columns != (len(tasks),) and not (len(tasks) == 1 and not columns):
        raise ValueError(f"{columns or 1} stacked directions for {len(tasks)} tasks")
    scores = np.zeros((0, *columns), dtype=np.float64)
    n, chunk_base, truncated = 0, 0, 0
    out_path = Path(out_path)
    fd, ids_path = tempfile.mkstemp(prefix=".ids-", suffix=".jsonl", dir=str(out_path.parent))
    stats: dict = {}
    try:
        with os.fdopen(fd, "w") as ids_f:
            for win in _stream_windows(tokenizer, pool_path, window, max_length, skip_invalid, invalid):
                encoded = [e for _, e in win]
                truncated += sum(e.truncated for e in encoded)
                for rid, _ in win:
                    ids_f.write(json.dumps(rid) + "\n")
                chunks, owners = plan_chunks(encoded, chunking.size, distributed.world(), max_tokens,
                                             align=batch_size, interleave=V is None)
                layout = ChunkLayout(chunks, owners, together=V is None, index_base=n, chunk_base=chunk_base)
                res = score_chunks(scorer, encoded, layout, pad_id=pad_id, batch_size=batch_size,
                                   execution=execution, partial_dir=partial_dir, stats=stats,
                                   ids=[r for r, _ in win])
                scores = np.concatenate([scores, _gather(len(encoded), layout, res, columns).numpy()])
                n += len(encoded)
                chunk_base += len(chunks)
                del encoded, win, chunks, layout, res
        _write_ranked(scores, ids_path, out_path, tasks)
    finally:
        try:
            os.unlink(ids_path)
        except OSError:
            pass
    distributed.barrier()
    return {"count": n, "invalid": [r.to_json() for r in invalid], "truncated": truncated, **stats}

"""The score loop: ``s(z) = g_z . v`` for every candidate, without per-example gradients.

For each tracked layer with preconditioned target ``V = (H^-1 g_KL)_l``:
``g_z . v = sum_l sum_t b_t^T V_l a_t``. A forward hook forms ``u_t = V_l a_t``
(one extra matmul per layer, like a forward), a gradient hook on the layer's output
adds ``sum_t b_t . u_t`` to each example's score the moment ``b`` is known, so
neither ``a`` nor ``b`` outlives its layer's step of the backward pass. The backward
runs with parameters frozen: gradients w.r.t. activations only, no weight gradients.

Examples are processed in length-sorted chunks; each finished chunk is written to
``<out>/.partial/chunk_NNNNNN.safetensors``, so a killed run resumes where it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .data.tokenize import collate, token_losses
from .errors import CacheError
from .gradients import activation_grad_mode, check_finite, has_bias
from .io import atomic_write_json

DEFAULT_CHUNK_SIZE = 1024


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
            u = u * self.mask[..., None].to(self.dt)

            def grad_hook(g):
                self.scores += (g.detach().to(self.dt) * u).sum(dim=(1, 2)).to(self.scores.dtype)

            if output.requires_grad:
                output.register_hook(grad_hook)
        return fwd


def score_batch(model, hooks: _ScoreHooks, batch: list, pad_id: int, device) -> torch.Tensor:
    b = collate(batch, pad_id, device)
    hooks.mask = b["attention_mask"]
    hooks.scores = torch.zeros(len(batch), dtype=torch.float64, device=device)
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
    losses, _ = token_losses(out.logits, b["labels"])
    losses.sum().backward()
    return hooks.scores.detach().cpu()


def plan_chunks(encoded: list, chunk_size: int) -> list:
    """Length-sorted index chunks; deterministic, so a resumed run sees the same ones."""
    order = sorted(range(len(encoded)), key=lambda i: (len(encoded[i].input_ids), i))
    return [order[k:k + chunk_size] for k in range(0, len(order), chunk_size)]


def score_encoded(model, modules: dict, encoded: list, V: dict, *, pad_id: int, batch_size: int = 8,
                  device=None, chunk_size: int = DEFAULT_CHUNK_SIZE, partial_dir=None,
                  run_key: dict | None = None, progress: bool = True, ids=None) -> torch.Tensor:
    """Scores ``g_z . V`` for every encoded example (float64, input order).

    With ``partial_dir``, finished chunks are saved there and reused by a later call
    with the same ``run_key`` (a mismatched key raises :class:`CacheError`).
    """
    device = device or next(model.parameters()).device
    compute = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
    Vd = {n: V[n].to(device=device, dtype=compute) for n in modules}
    scores = torch.full((len(encoded),), float("nan"), dtype=torch.float64)
    chunks = plan_chunks(encoded, chunk_size)
    done = set()
    if partial_dir is not None:
        partial_dir = Path(partial_dir)
        partial_dir.mkdir(parents=True, exist_ok=True)
        state = partial_dir / "state.json"
        if state.exists():
            old = json.loads(state.read_text())
            if old != run_key:
                raise CacheError(
                    f"{partial_dir} holds an unfinished run with other settings; "
                    "use the same command to resume it, or --overwrite to start again")
        else:
            atomic_write_json(state, run_key)
        for k, chunk in enumerate(chunks):
            f = partial_dir / f"chunk_{k:06d}.safetensors"
            if f.exists():
                t = load_file(str(f))
                if t["index"].tolist() == chunk:
                    scores[t["index"]] = t["score"]
                    done.add(k)
    todo = [k for k in range(len(chunks)) if k not in done]
    bar = tqdm(total=sum(len(chunks[k]) for k in todo), desc="scoring", unit="ex", disable=not progress)
    with activation_grad_mode(model), _ScoreHooks(modules, Vd, compute) as hooks:
        for k in todo:
            chunk = chunks[k]
            out = torch.empty(len(chunk), dtype=torch.float64)
            for s in range(0, len(chunk), batch_size):
                idx = chunk[s:s + batch_size]
                out[s:s + len(idx)] = score_batch(model, hooks, [encoded[i] for i in idx], pad_id, device)
                check_finite(out[s:s + len(idx)], "candidate scores",
                             record=[ids[i] for i in idx] if ids is not None else idx)
                bar.update(len(idx))
            scores[chunk] = out
            if partial_dir is not None:
                f = partial_dir / f"chunk_{k:06d}.safetensors"
                tmp = partial_dir / f".chunk_{k:06d}.tmp"
                save_file({"index": torch.tensor(chunk, dtype=torch.int64), "score": out}, str(tmp))
                tmp.replace(f)
    bar.close()
    return scores

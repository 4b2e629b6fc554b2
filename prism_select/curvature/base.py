"""The fitted curvature object: preconditioning, save and load."""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..errors import CacheError, ConfigError
from ..gradients import release_host_memory, side_by_side
from ..io import atomic_write_json, sha256_file
from ..runtime import distributed
from ..settings import DEFAULT_BATCH_SIZE, check_seed, setting

KINDS = ("ekfac", "kfac", "diagonal", "identity")
FISHERS = ("empirical", "sampled")
DEFAULT_DAMPING_FACTOR = 0.1
#: ``shrinkage`` values besides a fixed weight in [0, 1]
SHRINKAGE_MODES = ("off", "auto")
#: how the damping factor is chosen: ``heuristic`` (``damping_factor``), ``split-half``
#: (:mod:`prism_select.curvature.support`), ``auto`` (identity curvature in place of a small
#: EK-FAC fit that no damping option shapes, else heuristic:
#: :func:`prism_select.run.preflight.small_pool_rule`)
DAMPING_RULES = ("auto", "heuristic", "split-half")
DEFAULT_DAMPING_RULE = "auto"
DEFAULT_SHRINKAGE = "off"


@dataclass
class FitSettings:
    """What determines the fitted factors (:func:`prism_select.curvature.store.curvature_key`
    keys the saved fit by these, less ``batch_size``, which does not change the sums).

    fisher: "empirical" (gradients at the data's own labels, as kronfluence's default) or
    "sampled" (labels drawn from the model's predictive distribution, a true-Fisher
    estimate). seed: seeds the fit sample and the sampled labels.
    """

    kind: str = setting("ekfac", flag="--curvature", choices=KINDS, help="the Hessian approximation H")
    fisher: str = setting("empirical", choices=FISHERS,
                          help="labels of the Fisher: the pool's own (empirical) or drawn from the model (sampled)")
    fit_examples: int | None = setting(None, help="fit on a seeded sample of N pool examples (if not given: the "
                                       "whole pool)")
    batch_size: int = setting(DEFAULT_BATCH_SIZE, key=False, help="examples per fitting batch")
    seed: int = setting(0, help="seeds the fit sample and the sampled labels")

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConfigError("curvature", f"unknown kind {self.kind!r}", f"use one of {', '.join(KINDS)}")
        if self.fisher not in FISHERS:
            raise ConfigError("fisher", f"unknown value {self.fisher!r}", f"use one of {', '.join(FISHERS)}")
        if self.fit_examples is not None and (isinstance(self.fit_examples, bool) or self.fit_examples < 1):
            raise ConfigError("fit_examples", "must be >= 1", "leave it out to fit on the whole pool")
        if isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise ConfigError("batch_size", "must be >= 1")
        check_seed(self.seed)


def _shrinkage_value(text):
    """``--shrinkage``: a mode name, else a number (checked by PreconditionSettings)."""
    try:
        return float(text)
    except (TypeError, ValueError):
        return text


#: the largest explicit damping: scores are products of gradients divided by the damped
#: eigenvalues, in float32 where the model is; a damping above float32's range (3.4e38)
#: becomes inf and every score exactly 0, and up to 1e30 a product of gradients as small as
#: 1e-8 still gives a normal float32 score (an ever larger damping only tends to the
#: identity's ranking, which --kind identity computes directly)
MAX_DAMPING = 1e30
#: the largest damping factor: the heuristic damping is the factor times a layer's mean
#: eigenvalue, which must stay below :data:`MAX_DAMPING` for mean eigenvalues up to 1e10
MAX_DAMPING_FACTOR = 1e20


@dataclass
class PreconditionSettings:
    """How the fitted ``H`` is damped and shrunk before it is inverted; applied to a fit
    (:func:`apply_damping`), so none of it is in the fit's key.

    damping: explicit ``lambda`` added to every eigenvalue; ``None`` uses the heuristic
        ``damping_factor * mean eigenvalue`` of each layer (for diagonal, the mean
        diagonal entry), which keeps the ranking independent of the loss scale.
    damping_noise (EK-FAC, heuristic damping only): add to each layer's damping the
        root-mean-square standard error of its corrected eigenvalues,
        ``sqrt(LambdaVar / number of eigenvalues)`` (``LambdaVar``: see ``shrinkage``), so that
        eigenvalues within the sampling noise of their estimate are not inverted as if
        known; it falls as ``1/sqrt(N)`` with the number of fit examples.
    shrinkage (EK-FAC only; other kinds ignore it): how far each layer's corrected
        eigenvalues ``Lambda`` are pulled toward its K-FAC eigenvalues
        ``outer(eig(S), eig(A))`` (rescaled to the same sum), ``(1 - rho) Lambda +
        rho c Lambda_KFAC``. ``off``: ``rho = 0`` (EK-FAC as fitted); ``auto``: the
        Ledoit-Wolf weight ``rho = min(1, Var(Lambda) / ||Lambda - c Lambda_KFAC||^2)``,
        with ``Var(Lambda)`` (``LambdaVar``) the sampling variance of the per-example
        average that ``Lambda`` is, summed over its entries, estimated from the same fit
        (it shrinks as ``1/N``: few fit examples pull toward K-FAC, many leave EK-FAC);
        a number in [0, 1]: that ``rho`` for every layer.
    damping_rule: ``auto``: an EK-FAC fit on fewer than
        :data:`~prism_select.run.preflight.SMALL_FIT_EXAMPLES` (300) examples that none of
        ``damping``, ``damping_factor``, ``damping_noise``, ``shrinkage`` shapes is not
        made: the run ranks with identity curvature (:func:`~prism_select.run.preflight.small_pool_rule`);
        else ``heuristic``;
        ``heuristic`` (``damping_factor`` x mean eigenvalue; EK-FAC as kronfluence computes it); ``split-half``
        (EK-FAC): EK-FAC is also fitted on two random halves of the fit sample, and the
        damping factor is the least of :data:`~prism_select.curvature.support.DAMPING_LADDER`
        at which the halves' ``v`` rank the fit sample alike
        (:func:`~prism_select.curvature.support.supported_damping_factor`); when they agree
        at none, the run ranks with identity curvature. Costs two half-size fits and up to
        eight scorings of the fit sample, outside the memory plan; needs at least
        :data:`~prism_select.curvature.support.MIN_FIT_EXAMPLES` fit examples.
    """

    damping: float | None = setting(None, help=f"explicit damping (if not given: {DEFAULT_DAMPING_FACTOR} x mean "
                                    "eigenvalue per layer)")
    damping_factor: float = setting(DEFAULT_DAMPING_FACTOR, metavar="F",
                                    help="the heuristic damping is F x mean eigenvalue per layer")
    damping_noise: bool = setting(False, help="EK-FAC: add the eigenvalues' root-mean-square standard error "
                                  "(estimated from the fit) to the heuristic damping: large on small pools, "
                                  "vanishing on large ones")
    shrinkage: str | float = setting(DEFAULT_SHRINKAGE, metavar="{off,auto,RHO}", parse=_shrinkage_value,
                                     help="EK-FAC: pull each layer's corrected eigenvalues toward its K-FAC "
                                          "eigenvalues; auto: by the Ledoit-Wolf weight estimated from the fit "
                                          "(strong on small pools, vanishing on large ones); RHO: a fixed weight "
                                          "in [0, 1]")

    damping_rule: str = setting(DEFAULT_DAMPING_RULE, choices=DAMPING_RULES,
                                help="heuristic: damping-factor x mean eigenvalue; split-half (EK-FAC): the least "
                                     "damping factor (0.1, 1, 10, 100) at which EK-FAC fits on two random halves of "
                                     "the fit sample rank it alike (Spearman >= 0.9), identity when none does; auto: "
                                     "identity curvature (no fit) in place of an EK-FAC fit on fewer than 300 "
                                     "examples that no other damping option shapes, else heuristic")

    def __post_init__(self):
        if self.damping_rule not in DAMPING_RULES:
            raise ConfigError("damping_rule", f"unknown value {self.damping_rule!r}",
                              f"use one of {', '.join(DAMPING_RULES)}")
        if self.damping_rule == "split-half" and self.damping is not None:
            raise ConfigError("damping_rule", "split-half chooses the damping; an explicit --damping contradicts it",
                              "leave out --damping, or use --damping-rule heuristic")
        if self.damping is not None and (isinstance(self.damping, bool) or not (
                isinstance(self.damping, (int, float)) and 0 <= self.damping <= MAX_DAMPING)):
            raise ConfigError("damping", f"must be a number within [0, {MAX_DAMPING:g}], got {self.damping}",
                              "pass e.g. --damping 1e-3, or leave it out for the heuristic")
        if isinstance(self.damping_factor, bool) or not (isinstance(self.damping_factor, (int, float))
                                                         and 0 < self.damping_factor <= MAX_DAMPING_FACTOR):
            raise ConfigError("damping_factor", f"must be within (0, {MAX_DAMPING_FACTOR:g}], got "
                              f"{self.damping_factor}", f"pass e.g. --damping-factor {DEFAULT_DAMPING_FACTOR}")
        if not isinstance(self.damping_noise, bool):
            raise ConfigError("damping_noise", f"must be true or false, got {self.damping_noise!r}")
        sh = self.shrinkage
        if isinstance(sh, bool) or not (sh in SHRINKAGE_MODES or isinstance(sh, (int, float)) and 0 <= sh <= 1):
            raise ConfigError("shrinkage", f"unknown value {sh!r}",
                              f"use {' or '.join(SHRINKAGE_MODES)}, or a weight within [0, 1]")


@dataclass
class CurvatureSettings(PreconditionSettings, FitSettings):
    """How to fit ``H`` and precondition with it: the fields of :class:`FitSettings`
    (what determines the factors) and :class:`PreconditionSettings` (damping and
    shrinkage, applied after the fit) in one object."""

    def __post_init__(self):
        FitSettings.__post_init__(self)
        PreconditionSettings.__post_init__(self)


#: ``Curvature.precondition(release=True)`` hands the host heap back to the system (glibc's
#: ``malloc_trim``) each time the layers it released add up to this many bytes (about 14
#: times for the embedded model's 1.7 GB curvature)
PRECONDITION_TRIM_BYTES = 128 << 20


class Curvature:
    """Per-layer damped inverse of ``H``, applied to ``out x in'`` gradient matrices.

    ``tensors`` (a dict; a loaded curvature's is a :class:`HostTensorFiles`, which reads
    each tensor from its file when used) holds, per layer ``name``: ekfac ``name::QA``, ``name::QS``,
    ``name::Lambda``, and the K-FAC eigenvalues ``name::lamA``, ``name::lamS`` with
    ``name::LambdaVar`` (the estimated sampling variance of ``Lambda``, summed over its
    entries) for the shrinkage and the noise damping; kfac ``name::QA``, ``name::lamA``, ``name::QS``,
    ``name::lamS``; diagonal ``name::D``. ``damping`` maps each layer to the ``lambda``
    used, ``shrinkage`` (ekfac) to the weight ``rho`` of the K-FAC eigenvalues
    (:class:`CurvatureSettings`; absent = 0).
    """

    def __init__(self, kind: str, layers: list, tensors: MutableMapping, damping: dict, meta: dict | None = None,
                 shrinkage: dict | None = None):
        if kind not in KINDS:
            raise ConfigError("curvature", f"unknown kind {kind!r}")
        self.kind = kind
        self.layers = list(layers)
        self.tensors = tensors
        self.damping = dict(damping)
        self.shrinkage = dict(shrinkage or {})
        self.meta = meta or {}

    def eigenvalues(self, name: str, device=None, dtype=None) -> torch.Tensor:
        """The (undamped) eigenvalues of ``H_l`` as an ``out x in'`` grid, computed on
        ``device`` in ``dtype`` (default: the stored tensors'). EK-FAC with a shrinkage
        weight ``rho > 0``: ``(1 - rho) Lambda + rho c outer(lamS, lamA)``, ``c`` making
        the sum equal to ``Lambda``'s."""
        def get(key):
            return self.tensors[f"{name}::{key}"].to(device=device, dtype=dtype)

        if self.kind == "ekfac":
            lam = get("Lambda")
            rho = self.shrinkage.get(name, 0.0)
            if not rho:
                return lam
            kfac = get("lamS")[:, None] * get("lamA")[None, :]
            return torch.lerp(lam, kfac_matched(lam, kfac), float(rho))
        if self.kind == "kfac":
            return get("lamS")[:, None] * get("lamA")[None, :]
        if self.kind == "diagonal":
            return get("D")
        raise ConfigError("curvature", "identity has no eigenvalues")

    def precondition(self, grads, device=None, consume: bool = False, release: bool = False) -> dict:
        """``H^-1 g`` layer by layer for the layers of ``grads`` (``grads[name]`` is an
        ``out x in'`` matrix; a dict, or a mapping with ``pop`` such as
        :class:`prism_select.gradients.SpilledLayers`). Each layer is computed on ``device``
        (default: where its gradient is; e.g. the GPU for a direction or factors kept in
        host memory) and returned where its gradient was. ``consume``: each layer is taken
        out of ``grads`` as it is done (the caller's last use: the input and the result are
        not held whole side by side). ``release``: each layer's fitted tensors are dropped
        from this curvature once used (the caller's last use of it: the curvature and the
        result are not held whole side by side); the layer cannot be preconditioned again.
        With ``release``, the heap of the released host tensors is handed back to the
        system (:func:`prism_select.gradients.release_host_memory`) each time
        PRECONDITION_TRIM_BYTES of them have been released, and at the end: glibc kept it
        and does not reuse it for ``v``, so without the trim the process grows by ``v``
        while its live tensors shrink (docs/performance.md, the 1,000-record CPU fit). A
        loaded curvature (:class:`HostTensorFiles`) is read layer by layer here, and the
        heap of those reads is handed back likewise, with or without ``release``."""
        out = {}
        freed = [0]  # bytes of released (or read and let go) host tensors since the last trim
        on_disk = isinstance(self.tensors, HostTensorFiles)
        unknown = [n for n in grads if n not in self.damping]
        if unknown:
            raise ConfigError("curvature", f"no fitted curvature for layer(s) {', '.join(unknown[:3])}")

        def prepare(name):  # this thread: the layer's gradient and curvature (released here)
            g = grads.pop(name) if consume else grads[name]
            if self.kind == "identity":
                return name, g, None
            if self.kind == "diagonal" and f"{name}::D" not in self.tensors or \
                    self.kind != "diagonal" and f"{name}::QA" not in self.tensors:
                raise ConfigError("curvature", f"the fitted curvature of layer {name!r} was not kept "
                                  "(a transient memory plan preconditions while it fits; a released "
                                  "curvature preconditions once)",
                                  "precondition through the run's context, or give the run more memory")
            t = self.tensors
            dev = torch.device(device) if device is not None else g.device
            dt = torch.float64 if g.dtype == torch.float64 else torch.float32
            if self.kind == "diagonal":
                parts = (t[f"{name}::D"].to(device=dev, dtype=dt),)
            else:
                parts = (t[f"{name}::QA"].to(device=dev, dtype=dt), t[f"{name}::QS"].to(device=dev, dtype=dt),
                         self.eigenvalues(name, device=dev, dtype=dt))
            if release or on_disk:
                for k in [k for k in t if k.startswith(f"{name}::")]:
                    freed[0] += _host_bytes(t, k)
                    if release:
                        del t[k]
                if freed[0] >= PRECONDITION_TRIM_BYTES:
                    freed[0] = 0
                    release_host_memory()
            return name, g, (dev, dt, self.damping[name], parts)

        def compute(job):  # a worker (or this thread): the layer's arithmetic
            name, g, how = job
            if how is None:
                return name, g.clone()
            dev, dt, lam, parts = how
            gd = g.to(device=dev, dtype=dt)
            if self.kind == "diagonal":
                return name, (gd / (parts[0] + lam)).to(device=g.device, dtype=g.dtype)
            QA, QS, eig = parts
            rot = QS.T @ gd @ QA
            return name, (QS @ (rot / (eig + lam)) @ QA.T).to(device=g.device, dtype=g.dtype)

        names = list(grads)
        # on the CPU the layers run side by side on one-thread workers (four GEMMs each:
        # better use of two cores than each GEMM over both), a few layers in flight
        on_cpu = self.kind in ("kfac", "ekfac") and len(names) > 1 and (
            torch.device(device).type == "cpu" if device is not None
            else isinstance(grads, dict) and all(grads[n].device.type == "cpu" for n in names))
        jobs = (prepare(n) for n in names)
        results = side_by_side(compute, jobs, window=torch.get_num_threads() + 1) if on_cpu else map(compute, jobs)
        for name, v in results:
            out[name] = v
        if freed[0]:
            release_host_memory()
        return out

    # -- persistence ---------------------------------------------------------------
    def save(self, directory, meta: dict):
        """Write the factors and ``curvature.json`` (settings, fingerprints, file list)
        into ``directory``, each file atomically; ``curvature.json`` comes last.

        One process writes ``factors.safetensors``. Under torchrun every rank must call
        this: each writes a contiguous, size-balanced share of the tensors to
        ``factors-RRRRR-of-KKKKK.safetensors`` (the copy to the host and the write divide
        with the ranks) and rank 0 writes ``curvature.json`` once all shares are on disk.
        """
        d = Path(directory)
        parts, me = distributed.world(), distributed.rank()
        if distributed.is_main():
            d.mkdir(parents=True, exist_ok=True)
        distributed.barrier()
        names = list(self.tensors)
        owner = distributed.contiguous_owners([self.tensors[k].numel() for k in names], parts)
        files = (["factors.safetensors"] if parts == 1
                 else [f"factors-{r:05d}-of-{parts:05d}.safetensors" for r in range(parts)])
        mine = _host_tensors({k: self.tensors[k] for k, o in zip(names, owner) if o == me})
        tmp = d / f".{files[me]}.tmp"
        save_file(mine, str(tmp))
        tmp.replace(d / files[me])
        distributed.barrier()
        full = dict(meta)
        full.update({"kind": self.kind, "layers": self.layers, "damping": self.damping,
                     "shrinkage": self.shrinkage, "files": files})
        if distributed.is_main():
            # the files' content, checked on every load: a factor changed in place (same size)
            # would otherwise give other scores without a word
            full["files_sha256"] = {f: sha256_file(d / f) for f in files}
            atomic_write_json(d / "curvature.json", full)
        distributed.barrier()
        self.meta = full

    @classmethod
    def load(cls, directory, expect: dict | None = None, device=None) -> "Curvature":
        """Load a saved curvature (onto ``device``, default the host); with ``expect``,
        refuse (CacheError) unless every key of ``expect`` equals the saved metadata
        (settings and fingerprints). On the host its tensors stay in the files until used
        (:class:`HostTensorFiles`: each read when asked for, the files held open); on
        another device they are read whole."""
        d = Path(directory)
        meta_path = d / "curvature.json"
        if not meta_path.exists():
            raise CacheError(f"no saved curvature in {d} (expected curvature.json)")
        meta = read_meta(meta_path)
        files = meta.get("files", ["factors.safetensors"])
        missing = [f for f in files if not (d / f).exists()]
        if missing:
            raise CacheError(f"saved curvature in {d} is incomplete: {', '.join(missing)} missing")
        sums = meta.get("files_sha256")
        changed = [f for f in files if not isinstance(sums, dict) or sums.get(f) != sha256_file(d / f)]
        if changed:
            raise CacheError(f"saved curvature in {d}: the content of {', '.join(changed)} does not match its "
                             "checksum in curvature.json (changed since it was saved, or saved without one)")
        if expect:
            diff = [k for k, v in expect.items() if meta.get(k) != v]
            if diff:
                raise CacheError(
                    f"saved curvature in {d} was fitted with other {', '.join(diff)}; "
                    "refusing to reuse it (fit again, or pass the matching model/pool/settings)")
        if device is None or torch.device(device).type == "cpu":
            tensors = HostTensorFiles([d / f for f in files])
        else:
            tensors = {}
            for f in files:
                tensors.update(load_file(str(d / f), device=str(device)))
        return cls(meta["kind"], meta["layers"], tensors, meta["damping"], meta, meta.get("shrinkage"))


def read_meta(path: Path) -> dict:
    """A saved curvature's ``curvature.json``, or :class:`CacheError` when it cannot be
    read, is truncated (a write cut short outside :func:`atomic_write_json`, a damaged
    disk) or holds no JSON object: the caller fits again."""
    try:
        meta = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CacheError(f"saved curvature metadata {path} cannot be read ({e})") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("layers"), list) or "kind" not in meta:
        raise CacheError(f"saved curvature metadata {path} is not a curvature's description")
    return meta


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class HostTensorFiles(MutableMapping):
    """The tensors of saved safetensors files, read from their files when asked for: a
    loaded curvature that stays on disk until used. Each ``self[key]`` reads that tensor
    into host memory of its own by plain file reads (nothing is kept here), so a curvature
    used layer by layer holds about one layer at a time, not the whole file (1.5 GB for the
    embedded model's EK-FAC at 1,000 records; docs/performance.md). Reading,
    not mapping: a mapping's pages, once read, stay resident until the mapping is gone.

    The files are opened (and their headers and sizes checked) here and held open until
    every file-backed key is deleted or :meth:`close`: a cache entry evicted, or replaced
    by an atomic rename, while a run uses it is still read whole from the file it opened.
    Keys keep the files' order (``load_file``'s); a key set here holds its tensor in memory,
    and a file with a dtype not listed in ``_SAFETENSORS_DTYPES`` is read whole by
    ``load_file``."""

    def __init__(self, paths):
        self._files: list = []
        self._where: dict = {}  # key -> (file index, dtype, shape, offset, bytes)
        self._held: dict = {}  # keys set in memory
        self._lock = threading.Lock()
        try:
            for path in paths:
                try:
                    with safe_open(str(path), "pt") as so:  # the header only: no tensor is read
                        keys = list(so.keys())
                except SafetensorError as exc:
                    raise CacheError(f"saved curvature file {path} is truncated or damaged ({exc})") from exc
                f = open(path, "rb")
                self._files.append(f)
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n))
                if any(header[k]["dtype"] not in _SAFETENSORS_DTYPES for k in keys):
                    self._held.update(load_file(str(path)))
                    continue
                size = os.fstat(f.fileno()).st_size
                for k in keys:
                    h = header[k]
                    b, e = h["data_offsets"]
                    dtype = _SAFETENSORS_DTYPES[h["dtype"]]
                    count = math.prod(h["shape"]) * torch.empty((), dtype=dtype).element_size()
                    if count != e - b or 8 + n + e > size:
                        raise CacheError(f"saved curvature file {path} is truncated or damaged at tensor {k!r}")
                    self._where[k] = (len(self._files) - 1, dtype, h["shape"], 8 + n + b, e - b)
        except BaseException:
            self.close()
            raise

    def __getitem__(self, key):
        if key in self._held:
            return self._held[key]
        i, dtype, shape, offset, count = self._where[key]
        t = torch.empty(shape, dtype=dtype)
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        with self._lock:
            f = self._files[i]
            f.seek(offset)
            got = f.readinto(view)
        if got != count:
            raise CacheError(f"saved curvature file {f.name} is truncated or damaged at tensor {key!r}")
        return t

    def __setitem__(self, key, value):
        self._where.pop(key, None)
        self._held[key] = value

    def __delitem__(self, key):
        if key in self._held:
            del self._held[key]
        else:
            del self._where[key]
            if not self._where:
                self.close()

    def __contains__(self, key):
        return key in self._where or key in self._held

    def __iter__(self):
        yield from list(self._where)
        yield from list(self._held)

    def __len__(self):
        return len(self._where) + len(self._held)

    def host_bytes(self, key) -> int:
        """Bytes of host memory that ``self[key]`` takes: a read for a key on disk, the
        held tensor's storage otherwise (without reading anything)."""
        if key in self._where:
            return self._where[key][4]
        return _host_bytes(self._held, key)

    def close(self):
        """Close the files; the keys on disk can no longer be read."""
        for f in self._files:
            f.close()

    def __del__(self):
        self.close()


def _host_bytes(tensors, key) -> int:
    """Bytes of host memory that ``tensors[key]`` takes or, for a key of a
    :class:`HostTensorFiles` still on disk, that reading it takes."""
    if isinstance(tensors, HostTensorFiles):
        return tensors.host_bytes(key)
    t = tensors[key]
    return t.untyped_storage().nbytes() if t.device.type == "cpu" else 0


def kfac_matched(lam: torch.Tensor, kfac: torch.Tensor) -> torch.Tensor:
    """The K-FAC eigenvalues ``kfac`` rescaled to the sum of the EK-FAC ones ``lam`` (both
    grids of one layer): the shrinkage target. The rescaling leaves the mean eigenvalue,
    and so the heuristic damping, unchanged; with that damping, ``rho = 1`` ranks as K-FAC."""
    total = kfac.sum(dtype=torch.float64)
    if not total > 0:
        return kfac
    return kfac * float(lam.sum(dtype=torch.float64) / total)


def shrinkage_weight(lam: torch.Tensor, kfac: torch.Tensor, variance: float) -> float:
    """Ledoit-Wolf weight of the K-FAC target for one layer's EK-FAC eigenvalues ``lam``:
    ``min(1, variance / ||lam - kfac_matched(lam, kfac)||^2)`` (sums over the grid), the
    weight that minimises the expected squared error of the shrunk eigenvalues when
    ``variance`` is the summed sampling variance of ``lam`` (Ledoit & Wolf 2003). A
    target equal to ``lam`` gives 0."""
    diff = lam - kfac_matched(lam, kfac)
    dist = float(torch.sum(diff * diff, dtype=torch.float64))
    if not (variance > 0 and dist > 0):
        return 0.0
    return min(1.0, variance / dist)


def _host_tensors(tensors: dict) -> dict:
    """``tensors`` on the host, contiguous, each with its own storage (safetensors refuses
    shared storage, e.g. layers reading one input that share a factor in memory). A host
    tensor that owns its storage is taken as it is: copying a curvature to save it would
    double its host memory (1.6 GB for the embedded model's EK-FAC)."""
    out, seen = {}, set()
    for k, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[k] = t
    return out


def _shrinkage(settings: PreconditionSettings, cur: Curvature, name: str) -> float:
    """Layer ``name``'s shrinkage weight ``rho`` (:class:`PreconditionSettings`)."""
    if settings.shrinkage == "off":
        return 0.0
    if settings.shrinkage != "auto":
        return float(settings.shrinkage)
    t = cur.tensors
    kfac = t[f"{name}::lamS"][:, None] * t[f"{name}::lamA"][None, :]
    return shrinkage_weight(t[f"{name}::Lambda"], kfac, float(t[f"{name}::LambdaVar"]))


def _damping(settings: PreconditionSettings, eig: torch.Tensor, noise: torch.Tensor | None = None) -> float:
    """Explicit, else ``damping_factor`` x the mean eigenvalue, plus (``damping_noise``,
    EK-FAC: ``noise`` is the layer's ``LambdaVar``) the root-mean-square standard error of
    the eigenvalues, ``sqrt(LambdaVar / eig.numel())``."""
    if settings.damping is not None:
        return float(settings.damping)
    lam = settings.damping_factor * float(eig.double().mean())
    if settings.damping_noise and noise is not None:
        lam += math.sqrt(float(noise) / eig.numel())
    # A layer with all-zero curvature (e.g. unused) still needs an invertible H.
    return lam if lam > 0 else 1e-12


def apply_damping(cur: Curvature, settings: PreconditionSettings) -> Curvature:
    """Set each layer's shrinkage weight (EK-FAC) and then its damping from ``settings``
    (explicit, or the heuristic on the layer's eigenvalues, which the shrinkage leaves at
    the same mean, plus their noise under ``damping_noise``). A curvature saved without
    the statistics of either raises :class:`CacheError` when ``settings`` asks for one."""
    if cur.kind == "identity" or not cur.tensors:
        return cur
    if cur.kind == "ekfac":
        wanted = settings.shrinkage != "off" or settings.damping_noise
        if wanted and any(f"{n}::LambdaVar" not in cur.tensors for n in cur.layers):
            raise CacheError("the saved EK-FAC curvature predates the statistics of the shrinkage and the noise "
                             "damping (lamA, lamS, LambdaVar)")
        cur.shrinkage = {n: _shrinkage(settings, cur, n) for n in cur.layers}
    cur.damping = {n: _damping(settings, cur.eigenvalues(n), cur.tensors.get(f"{n}::LambdaVar"))
                   for n in cur.layers}
    return cur

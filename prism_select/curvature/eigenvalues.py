"""EK-FAC's eigenvalue pass: each layer's per-example gradient rotated into the K-FAC
eigenbasis, R_n = Q_S^T G_n Q_A, its squares summed into Lambda and its fourth
powers into LambdaVar (the sampling variance that sets the shrinkage and the noise
damping)."""

from __future__ import annotations

import torch

from ..engine import Tap, mm_acc
from ..gradients import check_finite, release_host_memory
from ..runtime import distributed
from ..runtime.layers import has_bias, layer_shape
from .factors import _key, _with_ones


def _rotate(x: torch.Tensor, Q: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """``x @ Q`` in ``x``'s dtype. Half precision: one tensor-core matmul (float32
    accumulation, rounded once to half), no float32 intermediate to write and cast."""
    if x.dtype == acc or x.dtype != Q.dtype:
        return mm_acc(x, Q, acc).to(x.dtype)
    return x @ Q


#: the CPU eigenvalue pass forms each example's ``out x in'`` product this many rows at a
#: time (a product of at most twice as many rows at once): a block that stays in a core's
#: cache between its GEMM, its square and its sums. With FitScores' kept products the
#: demo's 1536 x 576 and 576 x 1536 products took 18% less time so, the 576 x 576 ones 9%
#: (a 2-core Xeon, 2 MB of L2 a core; 256 rows: 10% less, 3% more, 6% less); the demo's
#: per-example products and sums, 9.9 CPU-s, 8.5-8.8. ``Lambda`` and the products are the same
#: bits; ``M4`` adds the blocks' sums (another float order).
LAMBDA_BLOCK_ROWS = 128


class _LambdaTap(Tap):
    """Pass 2 (EK-FAC): ``Lambda += sum_n (Q_S^T G_n Q_A)**2`` (padding has ``b = 0``),
    ``M4 += sum_n sum_ij (Q_S^T G_n Q_A)_ij**4`` (a one-element tensor)."""

    keep_input = True

    def __init__(self, module, stats, QA, QS, qa_group):
        super().__init__(module)
        self.stats, self.bias = stats, has_bias(module)
        self.Lam = self.M4 = None  # the sums, set by the fit (zeros of out x in', and of one element)
        self.dtype = dt = module.weight.dtype  # the eigenbases' dtype in the pass
        # None: another rank owns the layer (sharded factors, _ShardedLambdaTap)
        self.QA = None if QA is None else QA.to(dt)
        self.QS = None if QS is None else QS.to(dt)
        self.qa_id = qa_group
        self.rows = None  # the next batch's kept products (_spilled_groups with FitScores), else None

    def on_backward(self, x, g):
        st = self.stats
        k = _key(x, self.bias, self.qa_id)
        aq = st.cache.get(k, (None, None))[1]
        if aq is None:
            xa = _with_ones(x) if self.bias else x
            aq = _rotate(xa, self.QA, st.acc)
            st.cache[k] = (x.detach(), aq)
        keep, self.rows = self.rows, None
        self.add(aq, _rotate(g, self.QS, st.acc), keep=keep)

    def add(self, aq: torch.Tensor, bq: torch.Tensor, Lam=None, M4=None, keep=None):
        """Add the examples of rotated inputs ``aq`` (``B x T x in'``) and output gradients
        ``bq`` (``B x T x out``) to ``Lambda`` and ``M4`` (or to the given ``Lam``, ``M4``).
        ``keep`` (the CPU, the accumulation dtype; :class:`FitScores`): one ``out x in'``
        tensor per example, into which its product ``R_n`` is written before it is squared."""
        st = self.stats
        Lam = self.Lam if Lam is None else Lam
        M4 = self.M4 if M4 is None else M4
        if bq.device.type == "cpu" and bq.dtype == st.acc:
            # example by example into one reused buffer: a (B, out, in) product, squared
            # into a second one, cost three times the GEMMs on the CPU (memory traffic
            # and page faults); each product in blocks of rows that stay in the core's
            # cache while they are squared and summed (LAMBDA_BLOCK_ROWS)
            out, inp = bq.shape[-1], aq.shape[-1]
            rows = out if out <= 2 * LAMBDA_BLOCK_ROWS else LAMBDA_BLOCK_ROWS
            R = st.scratch(rows * inp)
            for n in range(bq.shape[0]):
                bT = bq[n].T
                for r in range(0, out, rows):
                    e = min(r + rows, out)
                    Rb = R[:(e - r) * inp].view(e - r, inp)
                    if keep is None:
                        torch.mm(bT[r:e], aq[n], out=Rb)
                        Rb.square_()
                    else:
                        torch.mm(bT[r:e], aq[n], out=keep[n][r:e])
                        torch.square(keep[n][r:e], out=Rb)
                    Lam[r:e].add_(Rb)
                    flat = Rb.view(-1)
                    M4 += torch.dot(flat, flat)
            return
        if keep is not None:
            raise ValueError("the kept products are formed on the CPU in the accumulation dtype only")
        if bq.dtype == st.acc:
            rot = bq.transpose(1, 2) @ aq
            sq = rot * rot
            Lam += sq.sum(0)
        else:  # half precision: bf16 products (float32 accumulate), squares summed in float32
            sq = torch.bmm(bq.transpose(1, 2), aq).square_()
            Lam += sq.sum(0, dtype=st.acc)
        flat = sq.reshape(-1)
        M4 += torch.dot(flat, flat).to(st.acc)  # no copy of the batch's squares


#: the CPU's EK-FAC eigenvalue pass (not from a spill, the empirical Fisher, one process)
#: runs each fit batch in steps whose linear layers' inputs and outputs take at most about
#: this many bytes (:func:`_lambda_steps`; at least one example a step). The pass holds
#: the whole curvature (the float32 eigenbases and the eigenvalue sums: 1.6 GB for the
#: embedded model) next to one step's activations, about those inputs and outputs
#: (1.15 MB a token for the embedded model; autograd keeps about 0.7 GiB for a batch of 8
#: demo records, docs/performance.md); the per-example products, and so the sums, do not
#: depend on the steps.
LAMBDA_STEP_MAX_BYTES = 128 << 20


def _lambda_steps(modules: dict, encoded: list, batches: list, fisher: str, device, owners) -> list:
    """The eigenvalue pass's steps: ``batches`` themselves, or on the CPU (the empirical
    Fisher, one process, unsharded factors) each batch cut into consecutive runs of
    examples whose padded tokens' tracked-layer inputs and outputs take at most
    LAMBDA_STEP_MAX_BYTES (estimated at the model's dtype). The sampled Fisher keeps the
    batches: its labels are drawn batch by batch, the same draws as the factor pass's."""
    if (fisher != "empirical" or owners is not None or distributed.world() > 1
            or torch.device(device or "cpu").type != "cpu" or not modules):
        return batches
    per_token = sum(sum(layer_shape(m)) * m.weight.element_size() for m in modules.values())
    steps = []
    for b in batches:
        length = max(len(encoded[i].input_ids) for i in b)
        k = max(1, LAMBDA_STEP_MAX_BYTES // (per_token * length))
        steps += [b[j:j + k] for j in range(0, len(b), k)]
    return steps


def _finish_lambda(tensors: dict, Lam: dict, M4: dict, own: list, n_examples: int) -> None:
    """``Lambda`` and ``LambdaVar`` of each layer into ``tensors`` from the eigenvalue
    pass's sums (which are consumed)."""
    release_host_memory()
    for n in own:  # in place: no second copy of every layer's eigenvalues
        lam, var = _lambda_from_sums(Lam.pop(n), M4.pop(n), n_examples, in_place=True)
        check_finite(lam, "the EK-FAC eigenvalues", layer=n)
        tensors[f"{n}::Lambda"], tensors[f"{n}::LambdaVar"] = lam, var
    release_host_memory()  # the pass's batches


def _lambda_from_sums(lam_sum: torch.Tensor, m4_sum: torch.Tensor, n_examples: int, *, in_place: bool):
    """``(Lambda, LambdaVar)`` of a layer from the eigenvalue pass's sums over
    ``n_examples`` (``in_place``: ``Lambda`` is the divided ``lam_sum`` itself)."""
    lam = lam_sum.div_(n_examples) if in_place else lam_sum / n_examples
    return lam, _lambda_variance(m4_sum / n_examples, lam, n_examples)


def _lambda_variance(m4: torch.Tensor, lam: torch.Tensor, n: int) -> torch.Tensor:
    """The sampling variance of ``Lambda`` (a mean over ``n`` examples), summed over its
    entries, from ``m4 = (1/n) sum_n sum_ij R_nij**4``: the unbiased variance of the
    squares over the examples, divided by ``n``. One example gives nothing to estimate it
    from: then ``sum_ij Lambda_ij**2`` (a standard error as large as the estimate). A
    one-element tensor."""
    second = torch.sum(lam * lam, dtype=torch.float64)
    if n < 2:
        return second.reshape(1).to(m4.dtype)
    return ((m4.double() - second) / (n - 1)).clamp(min=0).to(m4.dtype)

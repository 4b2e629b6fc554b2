"""The engine's fused, chunked response loss (:func:`prism_select.engine.batch_losses`
with the decoder / head split) against the model's own logits and cross-entropy, in
float64: per-example losses and the gradients of a weighted sum of them, with the
tokens cut into chunks of every size from one token to the whole batch."""

import pytest
import torch

from prism_select.data.tokenize import collate, encode, token_losses
from prism_select.engine import batch_losses, split_causal_lm
from prism_select.engine import loss as lossmod

#: float64, the same products summed in other groupings
FUSED_TOL = 1e-10


@pytest.mark.parametrize("chunk", [1, 3, 10 ** 6])
def test_fused_loss_equals_plain_cross_entropy(tok, model, pool_examples, monkeypatch, chunk):
    monkeypatch.setattr(lossmod, "_ce_chunk_tokens", lambda vocab, device_type="cuda": chunk)
    b = collate([encode(tok, p, r) for p, r in pool_examples[:4]], tok.pad_token_id)
    w = torch.tensor([0.3, -1.2, 0.7, 2.0], dtype=torch.float64)
    # every parameter but the head's (the fused loss forms no head gradient: it is used
    # only where the head is not a tracked layer, prism_select.engine.cpu_response_split)
    head = model.get_output_embeddings().weight
    params = [p for p in model.parameters() if p.requires_grad and p is not head]

    def run(fused):
        model.zero_grad()
        if fused:
            total, count = batch_losses(model, b, split=split_causal_lm(model))
        else:
            out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], use_cache=False)
            total, count = token_losses(out.logits, b["labels"])
        (w * total).sum().backward()
        return total.detach(), count, [p.grad.clone() for p in params]

    ref, n_ref, g_ref = run(False)
    got, n_got, g_got = run(True)
    assert torch.equal(n_got, n_ref)
    assert torch.allclose(got, ref, rtol=FUSED_TOL, atol=0)
    for a, r in zip(g_got, g_ref):
        assert torch.allclose(a, r, rtol=FUSED_TOL, atol=FUSED_TOL * r.abs().max())


def test_cpu_chunks_are_smaller_than_accelerator_chunks():
    """On the CPU the chunk's logits are resident memory: a quarter of an accelerator's
    chunk (the embedded model's vocabulary of 49,152: 341 tokens, 64 MiB of float32)."""
    assert lossmod._ce_chunk_tokens(49152, "cpu") == 341
    assert lossmod._ce_chunk_tokens(49152, "cuda") == 1365
    assert lossmod._ce_chunk_tokens(10 ** 7, "cpu") == 256  # at least 256 tokens

"""LESS (Xia et al. 2024; princeton-nlp/LESS): Adam-preconditioned LoRA gradient
similarity to the target examples, summed over warm-up checkpoints.

1. **Warm-up.** LoRA training (:func:`prism_select.finetune`) on a seeded
   random ``warmup_fraction`` (5%) of the pool: r 128, alpha 512, dropout 0.1 on
   q/k/v/o, lr 2e-5, 4 epochs, linear decay, warm-up ratio 0.03 (``transformers``'
   schedule: ``ceil(0.03 x steps)`` steps rising from lr 0, the first at 0); a
   checkpoint (adapter + Adam state as safetensors) at the end of each epoch. LESS's
   own warm-up (5% of 270,679 records, batch 1 x accumulation 128) takes
   :data:`LESS_WARMUP_STEPS` (424) optimizer steps; here the **steps** are kept at any
   pool size and the accumulation is scaled down to reach them (``grad_accum`` None;
   at most 128, at least 1), so the checkpoints sample the same schedule: on a
   600-record pool a 5% sample would give 4 steps at accumulation 128 (the first at
   lr 0, the first checkpoint of weight 0, the adapters all but at their
   initialisation). A sample too small for 424 steps even at accumulation 1 takes
   ``warmup_floor`` (:func:`warmup_plan`): ``examples`` (default) grows the sample to
   the fewest records that give the steps (106 at 4 epochs, at most the whole pool),
   keeping LESS's steps, schedule and 4 passes (what shapes the adapters and the Adam
   moments the scores read) at the price of a larger share of the pool;
   ``batch1`` keeps the 5% sample at accumulation 1 and fewer steps. A warm-up of fewer
   than :data:`MIN_WARMUP_STEPS` steps is warned of (logged, and in run.json's
   ``warnings`` and ``method_info.warnings``). ``method_info.warmup`` records the
   planned and the run steps, the effective batch, the floor applied, every step's
   learning rate (per epoch, ``epoch_lrs``), the steps at lr 0 and the training loss of
   each step (``losses``).
   The run is cached under ``<cache_dir>/less/<key>/`` (``cache_dir`` = the model
   settings' cache, ``$PRISM_SELECT_CACHE`` or ``~/.cache/prism-select``), ``key`` =
   sha256 over the model fingerprint, the tokenised pool's fingerprint, the warm-up
   fraction, the sample's size, the seed and every training setting (the resolved
   accumulation included); it is reused only when the key matches
   (``ctx.info["method"]["warmup"]["reused"]``). Option ``checkpoints``: use
   these existing checkpoint directories instead (each an adapter directory with
   ``optimizer.safetensors``, see :mod:`prism_select.finetune`).
   The candidates' projected gradients at each cached checkpoint are kept beside it
   (``<checkpoint>/features/<key>.safetensors``, :func:`candidate_features_key`), so a
   second target set on the same pool (another target task) computes only its targets'
   side (``ctx.info["method"]["candidate_features"]``).
2. **Gradients** over the LoRA matrices only, with the checkpoint's adapter loaded on
   the run's base model (eval mode: dropout off), of the **mean** response-token loss
   of one example (batch-size-1 semantics; computed in batches through per-example
   activation/output-gradient hooks, which is exact for right-padded batches).
   Candidate side: ``Gamma = m' / sqrt(v' + 1e-8)``, ``m' = 0.9 m + 0.1 g``,
   ``v' = 0.999 v + 0.001 g^2`` with ``m, v`` Adam's moments stored with the
   checkpoint (LESS's ``prepare_optimizer_state`` / ``obtain_gradients_with_adam``).
   Target side: plain gradients ``g``; option ``target_side``: ``chosen`` (default,
   the target-positive responses ``(q, y+)`` as LESS's target examples), ``rejected``,
   or ``contrast`` (``g(q, y+) - g(q, y-)``).
3. **Projection** to ``proj_dim`` (8192) dimensions, then L2 normalisation of every
   projected vector. Option ``projection``: ``rademacher`` (LESS's own: a dense +-1
   matrix, as TRAK's CUDA projector), ``sjlt`` (a sparse Johnson-Lindenstrauss
   projection) or ``auto`` (default): ``rademacher`` on CUDA, ``sjlt`` on any other
   device (CPU, MPS), where the dense one is infeasible (below). The choice and its
   reason are logged and recorded (``ctx.info["method"]["projection"]``,
   ``["projection_reason"]``). Neither matrix is ever stored: parameter ``key`` (its name
   in ``adapter_model.safetensors``) is flattened row-major and cut into tiles of
   :data:`TILE_ROWS` entries, and tile ``i`` of ``key`` is generated from a
   ``torch.Generator`` seeded with sha256 of ``"{proj_seed}|{key}|{i}"`` (``rademacher``)
   or ``"{proj_seed}|{key}|{i}|sjlt"`` (first 8 bytes, 63 bits) when needed and dropped
   after use. The matrix thus depends only on ``(proj_seed, key, proj_dim)`` (and, for
   ``rademacher``, the device type) -- not on batching or chunking -- so every
   checkpoint, candidates and targets, uses the same projection.

   * ``rademacher``: tile ``i`` is a ``TILE_ROWS x proj_dim`` (fewer rows for the last
     tile) +-1 matrix drawn by ``bernoulli_(0.5)`` on the compute device (CPU and CUDA
     generators give different, equally valid matrices), multiplied in. The whole
     matrix (``n_lora_params x proj_dim`` draws) is generated once per chunk of
     ``proj_chunk`` examples, so larger chunks amortise it, at ``proj_chunk x
     n_lora_params`` floats of gradient memory (bounded by :func:`chunk_bytes`:
     :data:`GRAD_CHUNK_BYTES`, on a GPU a quarter of what the process can still
     allocate there, within its ``max_gpu_memory`` cap).
     For the default adapter of the embedded 135M model (14.7M parameters) that is
     3,600 tiles of 4096 x 8192 per chunk: about 2 hours per chunk of 18 examples on a
     2-core CPU.
   * ``sjlt``: every coordinate is sent to :data:`SJLT_NNZ` (4) of the ``proj_dim``
     outputs with random signs, scaled ``1/sqrt(SJLT_NNZ)`` (so ``E[P P^T] = I``); tile
     ``i`` is ``SJLT_NNZ x rows`` draws of ``randint(0, 2 proj_dim)`` from a CPU
     generator (bucket = draw // 2, sign from its low bit: the same matrix on every
     device), applied by ``index_add_`` over the buckets. Cost: ``SJLT_NNZ x
     n_lora_params`` draws per chunk and as many additions per example, no dense
     matrix; regeneration is cheap, so chunks are small (:data:`SJLT_CHUNK_BYTES`: 4
     examples of the default adapter).

   Neither is scaled by ``1/sqrt(proj_dim)``: cosines ignore it.
4. **Score.** ``s(z) = sum_ckpt w_ckpt cos(Gamma_z, g_q)``, ``w`` = the mean learning
   rate of each checkpoint's epoch (``checkpoint.json``'s ``mean_lr``; option
   ``checkpoint_weights`` overrides; equal weights when neither is known or all are 0;
   a checkpoint of weight 0 is not computed, ``skipped_checkpoints`` in the info),
   normalised to sum 1; then per task (``TargetPair.task``; one task when ``None``) the
   **mean** over the task's targets, and the **max** over tasks (LESS's ``matching.py``).

Per-checkpoint projected features are kept in the run's ``.partial/less/`` (with their
projection in the file's metadata) so an interrupted run resumes after the last finished
checkpoint; features of another projection (``auto`` resumed on another device) are
computed again.
"""


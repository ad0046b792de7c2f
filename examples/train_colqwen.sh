#!/usr/bin/env bash
# Qwen2-VL as a ColQwen (late interaction on images: a 128-d vector per token and image patch,
# scored by MaxSim): the flags of ms-swift's GME script (examples/train_gme.sh: LoRA, ZeRO-3,
# bfloat16, the same rows with <image> tags) with --task_type late_interaction. Queries get
# ColQwen2's 10 augmentation tokens (the pad token), documents keep every token.
#
#   MODEL=/models/Qwen2-VL-2B-Instruct DATA=train.jsonl NPROC_PER_NODE=8 bash examples/train_colqwen.sh
#
# MODEL (required), DATA (default: the bundled image rows), NPROC_PER_NODE (default 1), DEEPSPEED
# (default zero3; empty: none), TORCH_DTYPE (default bfloat16), MAX_PIXELS; extra flags are
# appended and win. Then `mmembed export --adapters output/checkpoint-N` writes, beside the merged
# model, colqwen2/: a transformers ColQwen2ForRetrieval folder.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a local Qwen2-VL / Qwen2.5-VL folder}
DATA=${DATA:-$(dirname "$0")/data/mm/gme_train.jsonl}
nproc_per_node=${NPROC_PER_NODE:-1}
DEEPSPEED=${DEEPSPEED-zero3}

MAX_PIXELS=${MAX_PIXELS:-1003520} \
NPROC_PER_NODE=$nproc_per_node \
mmembed sft \
    --model "$MODEL" \
    --task_type late_interaction \
    --loss_type infonce \
    --late_interaction_dim 128 \
    --late_interaction_query_expansion augment \
    --late_interaction_query_length 10 \
    --tuner_type lora \
    --dataset "$DATA" \
    --load_from_cache_file true \
    --split_dataset_ratio 0.01 \
    --torch_dtype "${TORCH_DTYPE:-bfloat16}" \
    --num_train_epochs 1 \
    --per_device_train_batch_size 2 \
    --per_device_eval_batch_size 2 \
    --gradient_accumulation_steps $(( (64 + nproc_per_node - 1) / nproc_per_node )) \
    --eval_steps 100 \
    --save_steps 100 \
    --eval_strategy steps \
    --save_total_limit 2 \
    --logging_steps 5 \
    --output_dir "${OUTPUT_DIR:-output}" \
    --warmup_ratio 0.05 \
    --learning_rate 5e-5 \
    ${DEEPSPEED:+--deepspeed "$DEEPSPEED"} \
    --dataloader_num_workers 4 \
    --dataloader_drop_last true \
    "$@"

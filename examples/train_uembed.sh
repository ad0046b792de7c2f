#!/usr/bin/env bash
# UEmbed (iic/UEmbed-2B, Qwen3.5) LoRA training as ms-swift 4.6 trains it (`swift sft --model_type
# qwen3_5_emb`), with `swift sft` -> `mmembed sft` and the hub id -> a local folder. Rows are
# ms-swift's messages form, text and pictures (examples/data/mm/qwen3_vl_train.jsonl).
#
#   MODEL=/models/UEmbed-2B DATA=train.jsonl NPROC_PER_NODE=2 bash examples/train_uembed.sh
#
# MODEL (required), DATA, NPROC_PER_NODE (default 1), DEEPSPEED (default zero2; empty: none),
# TORCH_DTYPE (default bfloat16), ATTN_IMPL (default flash_attn on a GPU, sdpa on the CPU);
# extra flags are appended and win. The folder's sparse_info.json (num_eos_tokens) sets the
# trailing <|endoftext|> and the pooled position, and is carried into every checkpoint. No
# --padding_free / --packing: its linear-attention layers train on padded batches.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a local UEmbed folder}
DATA=${DATA:-$(dirname "$0")/data/mm/qwen3_vl_train.jsonl}
DEEPSPEED=${DEEPSPEED-zero2}
if [ -z "${ATTN_IMPL:-}" ]; then
    ATTN_IMPL=$(python -c "import torch; print('flash_attn' if torch.cuda.is_available() else 'sdpa')")
fi

INFONCE_TEMPERATURE=${INFONCE_TEMPERATURE:-0.1} \
NPROC_PER_NODE=${NPROC_PER_NODE:-1} \
mmembed sft \
    --model "$MODEL" \
    --model_type qwen3_5_emb \
    --task_type embedding \
    --tuner_type lora \
    --lora_rank 8 \
    --lora_alpha 32 \
    --learning_rate 5e-5 \
    --target_modules all-linear \
    --dataset "$DATA" \
    --attn_impl "$ATTN_IMPL" \
    --torch_dtype "${TORCH_DTYPE:-bfloat16}" \
    --load_from_cache_file true \
    --split_dataset_ratio 0.02 \
    --eval_strategy steps \
    --output_dir "${OUTPUT_DIR:-output}" \
    --save_steps 50 \
    --eval_steps 50 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --num_train_epochs 1 \
    --max_length 8192 \
    --per_device_train_batch_size 8 \
    --per_device_eval_batch_size 8 \
    --gradient_accumulation_steps 1 \
    --dataloader_num_workers 4 \
    --dataset_num_proc 4 \
    --warmup_ratio 0.05 \
    --loss_type infonce \
    --dataloader_drop_last true \
    ${DEEPSPEED:+--deepspeed "$DEEPSPEED"} \
    "$@"

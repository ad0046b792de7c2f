#!/usr/bin/env bash
# Qwen3-Embedding LoRA training on STS-B positive pairs: ms-swift's
# examples/train/embedding/qwen3/qwen3_emb.sh with `swift sft` -> `mmembed sft` and the hub
# ids (model and dataset) -> local paths. gte-modernbert and gte-Qwen2 run the same way
# (MODEL_TYPE=modern_bert_gte or qwen2_gte).
#
#   MODEL=/models/Qwen3-Embedding-4B NPROC_PER_NODE=2 bash examples/qwen3_emb.sh
#
# MODEL (required), DATA, MODEL_TYPE (default: from the model's config), NPROC_PER_NODE
# (default 1), DEEPSPEED (default zero2; empty: none), TORCH_DTYPE (default bfloat16),
# ATTN_IMPL (default flash_attn on a GPU, sdpa on the CPU); extra flags are appended and win.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a local Qwen3-Embedding folder}
DATA=${DATA:-$(dirname "$0")/data/stsb_train_pairs.jsonl}
DEEPSPEED=${DEEPSPEED-zero2}
if [ -z "${ATTN_IMPL:-}" ]; then
    ATTN_IMPL=$(python -c "import torch; print('flash_attn' if torch.cuda.is_available() else 'sdpa')")
fi

INFONCE_TEMPERATURE=${INFONCE_TEMPERATURE:-0.1} \
NPROC_PER_NODE=${NPROC_PER_NODE:-1} \
mmembed sft \
    --model "$MODEL" \
    ${MODEL_TYPE:+--model_type "$MODEL_TYPE"} \
    --task_type embedding \
    --tuner_type lora \
    --lora_rank 8 \
    --lora_alpha 32 \
    --learning_rate 5e-5 \
    --target_modules all-linear \
    --dataset "$DATA" \
    --attn_impl "$ATTN_IMPL" \
    --padding_free true \
    --torch_dtype "${TORCH_DTYPE:-bfloat16}" \
    --load_from_cache_file true \
    --split_dataset_ratio 0.02 \
    --eval_strategy steps \
    --output_dir "${OUTPUT_DIR:-output}" \
    --save_steps 50 \
    --eval_steps 50 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --num_train_epochs 5 \
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

#!/usr/bin/env bash
# GME (gme-Qwen2-VL) LoRA embedding training: ms-swift's examples/train/embedding/train_gme.sh
# with `swift sft` -> `mmembed sft` and the hub id -> a local folder. Rows are ms-swift's
# query form with <image>/<video> tags (examples/data/mm/gme_train.jsonl).
#
#   MODEL=/models/gme-Qwen2-VL-2B-Instruct DATA=train.jsonl NPROC_PER_NODE=8 bash examples/train_gme.sh
#
# MODEL (required), DATA, NPROC_PER_NODE (default 1), DEEPSPEED (default zero3; empty: none),
# TORCH_DTYPE (default bfloat16), MAX_PIXELS; extra flags are appended and win.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a local gme-Qwen2-VL folder}
DATA=${DATA:-$(dirname "$0")/data/mm/gme_train.jsonl}
nproc_per_node=${NPROC_PER_NODE:-1}
DEEPSPEED=${DEEPSPEED-zero3}

MAX_PIXELS=${MAX_PIXELS:-1003520} \
NPROC_PER_NODE=$nproc_per_node \
mmembed sft \
    --model "$MODEL" \
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
    --lazy_tokenize true \
    --warmup_ratio 0.05 \
    --learning_rate 5e-5 \
    ${DEEPSPEED:+--deepspeed "$DEEPSPEED"} \
    --dataloader_num_workers 4 \
    --task_type embedding \
    --loss_type infonce \
    --dataloader_drop_last true \
    "$@"

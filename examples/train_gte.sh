#!/usr/bin/env bash
# gte-Qwen2 LoRA training with the cosine-similarity loss on scored STS-B pairs. ms-swift
# 4.6 no longer ships a gte script (its examples/train/embedding/ holds train_gme.sh and
# qwen3/); this one takes train_gme.sh's flags with `--loss_type cosine_similarity` and
# rows carrying a 0..1 "label". gte-modernbert runs the same way.
#
#   MODEL=/models/gte_Qwen2-7B-instruct NPROC_PER_NODE=8 bash examples/train_gte.sh
#
# MODEL (required), DATA (rows with a 0..1 "label"), NPROC_PER_NODE (default 1), DEEPSPEED
# (default zero3; empty: none), TORCH_DTYPE (default bfloat16); extra flags are appended and win.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a local gte_Qwen2 folder}
DATA=${DATA:-$(dirname "$0")/data/stsb_train_scored.jsonl}
nproc_per_node=${NPROC_PER_NODE:-1}
DEEPSPEED=${DEEPSPEED-zero3}

NPROC_PER_NODE=$nproc_per_node \
mmembed sft \
    --model "$MODEL" \
    --train_type lora \
    --dataset "$DATA" \
    --torch_dtype "${TORCH_DTYPE:-bfloat16}" \
    --num_train_epochs 10 \
    --per_device_train_batch_size 2 \
    --per_device_eval_batch_size 1 \
    --gradient_accumulation_steps $(( (64 + nproc_per_node - 1) / nproc_per_node )) \
    --eval_steps 100 \
    --save_steps 100 \
    --eval_strategy steps \
    --use_chat_template false \
    --save_total_limit 5 \
    --logging_steps 5 \
    --output_dir "${OUTPUT_DIR:-output}" \
    --warmup_ratio 0.05 \
    --learning_rate 5e-6 \
    ${DEEPSPEED:+--deepspeed "$DEEPSPEED"} \
    --dataloader_num_workers 4 \
    --task_type embedding \
    --loss_type cosine_similarity \
    --dataloader_drop_last true \
    "$@"

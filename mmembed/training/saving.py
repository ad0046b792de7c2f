"""The trainer's side of checkpoints: saving them whole or not at all, and resuming from them.

:class:`CheckpointSaving` is mixed into :class:`~mmembed.training.trainer.EmbeddingTrainer`
before transformers' ``Trainer`` and overrides its saving and loading steps:

- saving (``_save``, ``_save_checkpoint``, :meth:`~CheckpointSaving.save_final_model`): a
  checkpoint holds the backbone (a PEFT adapter for LoRA, safetensors weights for full
  training), the tokenizer / processor, ``mmembed.json`` and the Trainer's state; it is
  written under a staging name, the processes agree that every write succeeded, then it is
  marked and renamed (the protocol of :mod:`mmembed.training.checkpoints`), so
  ``checkpoint-N`` is whole or absent whatever is killed when. A failed write on any process
  raises the same :class:`~mmembed.training.checkpoints.CheckpointWriteError` on all.
- resuming (``_load_from_checkpoint``, ``_load_best_model``): only a whole checkpoint is
  loaded, its weights into the backbone (:func:`~mmembed.model.weights.load_backbone_weights`);
  with ``weights_only_resume`` (``--resume_only_model``) the weights are loaded already and the
  checkpoint gives only the step count and data position: its optimizer, scheduler, scaler,
  RNG and DeepSpeed engine state are not read (:meth:`~CheckpointSaving.guarded_engine_load`).
  Every file a resume reads is loaded with ``torch.load(weights_only=True)``, DeepSpeed's engine
  files included (with exactly the DeepSpeed types they hold allowed): a planted pickle is
  refused in one line naming the file, and runs nothing.

``training_args.bin`` is written without tokens (:func:`args_without_tokens`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..encoding.templates import template_from_config
from ..model.adapters import is_adapter, write_lora_layout
from ..model.embedding import EmbeddingModel, hidden_size
from ..model.io import save_tokenizer
from ..model.model_files import carry_model_files
from ..model.weights import load_backbone_weights
from . import checkpoints, hooks
from .guards import any_process, merged_dicts
from .samplers import STATE_FILE, sampler_state


class CheckpointSaving:
    """Checkpoint saving and resuming for a transformers ``Trainer`` subclass (listed before
    ``Trainer`` among its bases) whose model is an :class:`~mmembed.model.embedding.EmbeddingModel`."""

    mmembed_config: dict[str, Any]  # what mmembed.json in each checkpoint holds (template, pooling, ...)
    last_checkpoint: str | None = None  # the last whole checkpoint of this run (or the one it resumed)
    # --resume_only_model: the weights are loaded already; the checkpoint gives only the step
    # count and data position (its optimizer, scheduler, scaler and RNG state are not read)
    weights_only_resume: bool = False

    # ---- saving ---------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir or self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        model: EmbeddingModel = self.accelerator.unwrap_model(self.model)
        backbone = model.backbone
        full_state = state_dict
        if state_dict is not None:
            prefix = "backbone."
            state_dict = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        backbone.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        model.save_head(output_dir, full_state)  # a head of the model's own, outside the backbone
        template = self.mmembed_config.get("template")
        if template and is_adapter(output_dir):  # the module names ms-swift and PEFT load the adapter with
            write_lora_layout(output_dir, template_from_config(template).adapter_prefix)
        if self.processing_class is not None:
            save_tokenizer(output_dir, self.processing_class)
        # mmembed.json, the tokenizer's suffix, sentence-transformers files, model card: one rule with mmembed export
        self.folder_writer(output_dir, self.mmembed_config, hidden_size(backbone.config), self.state.log_history,
                           final_path=checkpoints.final_folder(output_dir), global_step=self.state.global_step,
                           tokenizer=self.processing_class)
        if template:  # the model folder's files its family keeps (UEmbed's sparse_info.json), its saved architectures
            carry_model_files(template_from_config(template), [self.mmembed_config.get("base_model")], output_dir)
        torch.save(args_without_tokens(self.args), os.path.join(output_dir, "training_args.bin"))

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint (weights, tokenizer, optimizer / scheduler / scaler / RNG
        state, DeepSpeed's engine state, trainer state), written whole or not at all: see
        :mod:`mmembed.training.checkpoints` for the order of writing, marking, renaming and rotating."""
        run_dir = self._get_output_dir(trial=trial)
        final = os.path.join(run_dir, f"checkpoint-{self.state.global_step}")
        publisher = self.args.should_save
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        if publisher:
            hooks.test_point("save:begin")
        self._agreed(lambda: checkpoints.prepare_staging(final) if publisher else None, final)
        staging = checkpoints.staging_folder(final)
        if self.state.best_global_step:
            best = os.path.join(run_dir, f"checkpoint-{self.state.best_global_step}")
            if self.state.best_global_step == self.state.global_step or os.path.isdir(best):
                self.state.best_model_checkpoint = best
        written: dict[str, str] = {}  # what torch.save wrote here, hashed on its way out

        def write() -> None:
            with checkpoints.hashed_torch_saves(staging, written):
                self._write_checkpoint(staging)

        self._agreed(write, final)
        written = merged_dicts(written)  # each process hashed the files it wrote (DeepSpeed: its shards)
        self._agreed(lambda: checkpoints.publish(final, self.state.global_step, written=written) if publisher else None,
                     final)
        self.last_checkpoint = final
        if self.args.push_to_hub:
            self._push_from_checkpoint(final)
        if publisher:
            try:
                checkpoints.rotate(run_dir, self.args.save_total_limit, keep=[final, self.state.best_model_checkpoint])
            except OSError as e:  # the new checkpoint is whole; an old one left behind loses nothing
                logging.getLogger("mmembed").warning("--save_total_limit: could not delete an old checkpoint: %s", e)

    def save_final_model(self, final: str) -> None:
        """``--save_strategy no``: the trained model alone (weights or adapter, tokenizer /
        processor, ``mmembed.json``) as ``final``, written whole or not at all like a checkpoint
        (staged, flushed, marked as the model alone, renamed); it embeds and exports but does
        not resume training. A failed write raises :class:`CheckpointWriteError` naming ``final``."""
        publisher = self.args.should_save
        if publisher:
            hooks.test_point("save:begin")
        self._agreed(lambda: checkpoints.prepare_staging(final) if publisher else None, final)
        staging = checkpoints.staging_folder(final)
        written: dict[str, str] = {}

        def write() -> None:
            with checkpoints.hashed_torch_saves(staging, written):
                self.save_model(staging, _internal_call=True)

        self._agreed(write, final)
        if publisher:
            hooks.test_point("save:model")
        written = merged_dicts(written)
        self._agreed(lambda: checkpoints.publish(final, self.state.global_step, model_only=True, written=written)
                     if publisher else None, final)
        self.last_checkpoint = final
        if self.args.push_to_hub:  # as a checkpoint is pushed (the staging folder never is)
            self._push_from_checkpoint(final)

    def _write_checkpoint(self, staging: str) -> None:
        """Every file of a checkpoint, into ``staging`` (as the Trainer's ``_save_checkpoint``)."""
        from transformers.trainer import TRAINER_STATE_NAME, ExportableState

        self.save_model(staging, _internal_call=True)
        if self.args.should_save:
            hooks.test_point("save:model")
        if not self.args.save_only_model:
            self._save_optimizer_and_scheduler(staging)
            self._save_scaler(staging)
            self._save_rng_state(staging)
        if self.args.should_save:
            for cb in [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]:
                name, cb_state = cb.__class__.__name__, cb.state()
                if isinstance(self.state.stateful_callbacks[name], list):
                    self.state.stateful_callbacks[name].append(cb_state)
                else:
                    self.state.stateful_callbacks[name] = cb_state
            self.state.save_to_json(os.path.join(staging, TRAINER_STATE_NAME))
            position = sampler_state(getattr(self, "training_sampler", None), self.state.global_step)
            if position is not None:  # where the training rows' order stands (resumed exactly from it)
                with open(os.path.join(staging, STATE_FILE), "w", encoding="utf-8") as f:
                    json.dump(position, f, indent=1)

    def _agreed(self, write: Callable[[], Any], final: str) -> None:
        """Run one stage of a checkpoint save on every process, then agree: when it failed
        anywhere, the staging folder goes and every process raises the same one-line error
        (so no process waits for the others in a collective that never comes)."""
        error = None
        try:
            write()
        except Exception as e:  # torch / safetensors wrap OS errors in their own exceptions
            error = e
        if any_process(error is not None, self.args.device):
            if self.args.should_save:
                checkpoints.discard_staging(final)
            last = self.last_checkpoint
            raise checkpoints.save_failure(final, error or RuntimeError("another process failed to write it"),
                                           last) from error

    # ---- resuming -------------------------------------------------------------------
    @contextlib.contextmanager
    def guarded_engine_load(self, resume_from_checkpoint: str | None) -> Iterator[None]:
        """Around ``Trainer.train``: DeepSpeed's engine reads its checkpoint files (model states,
        optimizer shards) with ``torch.load(weights_only=True)`` and exactly the DeepSpeed types
        they hold allowed (:data:`~mmembed.training.checkpoints.DEEPSPEED_GLOBALS`), never with DeepSpeed's own
        ``weights_only=False``: a file needing anything else is refused by name
        (:class:`~mmembed.training.checkpoints.UnsafeCheckpointError`) and runs nothing.
        ``--resume_only_model`` leaves the engine's checkpoint unread: the weights were loaded
        before, and it holds the optimizer state this resume leaves out (an ms-swift or
        weights-only checkpoint has none)."""
        import transformers.trainer as hf_trainer

        skip_engine_load = bool(self.weights_only_resume and resume_from_checkpoint and self.is_deepspeed_enabled)
        load = hf_trainer.deepspeed_load_checkpoint

        def guarded(engine, *args, **kwargs):
            with deepspeed_safe_loads(engine):
                return load(engine, *args, **kwargs)

        hf_trainer.deepspeed_load_checkpoint = (lambda *a, **k: None) if skip_engine_load else guarded
        try:
            yield
        finally:
            hf_trainer.deepspeed_load_checkpoint = load

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        if not self.weights_only_resume:
            with refused_files_named():
                super()._load_optimizer_and_scheduler(checkpoint)

    def _load_scaler(self, checkpoint) -> None:
        if not self.weights_only_resume:
            with refused_files_named():
                super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint) -> None:
        if not self.weights_only_resume:
            with refused_files_named():
                super()._load_rng_state(checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self.weights_only_resume:
            return
        checkpoints.check_complete(resume_from_checkpoint)
        self.last_checkpoint = resume_from_checkpoint  # the run's result until it saves again
        model = model or self.model
        unwrapped = self.accelerator.unwrap_model(model)
        load_backbone_weights(unwrapped.backbone, resume_from_checkpoint)
        unwrapped.load_head(resume_from_checkpoint)

    def _load_best_model(self) -> None:
        """``--load_best_model_at_end``: the best checkpoint's weights back into the model.
        Under DeepSpeed the engine reloads its own checkpoint (ZeRO-3 parameters are
        partitioned, so a plain state dict cannot be loaded into them)."""
        if self.is_deepspeed_enabled:
            super()._load_best_model()
            return
        best = self.state.best_model_checkpoint
        if best:
            unwrapped = self.accelerator.unwrap_model(self.model)
            load_backbone_weights(unwrapped.backbone, best)
            unwrapped.load_head(best)


@contextlib.contextmanager
def refused_files_named() -> Iterator[None]:
    """The Trainer's own resume loaders (optimizer, scheduler, scaler, RNG state) load with
    ``torch.load(weights_only=True)``, which refuses a planted pickle with a long
    ``UnpicklingError`` that does not say which file: here it becomes
    :class:`~mmembed.training.checkpoints.UnsafeCheckpointError`, one line naming the file."""
    import pickle

    load = torch.load

    def named(f, *args, **kwargs):
        try:
            return load(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            raise checkpoints.UnsafeCheckpointError(checkpoints.refused_file(f, e)) from None

    torch.load = named
    try:
        yield
    finally:
        torch.load = load


@contextlib.contextmanager
def deepspeed_safe_loads(engine) -> Iterator[None]:
    """The DeepSpeed ``engine``'s checkpoint engine loading every file with
    ``torch.load(weights_only=True)`` and :data:`~mmembed.training.checkpoints.DEEPSPEED_GLOBALS` allowed (DeepSpeed's
    torch engine passes ``weights_only=False``, which runs whatever a pickle in the file says).
    Its ``load`` is replaced on the instance, whichever checkpoint engine the config chose."""
    checkpoint_engine = engine.checkpoint_engine
    allowed = checkpoints.resolve_globals(checkpoints.DEEPSPEED_GLOBALS)

    def safe_load(path: str, map_location=None):
        return checkpoints.load_untrusted(path, map_location=map_location, allowed=allowed)

    checkpoint_engine.load = safe_load
    try:
        yield
    finally:
        del checkpoint_engine.load  # the class's own again


def args_without_tokens(args):
    """A copy of the training arguments with every ``*_token`` field (``--hub_token``) cleared,
    for ``training_args.bin``: a checkpoint is shared and pushed, a token must not go with it."""
    saved = copy.copy(args)
    for f in dataclasses.fields(saved):
        if f.name.endswith("token") and getattr(saved, f.name, None):
            object.__setattr__(saved, f.name, None)
    return saved

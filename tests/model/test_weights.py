"""A saved folder's weights loaded into an existing backbone (mmembed/model/weights.py).

The whole paths (resuming, --resume_only_model from mmembed's and ms-swift's checkpoints, LoRA
adapters, ZeRO-3) are tests/training/test_checkpoints.py, tests/training/test_swift_flags.py and
tests/tools/test_swift_compat.py; here the loader alone, on the tiny Qwen3.
"""

import logging
import os

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModel

from mmembed.model.weights import load_backbone_weights


def _fresh(base: str, seed: int) -> torch.nn.Module:
    """The bare backbone (what AutoModel builds) with weights of its own."""
    torch.manual_seed(seed)
    return AutoModel.from_config(AutoConfig.from_pretrained(base))


def _assert_same(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert got.keys() == state.keys()
    for name, value in state.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("shard", [None, "20KB"])
def test_the_backbones_own_folder_loads_whole_or_sharded(shard, tiny_model, tmp_path):
    base = tiny_model("qwen3")
    saved = _fresh(base, seed=1)
    saved.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(files) == 1 if shard is None else len(files) > 1
    model = _fresh(base, seed=2)
    load_backbone_weights(model, str(tmp_path))
    _assert_same(model, saved.state_dict())


def test_a_full_class_folder_loads_its_backbone_and_leaves_the_head_out(tiny_model, tmp_path, caplog):
    """As ms-swift's full training saves: Qwen3ForCausalLM, the backbone under ``model.`` and an
    ``lm_head`` of its own, which the embedding model has no place for."""
    base = tiny_model("qwen3")
    config = AutoConfig.from_pretrained(base)
    config.tie_word_embeddings = False
    torch.manual_seed(3)
    full = transformers.Qwen3ForCausalLM(config)
    full.save_pretrained(tmp_path)
    model = _fresh(base, seed=4)
    with caplog.at_level(logging.INFO, logger="mmembed"):
        load_backbone_weights(model, str(tmp_path))
    _assert_same(model, full.model.state_dict())
    assert "head weights (lm_head.weight) are left out" in caplog.text


def test_weights_of_another_model_or_none_at_all_are_errors(tiny_model, tmp_path):
    from safetensors.torch import save_file

    base = tiny_model("qwen3")
    state = {k: v.contiguous() for k, v in _fresh(base, seed=5).state_dict().items()}
    for name, weights, error in [
        ("extra", {**state, "extra.weight": torch.zeros(2)}, r"\(missing \[\], unexpected \['extra.weight'\]\)"),
        ("missing", {k: v for k, v in state.items() if k != "norm.weight"}, r"\(missing \['norm.weight'\], unexpected \[\]\)"),
    ]:
        (tmp_path / name).mkdir()
        save_file(weights, str(tmp_path / name / "model.safetensors"))
        with pytest.raises(ValueError, match=f"{tmp_path / name}: weights do not match the model {error}"):
            load_backbone_weights(_fresh(base, seed=6), str(tmp_path / name))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no adapter_model.safetensors or model.safetensors to load"):
        load_backbone_weights(_fresh(base, seed=6), str(tmp_path / "empty"))

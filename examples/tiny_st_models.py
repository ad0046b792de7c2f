"""Tiny random sentence-transformers folders shaped as real ones, built offline.

- `gemma_emb`: EmbeddingGemma's shape (google/embeddinggemma-300m, ms-swift's `gemma_emb`):
  a `Gemma3TextModel` with bidirectional attention (`use_bidirectional_attention`), then
  sentence-transformers' mean `Pooling` -> `Dense` (hidden -> 4 x hidden, no bias, identity)
  -> `Dense` (4 x hidden -> hidden, no bias, identity) -> `Normalize`, and EmbeddingGemma's
  prompts in `config_sentence_transformers.json` (`query`: `task: search result | query: `,
  `document`: `title: none | text: `, ...). The tokenizer is a small byte-level BPE trained
  here on the bundled STS-B sentences, with Gemma's special tokens on Gemma's ids (`<pad>` 0,
  `<eos>` 1, `<bos>` 2, `<unk>` 3) and Gemma's habit of adding `<bos>` before a text and
  `<eos>` after it. Weights are random and tiny (hidden 64, 2 layers: one sliding-window,
  one global).

Python: `build(kind, out_dir, seed=0) -> out_dir`. Command line:
`python examples/tiny_st_models.py gemma_emb OUT_DIR [--seed N]`.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

KINDS = ("gemma_emb",)
HERE = os.path.dirname(os.path.abspath(__file__))
HIDDEN = 64

# a part of EmbeddingGemma's named prompts (its config_sentence_transformers.json has these and more)
GEMMA_PROMPTS = {
    "query": "task: search result | query: ",
    "document": "title: none | text: ",
    "BitextMining": "task: search result | query: ",
    "Clustering": "task: clustering | query: ",
    "Classification": "task: classification | query: ",
    "STS": "task: sentence similarity | query: ",
    "Retrieval-query": "task: search result | query: ",
    "Retrieval-document": "title: none | text: ",
}


def _sentences() -> list[str]:
    texts = []
    for path in sorted(glob.glob(os.path.join(HERE, "data", "stsb_*.jsonl"))):
        with open(path, encoding="utf-8") as f:
            for line in f:
                row = json.loads(line)
                texts += [v for k, v in row.items() if k in ("query", "response") and isinstance(v, str)]
    return texts


def build_gemma_tokenizer(out_dir: str, vocab_size: int = 1024):
    """A byte-level BPE of ``vocab_size`` tokens trained on the bundled STS-B sentences, saved as a
    transformers fast tokenizer adding ``<bos>`` ... ``<eos>`` as Gemma's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_sentences(), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", pair="<bos> $A <eos> $B <eos>", special_tokens=[("<bos>", 2), ("<eos>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>", padding_side="right", model_max_length=512)
    fast.save_pretrained(out_dir)
    return fast


def _build_gemma_emb(out_dir: str) -> None:
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling, Transformer
    from transformers import Gemma3TextConfig, Gemma3TextModel

    base = os.path.join(out_dir, ".base")
    tok = build_gemma_tokenizer(base)
    config = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"], use_bidirectional_attention=True,
        pad_token_id=0, eos_token_id=1, bos_token_id=2, architectures=["Gemma3TextModel"])
    Gemma3TextModel(config).save_pretrained(base)
    identity = torch.nn.Identity()
    model = SentenceTransformer(modules=[
        Transformer(base, max_seq_length=512),
        Pooling(HIDDEN, "mean"),
        Dense(HIDDEN, 4 * HIDDEN, bias=False, activation_function=identity),
        Dense(4 * HIDDEN, HIDDEN, bias=False, activation_function=identity),
        Normalize(),
    ], prompts=GEMMA_PROMPTS, similarity_fn_name="cosine", device="cpu")
    model.save(out_dir)
    import shutil

    shutil.rmtree(base)


def build(kind: str, out_dir: str, seed: int = 0) -> str:
    """Build the tiny random ``kind`` folder into ``out_dir`` (weights drawn from ``seed``)."""
    import torch

    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(KINDS)}")
    os.makedirs(out_dir, exist_ok=True)
    with torch.random.fork_rng(devices=[]):  # the caller's random state is left as it was
        torch.manual_seed(seed)
        _build_gemma_emb(out_dir)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build(args.kind, args.out_dir, args.seed))


if __name__ == "__main__":
    main()

"""The length check's shortcut for short ASCII rows: a tokenizer whose pipeline is known gives an
ASCII text of c characters at most ``per_char * c + extra`` tokens (ascii_token_bound), so a row
whose inputs are all within --max_length by that bound is kept without being tokenized. Checked
against the tokenizers themselves (the models' own and small ones built for each pipeline step
the bound reads), and the rows kept against counting every row."""

from __future__ import annotations

import dataclasses
import random
import string

import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from mmembed.data.sample import Item, Sample
from mmembed.encoding import measure
from mmembed.encoding.inputs import InputBuilder
from mmembed.encoding.layout import Layout
from mmembed.encoding.measure import ascii_token_bound
from mmembed.encoding.templates import get_template

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "[CLS]", "[SEP]", "[UNK]", "<unk>", "<s>", "</s>", "<|sep|>"]
ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \t\n\r\x0b\x0c" + "".join(map(chr, range(32))) + "\x7f"


def ascii_texts(rng: random.Random, n: int = 400) -> list[str]:
    texts = ["", " ", "a", "\x00", " " * 50, "a" * 300, "1234567890" * 20, ".,;:!?" * 30, "<|endoftext|>" * 5,
             "[CLS][SEP]", "<|im_start|>user\nhi<|im_end|>", "▁".encode().decode("ascii", "ignore") + "x"]
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 40)):
            r = rng.random()
            if r < 0.1:
                parts.append(rng.choice(SPECIALS))
            elif r < 0.6:
                parts.append("".join(rng.choice(string.ascii_letters) for _ in range(rng.randint(1, 12))))
            else:
                parts.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 6))))
        texts.append(rng.choice(["", " ", "  "]).join(parts))
    return texts


def assert_bounded(backend, name):
    rng = random.Random(0)
    backend.no_padding()  # as the length check counts (measure.TextCounter)
    backend.no_truncation()
    for add_special_tokens in (True, False):
        bound = ascii_token_bound(backend, add_special_tokens)
        assert bound is not None, name
        per_char, extra = bound
        for text in ascii_texts(rng):
            n = len(backend.encode(text, add_special_tokens=add_special_tokens))
            assert n <= per_char * len(text) + extra, (name, add_special_tokens, text, n, bound)


CORPUS = ["the quick brown fox jumps over the lazy dog", "a man plays a flute", "hello world, again and again!",
          "numbers 12345 and symbols #@$%", "UPPER lower MiXeD"] * 20


def built(model, trainer, normalizer=None, pre_tokenizer=None, post_processor=None):
    tok = Tokenizer(model)
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens(["<|sep|>", "<s>", "</s>"])
    if post_processor is not None:
        tok.post_processor = post_processor
    return tok


def small_tokenizers():
    """One small tokenizer per pipeline step the bound reads."""
    template = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", 3), ("</s>", 4)])
    return {
        "unigram, metaspace, prepend and replace": built(
            models.Unigram(), trainers.UnigramTrainer(vocab_size=80, special_tokens=["<unk>"], unk_token="<unk>"),
            normalizers.Sequence([normalizers.Replace("``", '"'), normalizers.Prepend("__"), normalizers.NFKC()]),
            pre_tokenizers.Metaspace(prepend_scheme="always"), template),
        "wordpiece, bert": built(
            models.WordPiece(unk_token="[UNK]"), trainers.WordPieceTrainer(vocab_size=60, special_tokens=["[UNK]"]),
            normalizers.BertNormalizer(), pre_tokenizers.BertPreTokenizer(),
            processors.BertProcessing(("</s>", 4), ("<s>", 3))),
        "bpe, byte level with a prefix space": built(
            models.BPE(), trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
            normalizers.Lowercase(), pre_tokenizers.ByteLevel(add_prefix_space=True), template),
        "wordlevel, whitespace and digits": built(
            models.WordLevel(unk_token="<unk>"), trainers.WordLevelTrainer(special_tokens=["<unk>"]),
            normalizers.Strip(), pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                          pre_tokenizers.Digits(individual_digits=True)])),
    }


@pytest.mark.parametrize("name", list(small_tokenizers()))
def test_the_bound_holds_for_each_pipeline_step_it_reads(name):
    assert_bounded(small_tokenizers()[name], name)


def test_the_bound_holds_for_the_models_tokenizers(minilm_path, tmp_path):
    import sys

    from conftest import REPO
    from transformers import AutoTokenizer

    sys.path.insert(0, f"{REPO}/examples")
    import tiny_models

    assert_bounded(AutoTokenizer.from_pretrained(minilm_path)._tokenizer, "all-MiniLM-L6-v2")
    for kind in ("qwen2", "qwen3"):
        tok = tiny_models.build_qwen_tokenizer(str(tmp_path / kind), kind)
        assert_bounded(tok._tokenizer, kind)


def test_pipelines_the_bound_does_not_cover_have_none():
    byte_fallback = built(models.BPE(byte_fallback=True, unk_token="<unk>"), trainers.BpeTrainer(vocab_size=80),
                          None, pre_tokenizers.Metaspace())  # "▁" is three bytes, each a token when unknown
    regex = built(models.WordLevel(unk_token="<unk>"), trainers.WordLevelTrainer(special_tokens=["<unk>"]),
                  normalizers.Replace(Regex("a"), "aaa"), pre_tokenizers.Whitespace())
    longer = built(models.WordLevel(unk_token="<unk>"), trainers.WordLevelTrainer(special_tokens=["<unk>"]),
                   normalizers.Replace("a", "a a"), pre_tokenizers.Whitespace())
    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("\u2581a", -1.0), ("a", -2.0)], 0, byte_fallback=True))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    for tok in (byte_fallback, regex, longer, unigram):
        assert ascii_token_bound(tok, True) is None
    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("\u2581a", -1.0), ("a", -2.0)], 0, byte_fallback=False))
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    assert ascii_token_bound(unigram, True) == (2, 1)


def test_rows_within_the_bound_are_kept_as_counting_them_keeps_them(minilm_path, tmp_path):
    """json_text_lengths with ``within``: a row's number is over the limit exactly when its
    longest input is (then it is that input's count), whatever the limit; rows with text that
    is not ASCII, long texts, systems and side instructions; bert and qwen3_emb."""
    import sys

    from conftest import REPO
    from transformers import AutoTokenizer

    sys.path.insert(0, f"{REPO}/examples")
    import tiny_models

    rng = random.Random(3)
    words = ["cat", "naïve", "日本語", "A.B-C", "\t", "<|im_end|>", "long" * 30, '"quoted"', "{x}", "word"]

    def item():
        text = " ".join(rng.choice(words) for _ in range(rng.choice([0, 2, 5, 20, 80])))
        return Item(text=text, system=rng.choice([None, None, "", "Represent this: ", "naïve system"]))

    rows = [Sample(anchor=item(), positives=[item()], negatives=[item() for _ in range(rng.randint(0, 4))], label=1.0,
                   source="rows.jsonl", line=k + 1) for k in range(300)]
    texts = [r.to_json() for r in rows]
    tokenizers = {"bert": AutoTokenizer.from_pretrained(minilm_path),
                  "qwen3_emb": tiny_models.build_qwen_tokenizer(str(tmp_path / "qwen3"), "qwen3")}
    for name, tok in tokenizers.items():
        for query in (None, "Find the passage: "):
            template = dataclasses.replace(get_template(name), query_system=query)
            b = InputBuilder(template, tok, None, truncate=False, check_media="header")
            assert b.text_counter().ascii_bound is not None
            for layout in (Layout.GROUP, Layout.PAIR):
                exact = measure.json_text_lengths(b.template, b.text_counter(), texts, layout)
                for limit in (8, 40, 120, 300, 10_000):
                    got = measure.json_text_lengths(b.template, b.text_counter(), texts, layout, within=limit)
                    assert [n > limit for n in got] == [n > limit for n in exact], (name, limit)
                    assert all(g == e for g, e in zip(got, exact) if g > limit), (name, limit)
                    assert all(g >= e for g, e in zip(got, exact)), (name, limit)

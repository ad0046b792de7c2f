"""The model card (``README.md``) of a reranker folder: what it is, how it was trained, and how
to score with it (``mmembed rerank``; sentence-transformers' ``CrossEncoder`` for a classifier;
plain transformers with the scoring written out for a generative reranker)."""

from __future__ import annotations

import os
from typing import Any

from ...encoding.templates import template_from_config
from ...model.card import CARD, _table, _training_section


def write_reranker_card(output_dir: str, config: dict[str, Any], final_path: str | None = None) -> None:
    """``output_dir/README.md`` of a reranker folder (``mmembed.json``'s fields in ``config``):
    what it is, how it was trained, and how to score with it: ``mmembed rerank``, and outside
    mmembed sentence-transformers' ``CrossEncoder`` (a classifier) or plain transformers with
    the scoring written out (a generative reranker: ``logit(yes) - logit(no)`` at the last
    position of the template's text)."""
    with open(os.path.join(output_dir, CARD), "w", encoding="utf-8") as f:
        f.write(reranker_card(final_path or os.path.abspath(output_dir), config))


def reranker_card(path: str, config: dict[str, Any]) -> str:
    template = template_from_config(config["template"])
    adapter = config.get("tuner_type") not in (None, "full")
    generative = config.get("kind") == "generative"
    front = ["---", "library_name: " + ("transformers" if generative else "sentence-transformers"),
             "pipeline_tag: text-ranking", "tags:", "- mmembed", "- reranker",
             *([] if generative else ["- cross-encoder"]), "---", ""]
    what = ("a generative reranker: the raw score s of a (query, document) pair is logit("
            f"{config['tokens'][0]!r}) - logit({config['tokens'][1]!r}) at the last token of the template's text"
            if generative else "a cross-encoder reranker: the raw score s of a (query, document) pair is the logit of "
                               "its one-label classification head")
    scores = ("`mmembed rerank`, `POST /v1/rerank` (`mmembed serve`) and `Reranker.score` report the "
              "probability of relevance sigmoid(s)"
              + (f" = softmax([logit({config['tokens'][1]!r}), logit({config['tokens'][0]!r})])[1]" if generative
                 else ", as sentence-transformers' `CrossEncoder.predict` does")
              + "; `--raw_scores true` (`\"raw_scores\": true` in a request) gives s itself.\n")
    rows = [("base model", f"`{config.get('base_model', '?')}`"), ("task", f"`--task_type {config['task_type']}`"),
            ("template", f"`{template.name}`" + (f" ({template.description})" if template.description else "")),
            ("max length", str(config.get("max_length")))]
    parts = ["\n".join(front), f"# {os.path.basename(path)}\n",
             f"A reranker fine-tuned with mmembed (`mmembed sft`, {config.get('tuner_type', 'full')} tuning"
             f"{', a LoRA adapter: `mmembed export --adapters ' + path + '` writes the merged model' if adapter else ''}): "
             f"{what}.", scores, "## Model\n\n" + _table(rows), _training_section(config), "## Usage\n",
             "### mmembed\n\n```bash\n"
             f"mmembed rerank --model {path} --query 'how do flutes work' --documents docs.txt\n```\n"]
    if not generative and not adapter:
        parts.append("### sentence-transformers\n\n```python\nfrom sentence_transformers import CrossEncoder\n\n"
                     f"model = CrossEncoder({path!r})\n"
                     "scores = model.predict([(\"how do flutes work\", \"A flute is a woodwind instrument.\")])"
                     "  # sigmoid(s); the logit s: predict(..., activation_fn=torch.nn.Identity())\n```\n")
    if generative and not adapter and not template.media:
        text = template.format_with_system or template.format
        parts.append(
            "### transformers\n\nThe pair's text is the template's (`pair_format` filled in, then the chat turn "
            f"around it):\n\n```python\nimport torch\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f"tok = AutoTokenizer.from_pretrained({path!r}, padding_side='left')\n"
            f"model = AutoModelForCausalLM.from_pretrained({path!r}).eval()\n"
            f"pair = {template.pair_format!r}.format(instruction={template.default_instruction!r}, "
            "query='how do flutes work', document='A flute is a woodwind instrument.')\n"
            f"text = {text!r}.format(system={template.default_system!r}, content=pair)\n"
            "enc = tok([text], return_tensors='pt', padding=True)\n"
            "with torch.no_grad():\n    logits = model(**enc).logits[:, -1].float()\n"
            f"yes, no = logits[:, {config['token_ids'][0]}], logits[:, {config['token_ids'][1]}]\n"
            "score = torch.softmax(torch.stack([no, yes], dim=-1), dim=-1)[:, 1]  # sigmoid(s), what mmembed reports\n"
            "raw = yes - no  # s, with --raw_scores true\n```\n")
    return "\n".join(parts)

"""The model card (``README.md``) of a saved folder: what the model is, how it was trained,
and how to embed with it in mmembed, sentence-transformers and plain transformers.

Everything comes from the folder's ``mmembed.json`` fields (``write_saved_folder`` in
``folder.py``): the base model, template and pooling, the data files and their row counts, the
loss and its settings, and ``training`` (steps, time, the last logged metrics), which
``training_record`` builds from the Trainer's log history at each save. The usage snippets
are code that runs as written (the tests run them and compare with ``mmembed.Embedder``).
"""

from __future__ import annotations

import os
import time
from typing import Any

from .io import TextForm, configured_template, instructions_of

CARD = "README.md"
EXAMPLE_TEXTS = ["A man is playing a flute.", "Someone plays music."]

# pooled [N, D] from `hidden` [N, L, D] and `mask` [N, L], under left or right padding
_POOL_CODE = {
    "last": "last = (mask * torch.arange(mask.shape[1])).argmax(1)  # the last real token (left or right padding)\n"
            "    pooled = hidden[torch.arange(len(texts)), last]",
    "cls": "first = mask.argmax(1)  # the first real token (left or right padding)\n"
           "    pooled = hidden[torch.arange(len(texts)), first]",
    "mean": "pooled = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)",
    "max": "pooled = hidden.masked_fill(mask[..., None] == 0, float(\"-inf\")).max(1).values",
}


_POOL_NAME = {"last": "Last-token pooling", "cls": "First-token (CLS) pooling", "mean": "Mean pooling over the tokens",
              "max": "Max pooling over the tokens"}


def training_record(config: dict[str, Any], log_history: list[dict[str, Any]],
                    global_step: int | None = None) -> dict[str, Any]:
    """Steps (the Trainer's ``global_step``; else the last logged step), wall time since
    ``config["started_at"]`` and the last logged training loss and evaluation metrics, from a
    Trainer's ``state.log_history``."""
    if global_step is None:
        global_step = max((int(h.get("step", 0)) for h in log_history), default=0)
    record: dict[str, Any] = {"global_step": int(global_step)}
    if config.get("started_at"):
        record["seconds"] = round(time.time() - float(config["started_at"]), 1)
    losses = [h for h in log_history if "loss" in h]
    if losses:
        record["train_loss"] = losses[-1]["loss"]
        record["train_loss_step"] = losses[-1].get("step")
    evals = [h for h in log_history if any(k.startswith("eval_") for k in h)]
    if evals:
        last = evals[-1]
        record["eval_step"] = last.get("step")
        record["eval"] = {k: v for k, v in last.items() if k.startswith("eval_") and not k.endswith(("_runtime", "_per_second"))}
    return record


def write_model_card(output_dir: str, config: dict[str, Any], form: TextForm | None, final_path: str | None = None) -> None:
    """Write ``output_dir/README.md`` from the folder's ``mmembed.json`` fields; ``form``: the
    text form the saved tokenizer follows (``None``: no plain-transformers text snippet);
    ``final_path``: the path the snippets name (default ``output_dir``)."""
    with open(os.path.join(output_dir, CARD), "w", encoding="utf-8") as f:
        f.write(model_card(final_path or os.path.abspath(output_dir), config, form))


def _quantization_note(config: dict[str, Any]) -> str:
    """QLoRA: the base the adapter trained on (``quantization`` in a checkpoint's ``mmembed.json``,
    ``trained_with_quantization`` in an export's), and what loading it here means."""
    record = config.get("quantization") or config.get("trained_with_quantization")
    if not record:
        return ""
    bits = record.get("quant_bits")
    kind = f"{bits}-bit {record.get('bnb_4bit_quant_type')}" if bits == 4 else f"{bits}-bit"
    if config.get("trained_with_quantization"):
        return (f"The LoRA adapter trained on the base quantized by bitsandbytes ({kind}: QLoRA) and is merged here "
                "into the full-precision base weights, as ms-swift's export does.\n")
    return (f"The adapter trained on the base quantized by bitsandbytes ({kind}: QLoRA). `Embedder.from_pretrained` "
            "and `mmembed export` merge it into the full-precision base weights, as ms-swift's export does; "
            "`Embedder.from_pretrained(path, quantized=True)` embeds with the base quantized as trained.\n")


def model_card(path: str, config: dict[str, Any], form: TextForm | None) -> str:
    from ..encoding.templates import template_from_config

    template = template_from_config(config["template"]) if config.get("template") else None
    adapter = config.get("tuner_type") not in (None, "full")
    parts = [_front_matter(config), f"# {os.path.basename(path)}\n",
             "An embedding model fine-tuned with mmembed "
             f"(`mmembed sft`, {config.get('tuner_type', 'full')} tuning"
             f"{', a LoRA adapter: `mmembed export --adapters ' + path + ' --merge_lora true` writes the merged model' if adapter else ''}).\n",
             *filter(None, [_quantization_note(config)]),
             _model_section(config, template), _training_section(config), "## Usage\n", _mmembed_usage(path, config)]
    if config.get("sentence_transformers"):
        parts.append(_st_usage(path, config, form))
    if form is not None:
        parts.append(_transformers_text_usage(path, config, form, adapter, template))
    elif template is not None and template.tower == "vision" and not adapter:
        parts.append(_transformers_vision_usage(path, template, config))
    elif template is not None and template.tower == "audio" and not adapter:
        parts.append(_transformers_audio_usage(path, template, config))
    return "\n".join(parts)


def _front_matter(config: dict[str, Any]) -> str:
    tags = ["mmembed", "embeddings", "feature-extraction"]
    if config.get("sentence_transformers"):
        tags.append("sentence-transformers")
    lines = ["---", "library_name: " + ("sentence-transformers" if config.get("sentence_transformers") else "transformers"),
             "pipeline_tag: feature-extraction", "tags:"] + [f"- {t}" for t in tags] + ["---", ""]
    return "\n".join(lines)


def _model_section(config: dict[str, Any], template) -> str:
    rows = [("base model", f"`{config.get('trained_from') or config.get('base_model', '?')}`")]
    if template is not None:
        rows.append(("template", f"`{template.name}`" + (f" ({template.description})" if template.description else "")))
        rows.append(("rendering", "`" + template.format.replace("\n", "\\n") + "`"))
    if config.get("default_system"):
        rows.append(("system prompt", "`" + config["default_system"].replace("\n", "\\n") + "`"))
    rows += _instruction_rows(config)
    rows += [("pooling", f"{config.get('pooling', '?')} token" if config.get("pooling") in ("last", "cls")
              else f"{config.get('pooling', '?')} over tokens"),
             ("normalization", "L2" if config.get("normalize", True) else "none"),
             ("max length", str(config.get("max_length", "?"))),
             ("padding side", str(config.get("padding_side") or (template.padding_side if template else "?")))]
    if config.get("media"):
        rows.append(("media", ", ".join(config["media"])))
    if config.get("exported_from"):
        rows.append(("exported from", f"`{config['exported_from']}`"))
    return "## Model\n\n" + _table(rows)


def _instruction_rows(config: dict[str, Any]) -> list[tuple[str, str]]:
    """The instructions of each side (``--query_system``, ``--document_system``) and of each
    dataset the model was trained with, as they are put where the system prompt goes."""
    def shown(text: str) -> str:
        return "`" + text.replace("\n", "\\n") + "`" if text else "(none)"

    found = instructions_of(config)
    rows = [(f"{side} instruction", shown(found[side])) for side in ("query", "document") if found[side] is not None]
    for name, own in found["datasets"].items():
        rows += [(f"{side} instruction of dataset `{name}`", shown(own[side]))
                 for side in ("query", "document") if own[side] is not None]
    return rows


def _has_instructions(config: dict[str, Any]) -> bool:
    return bool(_instruction_rows(config))


def _training_section(config: dict[str, Any]) -> str:
    rows = []
    if config.get("loss_type"):
        settings = config.get("loss_settings")
        rows.append(("loss", f"`{config['loss_type']}`" + (f" ({settings})" if settings else "")))
    for key, label in (("learning_rate", "learning rate"), ("per_device_train_batch_size", "batch size per device"),
                       ("num_train_epochs", "epochs"), ("max_steps", "max steps"), ("seed", "seed")):
        if config.get(key) is not None:
            rows.append((label, str(config[key])))
    train = config.get("training") or {}
    if "global_step" in train:
        rows.append(("steps", str(train["global_step"])))
    if "seconds" in train:
        rows.append(("training time", _duration(train["seconds"])))
    if "train_loss" in train:
        rows.append(("training loss", f"{train['train_loss']:.4g} (step {train.get('train_loss_step')})"))
    for name, value in (train.get("eval") or {}).items():
        rows.append((name, f"{value:.4g} (step {train.get('eval_step')})" if isinstance(value, (int, float)) else str(value)))
    text = "## Training\n\n" + (_table(rows) if rows else "")
    data = config.get("data") or {}
    files = [(kind, spec) for kind in ("train", "val") for spec in data.get(kind, [])]
    if files:
        text += "\n| data | file | rows read |\n|---|---|---|\n"
        text += "".join(f"| {kind} | `{f['file']}` | {f['rows']} |\n" for kind, f in files)
    for key, label in (("train_rows", "training groups"), ("val_rows", "evaluation groups")):
        if data.get(key) is not None:
            text += f"\n{label} after loading: {data[key]}"
    return text + ("\n" if data else "")


def _mmembed_usage(path: str, config: dict[str, Any] | None = None) -> str:
    sides = ""
    if config is not None and _has_instructions(config):
        sides = ("queries = model.encode([\"how do flutes work\"], input_type=\"query\")  # with the query instruction\n"
                 "documents = model.encode([\"A flute is a woodwind instrument.\"], input_type=\"document\")\n")
    return ("### mmembed\n\n```python\nfrom mmembed import Embedder\n\n"
            f"model = Embedder.from_pretrained({path!r})\n"
            f"embeddings = model.encode({EXAMPLE_TEXTS!r})  # numpy [2, D], L2-normalized\n{sides}```\n"
            + ("\n`input_type` (`mmembed embed --input_type`, `mmembed serve`'s `input_type`) puts each side's "
               "instruction where the model was trained with it.\n" if sides else ""))


def _st_usage(path: str, config: dict[str, Any], form: TextForm | None) -> str:
    text = ("### sentence-transformers\n\n```python\nfrom sentence_transformers import SentenceTransformer\n\n"
            f"model = SentenceTransformer({path!r})\n"
            f"embeddings = model.encode({EXAMPLE_TEXTS!r})\n```\n")
    prompts = config.get("sentence_transformers_prompts") or {}
    if prompts.get("query") or prompts.get("document"):
        text += ("\nQueries and documents, each with its prompt (`query`, `document` in `config_sentence_transformers.json`: "
                 "the instruction the model was trained with for that side):\n\n```python\n"
                 "queries = model.encode_query([\"how do flutes work\"])  # prompt " + repr(prompts.get("query", "")) + "\n"
                 "documents = model.encode_document([\"A flute is a woodwind instrument.\"])  # prompt "
                 + repr(prompts.get("document", "")) + "\n```\n")
    named = sorted(k for k in prompts if k not in ("query", "document", "default"))
    if named:
        text += "\nOther named prompts (`model.encode(texts, prompt_name=...)`): " + ", ".join(f"`{k}`" for k in named) + ".\n"
    applies = not prompts or prompts.get("query") == prompts.get("document") == (form.prompt if form else None)
    if form is not None and form.prompt and applies:
        text += f"\nThe default prompt `{form.prompt!r}` (the system prompt the model was trained with) is applied to every text.\n"
    if form is not None and form.prompt_format:
        text += (f"\nA text with another system prompt or instruction `system` is embedded as mmembed embeds a row with "
                 f"that `system`: `model.encode(texts, prompt={_fstring(form.prompt_format)})`.\n")
    return text


def _transformers_text_usage(path: str, config: dict[str, Any], form: TextForm, adapter: bool, template) -> str:
    pooling = config.get("pooling", "mean")
    prefix = (template.adapter_prefix if template is not None else "").rstrip(".")
    if adapter and prefix:  # the adapter names the modules of the family's causal-LM class (ms-swift's layout)
        load = (f"full = AutoModelForCausalLM.from_pretrained({config.get('base_model')!r})\n"
                f"model = PeftModel.from_pretrained(full, path).merge_and_unload().{prefix}.eval()  # the backbone\n")
        imports = "from peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n"
    elif adapter:
        load = (f"base = AutoModel.from_pretrained({config.get('base_model')!r})\n"
                f"model = PeftModel.from_pretrained(base, path).merge_and_unload().eval()\n")
        imports = "from peft import PeftModel\n"
    else:
        load, imports = "model = AutoModel.from_pretrained(path).eval()\n", ""
    if form.suffix:
        note = (f"The saved tokenizer appends `{form.suffix!r}` after each text itself (as the template "
                "does), so texts are passed as they are.")
    else:
        note = "The tokenizer adds its own special tokens."
    code = (
        "```python\nimport torch\nimport torch.nn.functional as F\n"
        f"{imports}from transformers import AutoModel, AutoTokenizer\n\n"
        f"path = {path!r}\ntokenizer = AutoTokenizer.from_pretrained(path)\n{load}\n\n"
        f"def embed(texts, prompt={form.prompt!r}):\n"
        f"    batch = tokenizer([prompt + t for t in texts], padding=True, truncation=True, "
        f"max_length={config.get('max_length') or 512}, return_tensors=\"pt\")\n"
        "    with torch.no_grad():\n        hidden = model(**batch).last_hidden_state\n"
        "    mask = batch[\"attention_mask\"]\n"
        f"    {_POOL_CODE[pooling]}\n"
        "    return F.normalize(pooled, dim=-1)\n\n\n"
        f"embeddings = embed({EXAMPLE_TEXTS!r})\n```\n"
    )
    text = f"### transformers\n\n{_POOL_NAME[pooling]}, then L2 normalization. {note}\n\n{code}"
    if _has_instructions(config):
        from ..data.sample import Item

        sided = configured_template(config)
        query, document = (sided.render(Item(text="\x00"), side).partition("\x00")[0] for side in ("query", "document"))
        text += (f"\nQueries and documents with the instruction of their side, as the model was trained: "
                 f"`embed(queries, prompt={query!r})`, `embed(documents, prompt={document!r})`.\n")
    if form.prompt_format:
        text += f"\nWith another system prompt or instruction `system`: `embed(texts, prompt={_fstring(form.prompt_format)})`.\n"
    text += ("\nTexts over the max length: mmembed cuts the rendered text (the appended tokens included); "
             "the tokenizer here cuts the text and keeps them.\n" if form.suffix else "")
    return text


def _around_input(template, config: dict[str, Any]) -> tuple[str, str]:
    """The template's rendering before and after an item's text (with the saved system prompt)."""
    from ..data.sample import Item

    system = config.get("default_system", template.default_system) or ""
    prefix, _, suffix = template.render(Item(text="\x00", system=system)).partition("\x00")
    return prefix, suffix


def _side_renderings(config: dict[str, Any]) -> str:
    """A note on what goes before and after a query's and a document's input, when the model
    was trained with instructions (the snippet's rendering is an input without a side)."""
    if not _has_instructions(config):
        return ""
    from ..data.sample import Item

    template = configured_template(config)
    lines = []
    for side in ("query", "document"):
        before, _, after = template.render(Item(text="\x00"), side).partition("\x00")
        lines.append(f"- {side}: `{before!r}` + input + `{after!r}`")
    return ("\nThe model was trained with an instruction per side (see Model); `mmembed` puts it in with "
            "`input_type`, and by hand the rendering around the input is:\n\n" + "\n".join(lines) + "\n")


def _transformers_vision_usage(path: str, template, config: dict[str, Any]) -> str:
    prefix, suffix = _around_input(template, config)
    image = template.media.get("image", "")
    code = (
        "```python\nimport torch\nimport torch.nn.functional as F\n"
        "from qwen_vl_utils import fetch_image\n"
        "from transformers import AutoModel, AutoProcessor\n\n"
        f"path = {path!r}\nprocessor = AutoProcessor.from_pretrained(path)\n"
        "model = AutoModel.from_pretrained(path).eval()\n"
        "patch = processor.image_processor.patch_size\n\n\n"
        "def embed(text, images=()):\n"
        "    \"\"\"One input: `text` with an `<image>` tag where each image goes.\"\"\"\n"
        f"    text = {prefix!r} + text.replace(\"<image>\", {image!r}) + {suffix!r}\n"
        "    images = [fetch_image({\"image\": im}, image_patch_size=patch) for im in images]  # sized as mmembed does\n"
        "    batch = processor(text=[text], images=images or None, do_resize=False, return_tensors=\"pt\")\n"
        "    with torch.no_grad():\n        hidden = model(**batch).last_hidden_state\n"
        "    return F.normalize(hidden[0, -1], dim=-1)  # the last token\n\n\n"
        "text_embedding = embed(\"a red circle\")\n"
        "# image_embedding = embed(\"<image>\", [\"red_circle.png\"])\n```\n"
    )
    return ("### transformers\n\nThe model's rendering around the input, the processor (images sized by qwen-vl-utils "
            "under `MAX_PIXELS`/`MIN_PIXELS`, as in training), the last token's hidden state, L2 normalization. "
            "There are no sentence-transformers files: see the mmembed documentation (docs/checkpoints.md).\n\n" + code
            + _side_renderings(config))


def _transformers_audio_usage(path: str, template, config: dict[str, Any]) -> str:
    prefix, suffix = _around_input(template, config)
    audio = template.media.get("audio", "")
    code = (
        "```python\nimport numpy as np\nimport soundfile\nimport soxr\nimport torch\nimport torch.nn.functional as F\n"
        "from transformers import AutoModel, AutoProcessor\n\n"
        f"path = {path!r}\nprocessor = AutoProcessor.from_pretrained(path)\n"
        "model = AutoModel.from_pretrained(path).eval()\n"
        "rate = processor.feature_extractor.sampling_rate\n\n\n"
        "def load_audio(file):\n"
        "    \"\"\"Mono float32 at the model's rate, as mmembed reads it (librosa.load(file, sr=rate) gives the same).\"\"\"\n"
        "    y, sr = soundfile.read(file, dtype=\"float32\", always_2d=True)\n"
        "    y = y.mean(axis=1, dtype=np.float32)\n"
        "    if sr != rate:\n"
        "        n = -(-len(y) * rate // sr)  # ceil(len(y) * rate / sr) samples\n"
        "        y = soxr.resample(y, sr, rate, quality=\"soxr_hq\")[:n]\n"
        "        y = np.pad(y, (0, n - len(y)))\n"
        "    return y\n\n\n"
        "def embed(text, audios=()):\n"
        "    \"\"\"One input: `text` with an `<audio>` tag where each audio clip goes.\"\"\"\n"
        f"    text = {prefix!r} + text.replace(\"<audio>\", {audio!r}) + {suffix!r}\n"
        "    media = {\"audio\": [load_audio(a) for a in audios], \"sampling_rate\": rate} if audios else {}\n"
        "    batch = processor(text=[text], **media, return_tensors=\"pt\")\n"
        "    with torch.no_grad():\n        hidden = model(**batch).last_hidden_state\n"
        "    return F.normalize(hidden[0, -1], dim=-1)  # the last token\n\n\n"
        "text_embedding = embed(\"a steady tone\")\n"
        "# audio_embedding = embed(\"<audio>\", [\"tone.wav\"])\n```\n"
    )
    return ("### transformers\n\nThe model's rendering around the input, the audio read as mmembed reads it (mono, "
            "resampled to the feature extractor's rate), the processor, the last token's hidden state, L2 "
            "normalization. There are no sentence-transformers files: see the mmembed documentation "
            "(docs/checkpoints.md).\n\n" + code + _side_renderings(config))


def _fstring(fmt: str) -> str:
    return "f" + repr(fmt)


def _duration(seconds: float) -> str:
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    minutes, s = divmod(int(seconds), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours} h {m} min" if hours else f"{m} min {s} s"


def _table(rows: list[tuple[str, str]]) -> str:
    return "| | |\n|---|---|\n" + "".join(f"| {k} | {v.replace('|', chr(92) + '|')} |\n" for k, v in rows)


# ----------------------------------------------------------------------------- rerankers

"""benchmarks/bench_gpu.py's sentence-transformers side: the Qwen3-VL-Embedding run trained by s-t 6.2
(its message modality, a chat template made from mmembed's template, LoRA on the language model), and
every s-t run drawing its batches in ms-swift's order, so that the dry run compares the same first
batch and the same first loss on every side (check_same_work)."""

import json
import os
import subprocess
import sys

import jinja2
import pytest

from benchmarks.gpu.largest import largest_batch
from benchmarks.gpu.models import to_messages_form
from benchmarks.gpu.st_side import st_chat_template, st_rows, st_vl_column
from mmembed.data.sample import Item
from mmembed.encoding.templates import get_template

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def render(messages: list) -> str:
    return jinja2.Environment().from_string(st_chat_template("qwen3_vl_emb")).render(messages=messages)


@pytest.mark.parametrize("content,item", [
    ([{"type": "image", "image": "a.png"}], "<image>"),
    ([{"type": "text", "text": "a red circle"}], "a red circle"),
    ([{"type": "image", "image": "a.png"}, {"type": "text", "text": " in the snow"}], "<image> in the snow"),
    ("plain text", "plain text"),
])
def test_the_chat_template_renders_a_row_as_mmembeds_template(content, item):
    """s-t's messages (the system prompt it injects, the user turn's pictures and text) render to the
    string mmembed's qwen3_vl_emb template renders for the same row: the same tokens on both sides."""
    template = get_template(model_type="qwen3_vl_emb")
    system = template.default_system
    got = render([{"role": "system", "content": [{"type": "text", "text": system}]},
                  {"role": "user", "content": content}])
    want = template.render(Item(text=item, system=system))
    assert got == want
    assert want.endswith("<|im_start|>assistant\n<|endoftext|>")
    assert ("<|vision_start|><|image_pad|><|vision_end|>" in got) == ("<image>" in item)


def test_a_query_row_becomes_s_t_inputs_with_its_pictures_in_order():
    images = ["p.png", "n.png"]
    assert st_vl_column("a red circle", images) == "a red circle" and images == ["p.png", "n.png"]
    assert st_vl_column("<image>", images) == {"image": "p.png"}
    assert st_vl_column("<image> at night", images) == {"text": " at night", "image": "n.png"}
    assert images == []
    with pytest.raises(ValueError, match="one picture per input"):
        st_vl_column("<image><image>", ["a", "b"])


def test_s_t_takes_the_rows_in_the_order_mmembed_draws_them(tmp_path):
    """st_rows: the query-form rows in the order mmembed's loader holds the messages-form file under
    --dataset_shuffle / --data_seed 42 (read back through mmembed's own dataset here)."""
    from mmembed.data.dataset import load_samples
    from mmembed.data.sample import Sample

    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps({"query": f"q{i}", "response": f"r{i}"}) + "\n" for i in range(12)))
    data = to_messages_form(str(src), str(tmp_path / "rows.messages.jsonl"))
    rows = st_rows({"data": data, "st_data": str(src)})
    loaded = [Sample.from_json(x).anchor.text for x in load_samples(data, seed=42, shuffle=True).dataset["sample"]]
    assert [r["query"] for r in rows] == loaded and sorted(loaded) != loaded  # shuffled, and the same way


def test_dry_run_s_t_takes_the_same_first_batch_and_gives_the_same_first_loss(tmp_path):
    """The text run (the tiny Qwen3, full tuning) and the Qwen3-VL-Embedding run (LoRA on picture rows):
    s-t's first batch is mmembed's (the same rows' token ids and pictures) and the first losses agree;
    the run fails otherwise (check_same_work). Also --largest_batch's probes run on each side (on the
    CPU nothing runs out of memory: the search stops at its limit)."""
    proc = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_gpu.py"), "--dry_run",
                           "--parts", "text,qwen3vl", "--text_models", "qwen3", "--qwen3vl_batches", "2",
                           "--variants", "", "--vl_variants", "", "--work_dir", str(tmp_path),
                           "--largest_batch", "text", "--largest_start", "8", "--largest_limit", "8"],
                          capture_output=True, text=True, env=dict(os.environ, MMEMBED_SWIFT_PYTHON=""), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = [x.split()[:4] for x in proc.stdout.splitlines() if x.startswith(("Qwen3 2-layer ", "tiny Qwen3-VL-Emb "))]
    assert ["tiny", "Qwen3-VL-Emb", "s-t", "2"] in table, table
    lines = [x for x in proc.stdout.splitlines() if "; s-t " in x]
    assert len(lines) == 2 and all("same batch, agree" in x for x in lines), proc.stdout[-3000:]
    assert any("pictures" in x and " 4 pictures" in x.split("; s-t ")[1] for x in lines), lines
    largest = [x for x in proc.stdout.splitlines() if x.startswith("  Qwen3 2-layer ") and "tried" in x]
    assert [x.split(":")[0].strip() for x in largest] == ["Qwen3 2-layer s-t", "Qwen3 2-layer mmembed"], largest
    assert all(x.endswith("8 (the limit, 8, fits); tried 8 fits") for x in largest), largest


@pytest.mark.parametrize("threshold", [0, 1, 5, 31, 32, 33, 100, 257, 1000, 5000])
@pytest.mark.parametrize("start", [1, 32, 64])
def test_the_largest_batch_search_brackets_the_threshold(threshold, start):
    """largest_batch against a device that fits every batch up to ``threshold``: the largest batch
    found fits, the smallest that did not is above the threshold, and the two are at most one step
    apart (or the limit fits); every probe's outcome is the threshold's."""
    limit, step = 4096, 8
    found = largest_batch(lambda b: b <= threshold, start, limit, step)
    assert all(outcome == (b <= threshold) for b, outcome in found["probes"])
    if threshold < 1:
        assert found["largest"] is None and found["oom"] == 1
        return
    assert found["largest"] <= threshold
    if threshold >= limit:
        assert found["largest"] == limit and found["limit_reached"] and found["oom"] is None
    else:
        assert found["oom"] > threshold and found["oom"] - found["largest"] <= step
        assert not found["limit_reached"]


def test_the_search_stops_where_a_probe_cannot_tell():
    """A probe that crashed or ran out of time (None) ends the search with what is known."""
    outcomes = {32: True, 64: None}
    found = largest_batch(lambda b: outcomes[b], 32, 4096)
    assert found == dict(largest=32, oom=None, limit_reached=False, probes=[(32, True), (64, None)])

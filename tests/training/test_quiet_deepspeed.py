"""DeepSpeed is imported only by a run that uses it: accelerate's unwrap test (every Trainer,
every save_pretrained) no longer imports it, so a CPU command without DeepSpeed prints no
"Setting accelerator to CPU"; once a run has imported DeepSpeed, the test sees its engines."""

import subprocess
import sys

CHECK = """
import sys
import torch
from accelerate.utils import other
from mmembed.training.device_flags import import_deepspeed_only_when_used
import_deepspeed_only_when_used()
import_deepspeed_only_when_used()  # twice: wrapped once
other.extract_model_from_parallel(torch.nn.Linear(2, 2))
print("before", "deepspeed" in sys.modules, other.is_deepspeed_available())
import deepspeed
print("after", other.is_deepspeed_available())
"""


def test_unwrapping_a_model_imports_no_deepspeed_until_a_run_does():
    r = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stdout.split("\n") if line.startswith(("before", "after"))]
    assert lines[0] == "before False False"
    assert lines[1].startswith("after True")
    assert r.stdout.index("before") < r.stdout.index("Setting accelerator")  # printed by the import, not before


def test_a_cpu_command_without_deepspeed_prints_no_deepspeed_line(minilm_path, tmp_path):
    """After a command (`mmembed embed`) a save_pretrained (what `mmembed export` and every
    checkpoint call, and which unwraps the model) imports no DeepSpeed and prints nothing of it."""
    (tmp_path / "in.jsonl").write_text('{"query": "hello"}\n')
    code = (f"import sys; from mmembed.tools.cli import main; "
            f"assert main(['embed', '--model', {minilm_path!r}, '--input', {str(tmp_path / 'in.jsonl')!r}, "
            f"'--output', {str(tmp_path / 'e.npy')!r}]) == 0; "
            f"from transformers import AutoModel; AutoModel.from_pretrained({minilm_path!r}).save_pretrained("
            f"{str(tmp_path / 'saved')!r}); print('imported', 'deepspeed' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "imported False" in r.stdout
    assert "Setting accelerator" not in r.stdout + r.stderr

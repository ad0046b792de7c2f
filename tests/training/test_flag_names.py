"""Every flag of `mmembed sft` that refuses a value names itself: each field of SftArguments
(mmembed's, ms-swift's and every transformers TrainingArguments field) is given values no flag
of its kind takes, through the parser and the checks before the model loads
(``parse_sft_args``, then ``preflight.check_settings``); whenever one is refused, the message
says ``--FLAG``, and it is an error the command reports in one line (a usage error, exit status 2;
a data file the flag names that is not there, 1), never a traceback.

Unlike tests/training/test_bad_settings.py, which holds one chosen bad value per flag with the
words of its message, this walks every field blindly, so a transformers field mmembed never
looked at (``--accelerator_config x``: a file transformers opens) cannot end in a message that
leaves the user guessing which flag it was.
"""

from __future__ import annotations

import dataclasses
import os

from conftest import stsb_pairs, write_jsonl

from mmembed.tools.cli import exit_code
from mmembed.training.arguments import SftArguments, parse_sft_args
from mmembed.training.preflight import check_settings

# no flag of any kind takes these: not a number, not a boolean, not a name transformers knows,
# not a file, not JSON (and "-1" for the numbers that must be positive)
BAD_VALUES = ("x", "-1")


def refusal(argv: list[str]) -> BaseException | None:
    """The exception ``argv`` is refused with, or None when it is accepted."""
    saved = dict(os.environ)  # parsing may set variables (DeepSpeed's rank 0 of 1, --max_pixels)
    try:
        check_settings(parse_sft_args(argv))
    except Exception as e:  # every kind of refusal is collected
        return e
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return None


def test_every_refused_flag_value_names_the_flag(minilm_path, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a value taken as a path is looked for (or written) here
    data = write_jsonl(tmp_path / "train.jsonl", stsb_pairs(8))
    base = ["--model", minilm_path, "--dataset", data, "--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    assert refusal(base) is None  # the run without a bad value is accepted
    names = [f.name for f in dataclasses.fields(SftArguments) if f.init]
    assert len(names) > 150 and {"accelerator_config", "lora_alpha", "fsdp_config", "debug"} <= set(names)
    wrong, refused = [], 0
    for name in names:
        for value in BAD_VALUES:
            error = refusal([*base, f"--{name}", value])
            if error is None:
                continue
            refused += 1
            message = " ".join(str(error).split())
            if exit_code(error) is None or f"--{name}" not in message:
                wrong.append(f"--{name} {value}: {type(error).__name__}: {message[:200]}")
    assert not wrong, "refused without one line naming the flag:\n" + "\n".join(wrong)
    assert refused > 150  # the walk reached the checks: most fields refuse "x"


def test_the_command_refuses_a_transformers_flag_in_one_line_naming_it(minilm_path, tmp_path, monkeypatch, capsys):
    """The issue's case end to end: `mmembed sft --accelerator_config x` (a file transformers
    would open) ends with exit status 2 and one line naming the flag, as do a bad inline JSON,
    a key AcceleratorConfig does not have, transformers' own refusal of ``--fsdp x``, and the
    values torch would refuse only after the model loaded (torch.compile's mode and backend)."""
    from mmembed.tools.cli import main

    monkeypatch.chdir(tmp_path)
    data = write_jsonl(tmp_path / "train.jsonl", stsb_pairs(8))
    base = ["sft", "--model", minilm_path, "--dataset", data, "--output_dir", str(tmp_path / "out"), "--report_to", "none"]
    for flag, value, words in [("--accelerator_config", "x", "JSON file"), ("--accelerator_config", "{bad", "not valid JSON"),
                               ("--accelerator_config", '{"bogus": 1}', "'bogus' is not a setting"),
                               ("--fsdp_config", "x", "JSON file"), ("--fsdp", "x", "x"),
                               ("--dataloader_multiprocessing_context", "x", "fork"),
                               # accepted by transformers' parsing, refused by torch once the model had loaded
                               ("--torch_compile_mode", "x", "max-autotune"), ("--torch_compile_backend", "x", "inductor")]:
        assert main([*base, flag, value]) == 2, (flag, value)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "[transformers]" not in line]
        assert len(lines) == 1 and lines[0].startswith("mmembed sft: error: ") and flag in lines[0] and words in lines[0], lines

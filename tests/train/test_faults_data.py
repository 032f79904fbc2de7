"""Data that is not what it claims: a JSONL line that is not UTF-8 is refused naming the file and
line, a binary `--data` file trains only after a warning naming it, and a `--set` of an unknown
KDA implementation names the field."""

import json
import re
import warnings

import pytest

from train.cli import apply_overrides
from train.corpus import load_text_files
from train.loop import TrainConfig


def test_non_utf8_jsonl_names_the_file_and_line(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(json.dumps({"text": "fine"}).encode() + b'\n{"text": "caf\xe9"}\n')
    message = (re.escape(f"data file '{path}', line 2 is not UTF-8 (byte 0xe9 at column 14)")
               + ".*re-encode")
    with pytest.raises(ValueError, match=message):
        load_text_files([str(path)])


def test_a_binary_data_file_warns_naming_it(tmp_path):
    path = tmp_path / "program.bin"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4)
    message = re.escape(f"data file '{path}' does not look like text "
                        "(it has a NUL byte at offset 7)")
    with pytest.warns(UserWarning, match=message):
        corpus = load_text_files([str(path)])
    assert corpus.num_bytes == path.stat().st_size  # still usable: bytes are the tokens
    text = tmp_path / "notes.txt"
    text.write_text("plain text, caf\u00e9\n", encoding="utf-8")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_text_files([str(text)])  # text files stay silent


def test_unknown_kda_impl_override_names_the_field():
    with pytest.raises(ValueError, match=r"model.kda.impl: KDAConfig.impl must be one of"):
        apply_overrides(TrainConfig(), ["model.kda.impl=foo"])

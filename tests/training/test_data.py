"""Data preparation: deterministic, disjoint split; reproducible tokenizer and token files; round trips."""

import json
import os

import numpy as np
import pytest
import torch

from ddtree.training import data


def test_split_is_deterministic_and_disjoint(tiny_docs):
    train_a, held_a = data.split_documents(tiny_docs, 0.2)
    train_b, held_b = data.split_documents(list(reversed(tiny_docs)), 0.2)
    paths_train, paths_held = {p for p, _ in train_a}, {p for p, _ in held_a}
    assert paths_train.isdisjoint(paths_held)
    assert paths_train | paths_held == {p for p, _ in tiny_docs}
    # a function of the path alone: input order and the other files do not matter
    assert {p for p, _ in held_b} == paths_held
    assert all(data.is_heldout(p, 0.2) for p in paths_held)
    assert held_a, "the tiny corpus should hold out at least one file"


def test_prepare_is_reproducible(tiny_docs, tiny_data, tmp_path):
    again = data.prepare(
        str(tmp_path), vocab_size=320, heldout_fraction=0.2, num_prompts=2, prompt_length=24, docs=tiny_docs
    )
    assert again["sha256"] == tiny_data.manifest["sha256"]


def test_heldout_prompts_come_from_heldout_files(tiny_data):
    with open(os.path.join(tiny_data.directory, "heldout_docs.json")) as handle:
        held = json.load(handle)
    for prompt in tiny_data.prompts:
        assert prompt["path"] in held["paths"]
        assert data.is_heldout(prompt["path"], tiny_data.manifest["heldout_fraction"])
        start, length = held["spans"][prompt["doc"]]
        window = tiny_data.heldout[start + prompt["offset"] : start + prompt["offset"] + len(prompt["ids"])]
        assert window.tolist() == prompt["ids"]
        assert len(prompt["ids"]) == tiny_data.manifest["prompts"]["length"]


def test_tokenizer_round_trips(tiny_data, tiny_docs):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(tiny_data.tokenizer_path)
    samples = [text[:2000] for _, text in tiny_docs[:5]] + ["déjà vu → ∑ 𝔘nicode\t\r\n  tabs", "<|mask|> x"]
    for text in samples:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False).ids, skip_special_tokens=False) == text
    assert [tokenizer.token_to_id(t) for t in data.SPECIAL_TOKENS] == [0, 1, 2]
    hf = data.hf_tokenizer(tiny_data.tokenizer_path)
    assert hf.encode(samples[0], add_special_tokens=False) == tokenizer.encode(samples[0]).ids


def test_streams_and_manifest(tiny_data):
    assert tiny_data.train.dtype == np.uint16 and tiny_data.train.max() < tiny_data.vocab_size
    assert tiny_data.manifest["tokens"]["train"] == tiny_data.train.size
    assert (tiny_data.heldout == tiny_data.eos_id).sum() == tiny_data.manifest["files"]["heldout"]


def test_load_detects_changed_files(tiny_data, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny_data.directory, copy)
    with open(copy / "train.u16", "r+b") as handle:
        handle.write(b"\x07\x00")
    with pytest.raises(ValueError, match="sha256"):
        data.load(str(copy))


def test_windows_are_reproducible(tiny_data):
    a = data.sample_windows(tiny_data.train, 3, 17, torch.Generator().manual_seed(5))
    b = data.sample_windows(tiny_data.train, 3, 17, torch.Generator().manual_seed(5))
    assert a.shape == (3, 17) and torch.equal(a, b)


def test_missing_stdlib_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="--stdlib"):
        data.find_stdlib([str(tmp_path / "nowhere")])

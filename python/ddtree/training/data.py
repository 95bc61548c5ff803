"""Training data: the CPython standard library (sources + the docs it ships), a BPE tokenizer, token streams.

``prepare`` runs once, on the development machine, and writes a small directory
that travels with the GPU command (so the GPU run never depends on which Python
the image happens to ship, nor on ``tokenizers`` trainer details):

    manifest.json     source root, file counts, token counts, sha256 of every file below
    tokenizer.json    byte-level BPE trained on the TRAIN split only
    train.u16         uint16 token ids, documents joined by <|endoftext|>
    heldout.u16       same, held-out documents (never used for training)
    heldout_docs.json [(start, length)] of each held-out document in heldout.u16
    prompts.json      evaluation prompts (token ids), cut from held-out documents

Split: a file is held out iff ``sha256(relative path) mod 1000 < 1000 * heldout_fraction``.
It depends only on the path, so it is deterministic, disjoint by construction and
stable when files are added or removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np

EOS = "<|endoftext|>"
MASK = "<|mask|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (EOS, MASK, PAD)  # ids 0, 1, 2 (the BPE trainer puts specials first)

#: Where a CPython standard library may live. The dev machine's pyenv 3.11 comes first: it is what
#: the shipped data was prepared from; the others let ``prepare`` run on the GPU host if needed.
STDLIB_CANDIDATES = (
    "/root/.pyenv/versions/3.11.7/lib/python3.11",
    "/usr/lib/python3.12",
    "/usr/lib/python3.11",
    "/usr/local/lib/python3.12",
)
TEXT_SUFFIXES = (".py", ".txt", ".rst")
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "lib-dynload", "ensurepip"}
MAX_FILE_BYTES = 1 << 20


def find_stdlib(candidates: Sequence[str] = STDLIB_CANDIDATES) -> str:
    """The first candidate that looks like a CPython stdlib (has os.py and asyncio/); else a clear error."""
    for root in candidates:
        if os.path.isfile(os.path.join(root, "os.py")) and os.path.isdir(os.path.join(root, "asyncio")):
            return root
    raise FileNotFoundError(
        "no CPython standard library found; looked in: "
        + ", ".join(candidates)
        + ". Pass --stdlib PATH (a directory holding os.py) or ship a prepared data directory (--data)."
    )


def iter_documents(root: str) -> Iterable[Tuple[str, str]]:
    """``(relative path, text)`` of every UTF-8 text source under ``root``, in sorted path order.

    Skips third-party / binary folders, files over 1 MiB, and files that do not decode
    as UTF-8 (some test data is deliberately in other encodings).
    """
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS and not d.startswith("config-"))
        for name in sorted(files):
            if not name.endswith(TEXT_SUFFIXES):
                continue
            path = os.path.join(directory, name)
            if os.path.islink(path) or os.path.getsize(path) > MAX_FILE_BYTES:
                continue
            try:
                with open(path, "rb") as handle:
                    text = handle.read().decode("utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if "\x00" in text or not text.strip():
                continue
            yield os.path.relpath(path, root), text


def is_heldout(relative_path: str, heldout_fraction: float) -> bool:
    """Whether a file belongs to the held-out split (a function of its path alone)."""
    digest = int.from_bytes(hashlib.sha256(relative_path.encode()).digest()[:8], "big")
    return digest % 1000 < int(round(1000 * heldout_fraction))


def split_documents(docs: Iterable[Tuple[str, str]], heldout_fraction: float):
    """``(train, heldout)`` lists of ``(path, text)``, each in input order."""
    train, heldout = [], []
    for path, text in docs:
        (heldout if is_heldout(path, heldout_fraction) else train).append((path, text))
    return train, heldout


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` with :data:`SPECIAL_TOKENS` at ids 0..2.

    Byte-level: any text round-trips exactly (no unknown token), which the
    data pipeline and the engine's detokenised outputs rely on.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    for index, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == index, (token, tokenizer.token_to_id(token))
    return tokenizer


def encode_documents(tokenizer, texts: Sequence[str]) -> Tuple[np.ndarray, List[Tuple[int, int]]]:
    """One uint16 stream ``[doc0, EOS, doc1, EOS, ...]`` and each document's ``(start, length)``."""
    eos = tokenizer.token_to_id(EOS)
    encoded = tokenizer.encode_batch(list(texts), add_special_tokens=False)
    pieces, spans, offset = [], [], 0
    for item in encoded:
        ids = np.asarray(item.ids, dtype=np.uint16)
        spans.append((offset, len(ids)))
        pieces.extend([ids, np.asarray([eos], dtype=np.uint16)])
        offset += len(ids) + 1
    stream = np.concatenate(pieces) if pieces else np.zeros(0, np.uint16)
    return stream, spans


def choose_prompts(
    stream: np.ndarray, spans: Sequence[Tuple[int, int]], tokenizer, count: int, length: int, seed: int
) -> List[Dict]:
    """``count`` evaluation prompts of ``length`` tokens from distinct held-out documents.

    Each starts at a line start (a token whose text begins with a newline follows
    it) chosen with ``random.Random(seed)``, and leaves room for a continuation.
    """
    rng = random.Random(seed)
    candidates = [i for i, (_, n) in enumerate(spans) if n >= length + 64]
    rng.shuffle(candidates)
    prompts = []
    for doc in candidates[:count]:
        start, n = spans[doc]
        ids = stream[start : start + n]
        # byte-level BPE spells "\n" as "Ċ": start right after a token that ends a line
        newlines = [i + 1 for i in range(n - length - 1) if tokenizer.id_to_token(int(ids[i])).endswith("Ċ")]
        cut = rng.choice(newlines) if newlines else 0
        prompts.append({"doc": doc, "offset": int(cut), "ids": [int(t) for t in ids[cut : cut + length]]})
    if len(prompts) < count:
        raise ValueError(f"only {len(prompts)} held-out documents are long enough for {count} prompts")
    return prompts


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


DATA_FILES = ("tokenizer.json", "train.u16", "heldout.u16", "heldout_docs.json", "prompts.json")


def prepare(
    out_dir: str,
    stdlib: Optional[str] = None,
    vocab_size: int = 4096,
    heldout_fraction: float = 0.03,
    num_prompts: int = 16,
    prompt_length: int = 96,
    seed: int = 0,
    docs=None,
) -> Dict:
    """Build the data directory (see the module docstring); returns the manifest.

    ``docs``: an iterable of ``(path, text)`` instead of a stdlib scan (tests).
    """
    root = None
    if docs is None:
        root = stdlib or find_stdlib()
        docs = iter_documents(root)
    train, heldout = split_documents(docs, heldout_fraction)
    if not train or not heldout:
        raise ValueError(f"split left {len(train)} train / {len(heldout)} held-out files")
    tokenizer = train_tokenizer((text for _, text in train), vocab_size)
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save(os.path.join(out_dir, "tokenizer.json"))
    train_stream, _ = encode_documents(tokenizer, [t for _, t in train])
    heldout_stream, heldout_spans = encode_documents(tokenizer, [t for _, t in heldout])
    train_stream.tofile(os.path.join(out_dir, "train.u16"))
    heldout_stream.tofile(os.path.join(out_dir, "heldout.u16"))
    with open(os.path.join(out_dir, "heldout_docs.json"), "w") as handle:
        json.dump({"paths": [p for p, _ in heldout], "spans": heldout_spans}, handle)
    prompts = choose_prompts(heldout_stream, heldout_spans, tokenizer, num_prompts, prompt_length, seed)
    for prompt in prompts:
        prompt["path"] = heldout[prompt["doc"]][0]
    with open(os.path.join(out_dir, "prompts.json"), "w") as handle:
        json.dump(prompts, handle)
    manifest = {
        "source": root or "<given documents>",
        "vocab_size": tokenizer.get_vocab_size(),
        "special_tokens": {t: i for i, t in enumerate(SPECIAL_TOKENS)},
        "heldout_fraction": heldout_fraction,
        "files": {"train": len(train), "heldout": len(heldout)},
        "chars": {"train": sum(len(t) for _, t in train), "heldout": sum(len(t) for _, t in heldout)},
        "tokens": {"train": int(train_stream.size), "heldout": int(heldout_stream.size)},
        "prompts": {"count": num_prompts, "length": prompt_length, "seed": seed},
        "sha256": {name: _sha256(os.path.join(out_dir, name)) for name in DATA_FILES},
    }
    with open(os.path.join(out_dir, "manifest.json"), "w") as handle:
        json.dump(manifest, handle, indent=1, sort_keys=True)
    return manifest


@dataclass
class Dataset:
    """A prepared data directory, loaded. ``train``/``heldout``: int64-able uint16 arrays."""

    directory: str
    manifest: Dict
    train: np.ndarray
    heldout: np.ndarray
    prompts: List[Dict]

    @property
    def tokenizer_path(self) -> str:
        return os.path.join(self.directory, "tokenizer.json")

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def eos_id(self) -> int:
        return int(self.manifest["special_tokens"][EOS])

    @property
    def mask_id(self) -> int:
        return int(self.manifest["special_tokens"][MASK])

    @property
    def pad_id(self) -> int:
        return int(self.manifest["special_tokens"][PAD])


def load(directory: str, verify: bool = True) -> Dataset:
    """Load a prepared directory; ``verify`` checks every file's sha256 against the manifest."""
    with open(os.path.join(directory, "manifest.json")) as handle:
        manifest = json.load(handle)
    if verify:
        for name, expected in manifest["sha256"].items():
            actual = _sha256(os.path.join(directory, name))
            if actual != expected:
                raise ValueError(f"{directory}/{name}: sha256 {actual} != manifest {expected} (data changed?)")
    train = np.fromfile(os.path.join(directory, "train.u16"), dtype=np.uint16)
    heldout = np.fromfile(os.path.join(directory, "heldout.u16"), dtype=np.uint16)
    with open(os.path.join(directory, "prompts.json")) as handle:
        prompts = json.load(handle)
    return Dataset(directory, manifest, train, heldout, prompts)


def sample_windows(stream: np.ndarray, batch: int, length: int, generator) -> "torch.Tensor":  # noqa: F821
    """``[batch, length]`` int64 windows at uniformly random starts (``torch.Generator`` -> reproducible)."""
    import torch

    if stream.size < length + 1:
        raise ValueError(f"stream of {stream.size} tokens is shorter than a window of {length}")
    starts = torch.randint(0, stream.size - length + 1, (batch,), generator=generator).numpy()
    rows = np.stack([stream[s : s + length] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


def hf_tokenizer(tokenizer_json: str):
    """The transformers fast tokenizer (what is saved beside the target) for a ``tokenizer.json``."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=tokenizer_json,
        eos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )

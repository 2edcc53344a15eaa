"""Tokenizers: bytes (no files, vocab 256) or any Hugging Face `tokenizers` tokenizer.

Both answer the same small protocol (`encode`, `decode`, `vocab_size`, `eos_id`, `name`,
`describe()` for manifests), so the data pipeline and sampling do not care which one
runs. `train_bpe` trains a byte-level BPE offline: every byte is in its base alphabet, so
any text encodes without an unknown token, and decoding gives back the exact text.

Bits per byte: a loss in nats per token means little across tokenizers; divided by
ln 2 × (bytes per token) it becomes bits per byte of text, which compares.
`token_byte_lengths` gives the UTF-8 length of every token (0 for special tokens), so
`bytes_per_token(tok, targets)` is exact for the very tokens a validation loss averaged.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from zerotrain.data.errors import DataError

EOS_TOKEN = "<|endoftext|>"
_EOS_NAMES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>")


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def describe(self) -> dict[str, Any]: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens. No end-of-text id: documents are joined by a blank line."""

    name = "bytes"
    vocab_size = 256
    eos_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_bytes(self, data: bytes) -> np.ndarray:
        """Raw bytes as tokens (no decode/encode round trip: invalid UTF-8 stays as is)."""
        return np.frombuffer(data, dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        """Bytes -> text; a character cut at the end of a window shows as U+FFFD, never
        as mojibake. Ids >= 256 are not bytes: refused, not wrapped round."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.max() >= 256 or arr.min() < 0):
            bad = int(arr[(arr >= 256) | (arr < 0)][0])
            raise ValueError(f"token id {bad} is not a byte; the byte tokenizer decodes 0..255 "
                             "(limit sampling to the tokenizer's vocabulary)")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")

    def describe(self) -> dict[str, Any]:
        return {"spec": "bytes", "name": self.name, "vocab_size": 256, "eos_id": None}


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise DataError("this tokenizer needs the Hugging Face `tokenizers` package; install "
                        "it with `pip install tokenizers`, or use data.tokenizer bytes") from None
    return tokenizers


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class HFTokenizer:
    """A `tokenizers.Tokenizer` (from tokenizer.json or a local HF tokenizer folder)."""

    def __init__(self, tok: Any, spec: str, eos_id: int | None, sha256: str | None = None):
        self.tok, self.spec, self.eos_id, self.sha256 = tok, spec, eos_id, sha256
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.name = Path(spec).name

    @classmethod
    def from_file(cls, path: str | Path, eos: str | None = None) -> HFTokenizer:
        p = Path(path).expanduser().resolve()
        try:
            tok = _tokenizers().Tokenizer.from_file(str(p))
        except Exception as e:  # the Rust side raises its own exception type
            raise DataError(f"'{p}' is not a tokenizer.json ({e})") from None
        return cls(tok, str(p), _find_eos(tok, eos), _sha256(p))

    @classmethod
    def from_folder(cls, folder: str | Path) -> HFTokenizer:
        d = Path(folder).expanduser().resolve()
        eos = _config_eos(d)
        if (d / "tokenizer.json").is_file():
            t = cls.from_file(d / "tokenizer.json", eos)
            t.spec, t.name = str(d), d.name
            return t
        try:  # other layouts (vocab.json + merges.txt, sentencepiece): let transformers convert
            from transformers import AutoTokenizer
            fast = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
            tok = fast.backend_tokenizer
        except Exception as e:
            raise DataError(f"tokenizer folder '{d}' has no tokenizer.json and transformers "
                            f"could not load it ({e})") from None
        return cls(tok, str(d), _find_eos(tok, eos or fast.eos_token))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.20) skips character offsets: ~1.5x faster
        fn = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)
        return [e.ids for e in fn(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec, "name": self.name, "vocab_size": self.vocab_size,
                "eos_id": self.eos_id, "sha256": self.sha256}


def _config_eos(folder: Path) -> str | None:
    """The eos token a HF tokenizer folder declares (tokenizer_config / special_tokens_map)."""
    for fname in ("tokenizer_config.json", "special_tokens_map.json"):
        f = folder / fname
        if f.is_file():
            eos = json.loads(f.read_text()).get("eos_token")
            if isinstance(eos, dict):
                eos = eos.get("content")
            if isinstance(eos, str):
                return eos
    return None


def _find_eos(tok: Any, declared: str | None) -> int | None:
    for name in ((declared,) if declared else ()) + _EOS_NAMES:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    return None


def load_tokenizer(spec: str) -> Tokenizer:
    """`bytes`, a tokenizer.json file, or a local HF tokenizer folder."""
    if spec == "bytes":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        raise DataError(f"data.tokenizer '{spec}' names a tokenizer to train, not one to load; "
                        "train it with train_bpe (or `zerotrain tokenizer train`) first")
    p = Path(spec).expanduser()
    if p.is_file():
        return HFTokenizer.from_file(p)
    if p.is_dir():
        return HFTokenizer.from_folder(p)
    raise DataError(f"data.tokenizer '{spec}' does not exist; use bytes, a tokenizer.json, a "
                    "local Hugging Face tokenizer folder, or bpe:N")


def train_bpe(texts: Iterable[str], vocab_size: int, out_path: str | Path,
              min_frequency: int = 2) -> HFTokenizer:
    """Train a byte-level BPE of `vocab_size` tokens (256 bytes + <|endoftext|> + merges)
    on an iterable of texts, and write it atomically to `out_path` (tokenizer.json).

    A text with fewer distinct merges (at `min_frequency`) than asked for gives a smaller
    vocabulary: the result's `vocab_size` is the truth, callers compare and say so."""
    if vocab_size < 258:
        raise DataError(f"BPE vocabulary {vocab_size} is too small: 256 byte tokens and "
                        f"{EOS_TOKEN} come first; ask for at least 258")
    tk = _tokenizers()
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = byte_level
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    chars = 0

    def counted() -> Iterable[str]:
        nonlocal chars
        for t in texts:
            chars += len(t)
            yield t

    tok.train_from_iterator(counted(), trainer=trainer)
    if not chars:  # a 257-token "tokenizer" of bytes alone is no tokenizer to train on
        raise DataError("the text to train the BPE tokenizer on is empty; give non-empty "
                        "text files, folders, .jsonl or .parquet")
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tok.save(str(tmp))
    tmp.replace(out)
    return HFTokenizer.from_file(out)


# ----------------------------------------------------------------------------- bits per byte


def token_byte_lengths(tok: Tokenizer) -> np.ndarray:
    """UTF-8 bytes each token id stands for (special tokens: 0), shape (vocab_size,)."""
    if isinstance(tok, ByteTokenizer):
        return np.ones(256, dtype=np.int64)
    assert isinstance(tok, HFTokenizer)
    tk = _tokenizers()
    special = {int(i) for i, t in tok.tok.get_added_tokens_decoder().items() if t.special}
    byte_level = isinstance(tok.tok.decoder, tk.decoders.ByteLevel)
    out = np.zeros(tok.vocab_size, dtype=np.int64)
    for i in range(tok.vocab_size):
        if i in special:
            continue
        piece = tok.tok.id_to_token(i)
        # byte-level tokens spell one byte per character; other schemes: decode the token
        out[i] = len(piece) if byte_level else len(tok.decode([i]).encode("utf-8"))
    return out


def bytes_per_token(tok: Tokenizer, tokens: np.ndarray, lengths: np.ndarray | None = None
                    ) -> float:
    """Mean UTF-8 bytes per token over `tokens` (e.g. the validation targets)."""
    lengths = token_byte_lengths(tok) if lengths is None else lengths
    t = np.asarray(tokens, dtype=np.int64).reshape(-1)
    return float(lengths[t].mean()) if t.size else float("nan")


def bits_per_byte(loss_nats_per_token: float, bytes_per_tok: float) -> float:
    """Mean loss in nats/token -> bits per byte of text."""
    return loss_nats_per_token / (math.log(2) * bytes_per_tok)

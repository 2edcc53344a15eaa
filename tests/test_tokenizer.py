"""Tokenizers: bytes and byte-level BPE round trips, training, folders, bits per byte."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from zerotrain.config import ConfigError, build_config
from zerotrain.data.corpus import DataError
from zerotrain.data.dataset import resolve_tokenizer
from zerotrain.data.tokenizer import (
    EOS_TOKEN,
    ByteTokenizer,
    HFTokenizer,
    bits_per_byte,
    bytes_per_token,
    load_tokenizer,
    token_byte_lengths,
    train_bpe,
)

UNICODE = "def f(x):\n    return x  # ünïcode, 日本語, emoji 🎉, Ωμέγα\n"


def corpus(n: int = 300) -> list[str]:
    """Small but varied training text (no CJK or emoji: those must still round-trip)."""
    words = ["alpha", "beta", "gamma", "delta", "return", "def", "class", "self", "value"]
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(words, 30)) + f" {i}\n    x = {i * 7} + y\n" for i in range(n)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(corpus(), 320, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_bytes_round_trip_and_refusals():
    tok = ByteTokenizer()
    ids = tok.encode(UNICODE)
    assert ids == list(UNICODE.encode("utf-8")) and tok.decode(ids) == UNICODE
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"  # a cut character: no mojibake
    with pytest.raises(ValueError, match="token id 300 is not a byte"):
        tok.decode([65, 300])


def test_trained_bpe_vocab_round_trip_and_readable_decode(bpe):
    assert bpe.vocab_size == 320
    assert bpe.eos_id == bpe.tok.token_to_id(EOS_TOKEN)
    ids = bpe.encode(UNICODE)  # characters never seen in training: bytes of the alphabet
    assert bpe.decode(ids) == UNICODE and max(ids) < 320
    stream = bpe.encode("".join(corpus(20)))
    assert len(stream) < len("".join(corpus(20)).encode()) / 2  # merges were learned
    text = bpe.decode(stream[5:60])  # an arbitrary window decodes to plain text
    assert "Ġ" not in text and "Ċ" not in text and "alpha" in bpe.decode(stream)


def test_bpe_with_transformers_as_reference(bpe, tmp_path):
    import transformers
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=bpe.spec)
    assert ref.encode(UNICODE, add_special_tokens=False) == bpe.encode(UNICODE)
    assert ref.decode(bpe.encode(UNICODE)) == UNICODE


def test_folder_and_specs(bpe, tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "tokenizer.json").write_text(Path(bpe.spec).read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS_TOKEN}))
    tok = load_tokenizer(str(folder))
    assert isinstance(tok, HFTokenizer) and tok.eos_id == bpe.eos_id
    assert tok.encode(UNICODE) == bpe.encode(UNICODE)
    assert tok.describe()["sha256"] == bpe.describe()["sha256"]
    assert isinstance(load_tokenizer("bytes"), ByteTokenizer)
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(DataError, match="names a tokenizer to train"):
        load_tokenizer("bpe:1000")
    with pytest.raises(ConfigError, match="bpe:N with N >= 258"):
        build_config({"data": {"tokenizer": "bpe:12"}})


def test_resolve_bpe_trains_once_into_the_cache(tmp_path):
    src = tmp_path / "text.txt"
    src.write_text("".join(corpus(100)))
    tok = resolve_tokenizer("bpe:300", src, tmp_path / "run")
    path = tmp_path / "run" / "tokenizer.json"
    stamp = path.stat().st_mtime_ns
    again = resolve_tokenizer("bpe:300", src, tmp_path / "run")
    assert path.stat().st_mtime_ns == stamp and again.encode(UNICODE) == tok.encode(UNICODE)
    with pytest.raises(DataError, match=r"has 300 tokens but data\.tokenizer is bpe:400"):
        resolve_tokenizer("bpe:400", src, tmp_path / "run")


def test_byte_lengths_sum_to_the_text_length(bpe):
    """Independent check: the bytes the tokens stand for add up to the UTF-8 length."""
    lengths = token_byte_lengths(bpe)
    assert lengths[bpe.eos_id] == 0
    for text in (UNICODE, "".join(corpus(5))):
        ids = np.array(bpe.encode(text))
        assert lengths[ids].sum() == len(text.encode("utf-8"))
        assert bytes_per_token(bpe, ids) == pytest.approx(len(text.encode()) / len(ids))
    assert bytes_per_token(ByteTokenizer(), np.arange(10)) == 1.0
    # loss ln 2 nats per token at 2 bytes per token = 0.5 bits per byte
    assert bits_per_byte(math.log(2), 2.0) == pytest.approx(0.5)

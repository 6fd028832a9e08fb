"""Training data for the demo and `memeff-jax train`, made or bundled, never downloaded.

- "source": the bytes of this package's own Python files (vocab 256), one document per
  file, packed into rows with segment ids. Real text with real structure, so the loss falls.
- "synthetic": tokens from a fixed random first-order Markov chain over the vocabulary
  (each token has 8 likely successors), one document per row.
"""

from __future__ import annotations

import pathlib

import numpy as np


def source_documents() -> list[bytes]:
  root = pathlib.Path(__file__).resolve().parent.parent
  return [p.read_bytes() for p in sorted(root.rglob("*.py")) if p.stat().st_size > 0]


def packed_batches(batch: int, seq_len: int, *, seed: int = 0):
  """Endless dicts of tokens/labels/segment_ids [batch, seq_len] from the source bytes."""
  docs = source_documents()
  rng = np.random.default_rng(seed)
  stream, seg, doc_id = [], [], 0
  while True:
    while len(stream) < batch * (seq_len + 1):
      doc = docs[int(rng.integers(len(docs)))]
      doc_id += 1
      stream.extend(doc)
      seg.extend([doc_id] * len(doc))
    n = batch * (seq_len + 1)
    toks = np.asarray(stream[:n], np.int32).reshape(batch, seq_len + 1)
    ids = np.asarray(seg[:n], np.int32).reshape(batch, seq_len + 1)
    del stream[:n], seg[:n]
    labels = np.where(ids[:, 1:] == ids[:, :-1], toks[:, 1:], -100)  # no target across documents
    yield dict(tokens=toks[:, :-1], labels=labels.astype(np.int32), segment_ids=ids[:, :-1])


def synthetic_batches(batch: int, seq_len: int, vocab: int, *, seed: int = 0):
  """Endless dicts of tokens/labels from a fixed sparse Markov chain."""
  rng = np.random.default_rng(seed)
  successors = rng.integers(vocab, size=(vocab, 8))
  while True:
    toks = np.empty((batch, seq_len + 1), np.int64)
    toks[:, 0] = rng.integers(vocab, size=batch)
    choice = rng.integers(8, size=(batch, seq_len))
    for t in range(seq_len):
      toks[:, t + 1] = successors[toks[:, t], choice[:, t]]
    toks = toks.astype(np.int32)
    yield dict(tokens=toks[:, :-1], labels=toks[:, 1:])

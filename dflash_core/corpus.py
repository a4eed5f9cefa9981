"""Corpus guesses for a draft tree: what the target itself most often wrote after the same tokens.

Prompt lookup (lookup.py) guesses text that already occurred in this conversation. A small model
also repeats itself *across* conversations: "Here is a Python function that", "Let's break it down
step by step", the same closing lines. So a drafter folder may carry an n-gram table built from
the target's own replies and labels (the training data, `python -m dflash_core.train.corpus`):
for each context of 1-3 tokens, the token the target wrote most often next and how often
(`ngrams.npz`). A guess chains it greedily, longest context first, and joins the tree like a
lookup guess; the target checks it in the same pass as the drafter's candidates, so exactness does
not depend on it.

A guessed token's score is its estimated chance of being the target's next token:
top count / (total count + `PSEUDO_COUNT`). The pseudo count tempers contexts seen only a few
times, which the raw share overrates (measured on SmolLM2's greedy replies: contexts whose top
token had a raw share of 0.3-0.5 were right 17-26 % of the time).

The table is a sorted array of packed contexts: 21 bits per token (vocabularies up to 2M), 3
tokens per key, unused slots filled with `EMPTY`, so a lookup is a binary search and the file
holds no Python objects. It is not a `.safetensors` file, so serving engines that read every
safetensors file of a drafter folder (vLLM, SGLang) never see it.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import DFlashError

FILE_NAME = "ngrams.npz"
ORDER = 3  # longest context; 4 measured no better on held-out replies
BITS = 21
EMPTY = (1 << BITS) - 1  # an unused context slot (never a token id)
MAX_VOCAB = EMPTY
PSEUDO_COUNT = 2.0
MIN_TOTAL = 2  # contexts seen once are left out: a single sighting predicts little
MIN_SCORE = 0.05  # entries less likely than this could never earn a place in a tree
FLOOR = 0.02  # a chain stops where its path score falls below this
SEEN_LIMIT = 1 << 16  # contexts whose answers are kept (a few MB)
_UNSEEN = object()


def pack(context: Iterable[int]) -> int:
    """The key of the last `ORDER` (or fewer) tokens of `context`."""
    key = 0
    tail = list(context)[-ORDER:]
    for tok in [EMPTY] * (ORDER - len(tail)) + tail:
        key = (key << BITS) | tok
    return key


def pack_array(tokens: np.ndarray, n: int) -> np.ndarray:
    """Keys of every length-n context in `tokens`: row t holds the key of tokens[t : t + n]."""
    count = len(tokens) - n + 1
    keys = np.zeros(max(count, 0), dtype=np.uint64)
    if count <= 0:
        return keys
    for slot in range(ORDER):
        j = slot - (ORDER - n)  # which of the n tokens sits in this slot; < 0: an unused slot
        part = np.full(count, EMPTY, dtype=np.uint64) if j < 0 else tokens[j : j + count].astype(np.uint64)
        keys = (keys << np.uint64(BITS)) | part
    return keys


@dataclass
class CorpusNgrams:
    """Sorted context keys, the most frequent next token after each, and that token's score."""

    keys: np.ndarray  # uint64, sorted
    tokens: np.ndarray  # int32
    scores: np.ndarray  # float32
    meta: dict[str, object]
    # Answers already looked up: a block's chains (and the next block's) often walk the same contexts.
    _seen: dict[tuple[int, ...], tuple[int, float] | None] = field(default_factory=dict, init=False, repr=False,
                                                                    compare=False)

    def __len__(self) -> int:
        return len(self.keys)

    def next_token(self, context: list[int]) -> tuple[int, float] | None:
        """(token, score) after the longest of the last 3, 2, 1 tokens the table knows."""
        tail = tuple(context[-ORDER:])
        seen = self._seen.get(tail, _UNSEEN)  # one lookup: another thread may clear the dict meanwhile
        if seen is not _UNSEEN:
            return seen  # type: ignore[return-value]
        if len(self._seen) >= SEEN_LIMIT:
            self._seen.clear()
        hit = None
        for n in range(len(tail), 0, -1):
            key = np.uint64(pack(tail[len(tail) - n :]))
            i = int(self.keys.searchsorted(key))
            if i < len(self.keys) and self.keys[i] == key:
                hit = int(self.tokens[i]), float(self.scores[i])
                break
        self._seen[tail] = hit
        return hit

    def chain(self, context: list[int], length: int, score: float = 1.0,
              power: float = 1.0, floor: float = FLOOR) -> tuple[list[int], list[float]]:
        """Up to `length` guessed tokens after `context`, each the table's choice after the ones
        before it, and their path scores (`score` times the product of the entries' scores, each
        raised to `power`: a calibration, see lookup.py); stops where the path score falls below
        `floor`."""
        ctx = list(context[-ORDER:])
        tokens: list[int] = []
        scores: list[float] = []
        for _ in range(length):
            hit = self.next_token(ctx)
            if hit is None or score * hit[1] ** power < floor:
                break
            score *= hit[1] ** power
            tokens.append(hit[0])
            scores.append(score)
            ctx = [*ctx, hit[0]][-ORDER:]
        return tokens, scores

    def save(self, folder: str | os.PathLike[str]) -> Path:
        path = Path(folder) / FILE_NAME
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, keys=self.keys, tokens=self.tokens, scores=self.scores.astype(np.float16),
                            meta=np.array(json.dumps(self.meta)))
        os.replace(tmp, path)
        return path


def load_corpus(folder: str | os.PathLike[str], vocab_size: int | None = None) -> CorpusNgrams | None:
    """The table in a drafter folder, or None when it has none (or it was built for another
    vocabulary size: its tokens would mean other text)."""
    path = Path(folder) / FILE_NAME
    if not path.is_file():
        return None
    try:
        with np.load(path) as z:
            meta = json.loads(str(z["meta"]))
            table = CorpusNgrams(z["keys"], z["tokens"].astype(np.int32), z["scores"].astype(np.float32), meta)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise DFlashError(f"{path} is not an n-gram table ({type(e).__name__}: {e}); rebuild it with "
                          "python -m dflash_core.train.corpus or delete it") from None
    if vocab_size is not None and meta.get("vocab_size") != vocab_size:
        return None
    return table


def build_corpus(pairs: Iterable[tuple[list[int], list[int], list[int]]], vocab_size: int,
                 meta: dict[str, object] | None = None) -> CorpusNgrams:
    """The table from (prompt ids, text ids, label ids) triples: `labels[i]` is what the target
    wrote (or would write) after prompt + text[:i]. For the target's own replies text and labels
    are the same list; for a dataset answer labelled by the target (train/answers.py) the labels
    are its argmax after each prefix of the answer."""
    if vocab_size > MAX_VOCAB:
        raise ValueError(f"vocabulary of {vocab_size} tokens: the table packs at most {MAX_VOCAB}")
    all_keys: list[np.ndarray] = []
    all_labels: list[np.ndarray] = []
    sequences = 0
    labelled = 0
    for prompt, text, labels in pairs:
        if len(text) != len(labels):
            raise ValueError(f"text of {len(text)} tokens but {len(labels)} labels")
        off = min(ORDER, len(prompt))
        seq = np.asarray([*prompt[len(prompt) - off :], *text], dtype=np.int64)
        lab = np.asarray(labels, dtype=np.int64)
        sequences += 1
        labelled += len(lab)
        for n in range(1, ORDER + 1):
            # context seq[t-n : t] predicts seq[t] = labels[t - off], for t from max(n, off)
            first = max(n, off)
            if first >= len(seq):
                continue
            all_keys.append(pack_array(seq[first - n : len(seq) - 1], n))
            all_labels.append(lab[first - off :])
    info = {"vocab_size": vocab_size, "order": ORDER, "pseudo_count": PSEUDO_COUNT, "min_total": MIN_TOTAL,
            "sequences": sequences, "label_tokens": labelled, **(meta or {})}
    if not all_keys or not sum(len(k) for k in all_keys):
        empty = np.zeros(0, np.uint64)
        return CorpusNgrams(empty, np.zeros(0, np.int32), np.zeros(0, np.float32), {**info, "entries": 0})
    keys = np.concatenate(all_keys)
    labels_arr = np.concatenate(all_labels)
    order = np.lexsort((labels_arr, keys))
    keys, labels_arr = keys[order], labels_arr[order]
    # runs of equal (key, label) pairs -> their counts
    new_pair = np.ones(len(keys), dtype=bool)
    new_pair[1:] = (keys[1:] != keys[:-1]) | (labels_arr[1:] != labels_arr[:-1])
    starts = np.flatnonzero(new_pair)
    pair_keys, pair_labels = keys[starts], labels_arr[starts]
    pair_counts = np.diff(np.append(starts, len(keys)))
    # per key: total count and the most frequent label (ties: the smallest token id)
    new_key = np.ones(len(pair_keys), dtype=bool)
    new_key[1:] = pair_keys[1:] != pair_keys[:-1]
    key_starts = np.flatnonzero(new_key)
    totals = np.add.reduceat(pair_counts, key_starts)
    group = np.cumsum(new_key) - 1
    best = np.lexsort((pair_labels, -pair_counts, group))  # within each key, highest count first
    first_of_group = best[np.flatnonzero(np.r_[True, group[best][1:] != group[best][:-1]])]
    top_counts = pair_counts[first_of_group]
    scores = top_counts / (totals + PSEUDO_COUNT)
    keep = (totals >= MIN_TOTAL) & (scores >= MIN_SCORE)
    info["entries"] = int(keep.sum())
    return CorpusNgrams(pair_keys[key_starts][keep], pair_labels[first_of_group][keep].astype(np.int32),
                        scores[keep].astype(np.float32), info)

"""Build a drafter folder's n-gram table (`ngrams.npz`, see dflash_core/corpus.py) from training data.

    python -m dflash_core.train.corpus --data data/smollm2-sharegpt \\
        --data data/smollm2-sharegpt-answers --out runs/drafter

Regenerated replies (train/data.py) count as written; labelled dataset answers (train/answers.py)
count their labels, the target's argmax after each prefix of the answer. The table must come from
the same target (tokenizer) as the drafter: the vocabulary size is read from the drafter's
config.json and recorded in the table, and the engine ignores a table whose size differs.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterator
from pathlib import Path

from tqdm import tqdm

from ..corpus import FILE_NAME, CorpusNgrams, build_corpus
from ..drafter_io import CONFIG_NAME
from ..errors import DFlashError
from .shards import read_shard, shard_paths


def training_triples(folders: list[str], progress: bool = True) -> Iterator[tuple[list[int], list[int], list[int]]]:
    """(prompt ids, text ids, label ids) of every sample in the data folders."""
    shards = []
    for folder in folders:
        found = shard_paths(folder)
        if not found:
            raise DFlashError(f"{folder}: no data shards (expected the output of train.data or train.answers)")
        shards += found
    for shard in tqdm(shards, desc="n-grams", unit="shard", disable=not progress):
        for s in read_shard(shard):
            text = s["response_ids"]
            yield s["prompt_ids"], text, s.get("greedy_ids", text)


def build_for_drafter(folders: list[str], drafter_dir: str | Path, progress: bool = True) -> CorpusNgrams:
    cfg_path = Path(drafter_dir) / CONFIG_NAME
    if not cfg_path.is_file():
        raise DFlashError(f"{drafter_dir} has no {CONFIG_NAME}: --out must be a drafter folder")
    vocab = int(json.loads(cfg_path.read_text())["vocab_size"])
    table = build_corpus(training_triples(folders, progress), vocab, {"sources": [Path(f).name for f in folders]})
    table.save(drafter_dir)
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_core.train.corpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", action="append", required=True, help="a data folder (repeat for several)")
    ap.add_argument("--out", required=True, help=f"the drafter folder to write {FILE_NAME} into")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        table = build_for_drafter(args.data, args.out, progress=not args.no_progress)
    except DFlashError as e:
        ap.error(str(e))
    m = table.meta
    print(f"[corpus] {len(table):,} contexts from {m['sequences']:,} samples ({m['label_tokens']:,} labels) "
          f"in {time.perf_counter() - t0:.1f} s -> {Path(args.out) / FILE_NAME}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

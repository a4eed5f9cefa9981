"""Corpus guesses (dflash_core/corpus.py): the n-gram table against direct counts, its chains, its
file in a drafter folder, and exactness when its guesses join the trees on the real target."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import numpy as np
import pytest
from conftest import finish
from test_draft_tree import TreeRecordingEngine
from test_sampling_distribution import PROMPT, chi_square_p, exact_distribution, sampled_counts, toy_engine  # noqa: F401

from dflash_core.config import GenerationConfig
from dflash_core.corpus import (
    FILE_NAME,
    FLOOR,
    MIN_SCORE,
    MIN_TOTAL,
    ORDER,
    PSEUDO_COUNT,
    CorpusNgrams,
    build_corpus,
    load_corpus,
    pack,
    pack_array,
)
from dflash_core.draft_tree import grow_tree
from dflash_core.drafter import DFlashDrafter, load_drafter
from dflash_core.engine import Engine
from dflash_core.errors import DFlashError
from dflash_core.lookup import LookupRates, NgramIndex, with_lookup
from dflash_core.targets import Target
from dflash_core.train.corpus import main as corpus_main
from dflash_core.train.shards import encode_shard, write_atomic

Triple = tuple[list[int], list[int], list[int]]


def direct_counts(triples: list[Triple]) -> dict[tuple[int, ...], Counter]:
    counts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for prompt, text, labels in triples:
        seq = prompt + text
        for i, label in enumerate(labels):
            t = len(prompt) + i
            for n in range(1, min(ORDER, t) + 1):
                counts[tuple(seq[t - n : t])][label] += 1
    return counts


def random_triples(seed: int, vocab: int = 12, count: int = 60) -> list[Triple]:
    """Short texts over a small vocabulary, half of them repeating one motif, some with labels
    that differ from the text (as a labelled dataset answer's do)."""
    rng = random.Random(seed)
    motif = [3, 7, 1, 4, 4, 9]
    out = []
    for k in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
        text = motif[: rng.randrange(1, 7)] if k % 2 else [rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
        labels = text if k % 3 else [t if rng.random() < 0.6 else rng.randrange(vocab) for t in text]
        out.append((prompt, text, labels))
    return out


def lookup(table: CorpusNgrams, context: tuple[int, ...]) -> tuple[int, float] | None:
    key = np.uint64(pack(context))
    i = int(table.keys.searchsorted(key))
    return (int(table.tokens[i]), float(table.scores[i])) if i < len(table) and table.keys[i] == key else None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_table_matches_direct_counts(seed: int) -> None:
    triples = random_triples(seed)
    table = build_corpus(triples, vocab_size=12)
    counts = direct_counts(triples)
    kept = 0
    for context, c in counts.items():
        total, top = sum(c.values()), max(c.values())
        token = min(t for t, v in c.items() if v == top)  # ties: the smallest token id
        score = top / (total + PSEUDO_COUNT)
        if total >= MIN_TOTAL and score >= MIN_SCORE:
            kept += 1
            assert lookup(table, context) == (token, pytest.approx(score))
        else:
            assert lookup(table, context) is None
    assert len(table) == kept > 10
    assert list(table.keys) == sorted(table.keys)
    assert table.meta["label_tokens"] == sum(len(t[2]) for t in triples)


def test_packed_keys_agree() -> None:
    tokens = np.array([5, 0, 2**21 - 2, 17, 3])
    for n in range(1, ORDER + 1):
        keys = pack_array(tokens, n)
        assert [int(k) for k in keys] == [pack(tokens[i : i + n].tolist()) for i in range(len(tokens) - n + 1)]
    assert pack([9]) != pack([0, 9]) != pack([0, 0, 9])  # an unused slot is not token 0


def test_chain_takes_the_longest_known_context_and_stops_at_the_floor() -> None:
    # After 2 alone, 5 follows most often; after 1 2, always 6; after 6 and 7, 7 and then 7 again.
    triples = [([], [1, 2, 6, 7], [1, 2, 6, 7])] * 3 + [([], [2, 5], [2, 5])] * 9 + [([], [7, 7, 7], [7, 7, 7])] * 2
    table = build_corpus(triples, vocab_size=10)
    assert table.next_token([2])[0] == 5
    assert table.next_token([9, 1, 2]) == (6, pytest.approx(3 / (3 + PSEUDO_COUNT)))
    tokens, scores = table.chain([4, 1, 2], length=3)
    assert tokens[:2] == [6, 7]
    assert scores == sorted(scores, reverse=True) and scores[0] == pytest.approx(3 / (3 + PSEUDO_COUNT))
    assert all(s >= FLOOR for s in scores)
    long, _ = table.chain([4, 1, 2], length=50)
    short, _ = table.chain([4, 1, 2], length=50, score=0.1)  # a chain below a doubtful node ends sooner
    assert len(short) < len(long) < 50
    assert table.chain([8], length=5) == ([], [])  # 8 never occurred


def test_chain_power_calibrates_each_entry() -> None:
    triples = [([], [1, 2, 6, 7], [1, 2, 6, 7])] * 3 + [([], [7, 7, 7], [7, 7, 7])] * 2
    table = build_corpus(triples, vocab_size=10)
    raw_tokens, raw = table.chain([1, 2], length=3, score=0.5)
    tokens, cal = table.chain([1, 2], length=3, score=0.5, power=1.7)
    assert tokens == raw_tokens[: len(tokens)] and tokens
    for k in range(len(tokens)):  # the path's entries, each raised to the power, under the 0.5 above
        assert cal[k] == pytest.approx(0.5 * (raw[k] / 0.5) ** 1.7)
        assert cal[k] < raw[k]
    assert len(table.chain([1, 2], length=50, power=3.0)[0]) < len(table.chain([1, 2], length=50)[0])


def test_table_file_round_trip(tmp_path) -> None:
    table = build_corpus(random_triples(4), vocab_size=12, meta={"sources": ["toy"]})
    table.save(tmp_path)
    again = load_corpus(tmp_path, vocab_size=12)
    assert again is not None and again.meta["sources"] == ["toy"]
    assert np.array_equal(again.keys, table.keys) and np.array_equal(again.tokens, table.tokens)
    np.testing.assert_allclose(again.scores, table.scores, rtol=1e-3)  # stored as float16
    assert load_corpus(tmp_path, vocab_size=13) is None  # another tokenizer's table is ignored
    assert load_corpus(tmp_path / "missing") is None
    good = (tmp_path / FILE_NAME).read_bytes()
    for damaged in (b"not a table", good[: len(good) // 2]):
        (tmp_path / FILE_NAME).write_bytes(damaged)
        with pytest.raises(DFlashError, match="not an n-gram table"):
            load_corpus(tmp_path)


def test_empty_data_gives_an_empty_table() -> None:
    for triples in ([], [([], [], [])], [([], [5], [5])] * 3):
        table = build_corpus(triples, vocab_size=10)
        assert len(table) == 0 and table.meta["entries"] == 0
        assert table.chain([5], length=4) == ([], [])


def test_two_token_context_is_used_whole() -> None:
    table = build_corpus([([], [1, 2, 3], [1, 2, 3])] * 3 + [([], [7, 2, 4], [7, 2, 4])] * 5, vocab_size=10)
    assert table.next_token([2])[0] == 4 and table.next_token([1, 2])[0] == 3
    assert table.chain([1, 2], length=1)[0] == [3]


def test_bad_vocabulary_and_labels_are_refused() -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        build_corpus([], vocab_size=2**22)
    with pytest.raises(ValueError, match="labels"):
        build_corpus([([1], [2, 3], [2])], vocab_size=10)


def test_corpus_chains_join_the_tree_after_the_anchor_and_the_best_nodes() -> None:
    table = build_corpus([([], [5, 30, 31, 32], [5, 30, 31, 32])] * 4 + [([], [9, 40], [9, 40])] * 4, vocab_size=50)
    tree = grow_tree([[0.6, 0.2], [0.5, 0.1]], [[30, 41], [42, 43]], max_nodes=4, branching=2)
    merged, _ = with_lookup(tree, NgramIndex([1, 2, 9]), LookupRates(), max_depth=4, corpus=table)
    lines = {tuple(merged.tokens[j] for j in merged.path_to(i)) for i in range(len(merged))}
    assert (40,) in lines  # after the anchor 9
    assert (30, 31, 32) in lines  # after the drafter's best node 30
    assert merged.scores == sorted(merged.scores, reverse=True)
    assert all(p < i for i, p in enumerate(merged.parents))
    plain, _ = with_lookup(tree, NgramIndex([1, 2, 9]), LookupRates(), max_depth=4)
    assert len(plain) < len(merged)


def test_build_command_writes_into_the_drafter_folder(tmp_path, random_drafter: DFlashDrafter) -> None:
    folder = tmp_path / "drafter"
    random_drafter.save(folder)
    replies, answers = tmp_path / "replies", tmp_path / "answers"
    reply = {"id": "a", "prompt_ids": [1, 2], "response_ids": [3, 4, 5]}
    answer = {"id": "b", "prompt_ids": [1], "response_ids": [6, 7], "greedy_ids": [8, 9]}
    for data, samples in ((replies, [reply] * 3), (answers, [answer] * 2)):
        data.mkdir()
        write_atomic(data / "shard-00000.jsonl.gz", encode_shard(samples))
    assert corpus_main(["--data", str(replies), "--data", str(answers), "--out", str(folder), "--no-progress"]) == 0
    loaded = load_drafter(folder)
    assert loaded.corpus is not None and (folder / FILE_NAME).is_file()
    assert loaded.corpus.next_token([2]) == (3, pytest.approx(3 / (3 + PSEUDO_COUNT), rel=1e-3))  # float16
    assert loaded.corpus.next_token([6])[0] == 9  # an answer's label, not its text
    assert loaded.corpus.meta["sources"] == ["replies", "answers"]
    with pytest.raises(SystemExit):
        corpus_main(["--data", str(tmp_path / "empty"), "--out", str(folder), "--no-progress"])


PROMPTS = [
    "Write a Python function that returns the largest of three numbers.",
    "Tom has 12 apples and gives away 5. How many are left?",
    "Describe a cat in one sentence.",
]


@pytest.fixture(scope="module")
def plain_replies(target: Target, random_drafter: DFlashDrafter) -> list[list[int]]:
    eng = Engine(target, random_drafter)
    return [finish(eng.generate(p, GenerationConfig(max_new_tokens=48), plain=True)).token_ids for p in PROMPTS]


@pytest.mark.parametrize("block", [4, 16])
def test_memorised_corpus_is_accepted_and_output_is_plain(target: Target, random_drafter: DFlashDrafter,
                                                         plain_replies: list[list[int]], block: int,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A table built from the replies themselves guesses them: long acceptances, same tokens."""
    prompt_ids = [target.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    # Ten sightings each: a table entry scores count / (count + PSEUDO_COUNT), calibrated down
    # (lookup.GUESS_CALIBRATION), and three sightings left its chains too short to outrank the random
    # drafter's confident (probability 1) nodes in a 16-token tree.
    table = build_corpus([(p, r, r) for p, r in zip(prompt_ids, plain_replies, strict=True)] * 10,
                         vocab_size=target.vocab_size)
    cfg = GenerationConfig(max_new_tokens=48, block_size=block, verify="tree")
    engine = TreeRecordingEngine(target, random_drafter)
    taus = {}
    for name, t in (("none", None), ("memorised", table)):
        monkeypatch.setattr(random_drafter, "corpus", t)
        fins = [finish(engine.generate(p, cfg)) for p in PROMPTS]
        assert [f.token_ids for f in fins] == plain_replies
        taus[name] = sum(f.tau * f.blocks for f in fins) / sum(f.blocks for f in fins)
    assert taus["memorised"] > taus["none"] + 1.0


def test_misleading_corpus_keeps_output_plain(target: Target, random_drafter: DFlashDrafter,
                                              plain_replies: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    """A table sure of a wrong token after every token fills the trees with wrong guesses: the
    replies stay the same."""
    keys = np.array(sorted(pack([t]) for t in range(target.vocab_size)), dtype=np.uint64)
    table = CorpusNgrams(keys, np.full(len(keys), 17, np.int32), np.full(len(keys), 0.99, np.float32), {})
    cfg = GenerationConfig(max_new_tokens=48, verify="tree")
    guesses = {}
    for name, t in (("none", None), ("misleading", table)):
        monkeypatch.setattr(random_drafter, "corpus", t)
        guesses[name] = 0
        for prompt, plain in zip(PROMPTS, plain_replies, strict=True):
            events = list(Engine(target, random_drafter).generate(prompt, cfg))
            assert events[-1].token_ids == plain
            guesses[name] += sum(ev.lookup_nodes or 0 for ev in events[1:-1])
    assert guesses["misleading"] > guesses["none"]


def test_corpus_guesses_keep_sampling_exact(toy_engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    engine = toy_engine
    rng = random.Random(1)
    texts = [[rng.randrange(3) for _ in range(30)] for _ in range(20)]
    monkeypatch.setattr(engine.drafter, "corpus", build_corpus([([], t, t) for t in texts], vocab_size=4))
    cfg = GenerationConfig(max_new_tokens=3, temperature=1.0, block_size=3, verify="tree")
    events = list(engine.generate(PROMPT, cfg.with_(max_new_tokens=24)))
    assert sum(ev.lookup_nodes or 0 for ev in events[1:-1]) > 0  # the table's guesses are in the trees
    counts, _ = sampled_counts(engine, cfg)
    assert chi_square_p(counts, exact_distribution(engine.target, cfg)) > 1e-3

"""The tree picture, acceptance by position and the tree in "How it works", on real events of the
embedded target with the shipped drafter: trees with prompt-lookup (and n-gram) nodes, chains,
and sampled blocks of both kinds."""

from __future__ import annotations

import dataclasses
import html
import json
from collections.abc import Iterator

import pytest
from test_render import draft_block, prefill

from app import charts, teach, tree_view
from app.session import Session, survival
from app.tree_view import ACCEPTED, REJECTED, TARGET, UNREACHED, UNVERIFIED, label, picture, tree_figure
from dflash_core.config import GenerationConfig
from dflash_core.engine import Engine
from dflash_core.events import SOURCES, BlockEvent, CandidateTree, Finished, TreeNode
from dflash_core.verify_length import PassCosts, VerifyCost

pytestmark = pytest.mark.slow

# The reply repeats the prompt's words, so prompt lookup has guesses in nearly every block.
PROMPT = "Repeat this list three times: apple, banana, cherry, apple, banana, cherry."
# A pass costs the same for any size: every tree takes its full 2B-1 = 31 candidates.
FLAT = VerifyCost((1, 64), (60.0, 60.0))


def run(engine: Engine, cfg: GenerationConfig, costs: PassCosts | None = None) -> tuple[list[BlockEvent], Finished]:
    with pytest.MonkeyPatch.context() as mp:
        if costs is not None:
            mp.setattr(Engine, "pinned_costs", costs)
        *events, fin = engine.generate(PROMPT, cfg)
    assert isinstance(fin, Finished)
    return events, fin


@pytest.fixture(scope="module")
def replies(app_engine: Engine) -> Iterator[dict[str, tuple[list[BlockEvent], Finished]]]:
    from conftest import PINNED_COSTS

    wide = PassCosts(chain=FLAT, tree=FLAT, draft_ms=8.0)
    yield {
        "tree": run(app_engine, GenerationConfig(max_new_tokens=40, verify="tree"), wide),
        "chain": run(app_engine, GenerationConfig(max_new_tokens=24, verify="adaptive"), PINNED_COSTS),
        "sampled chain": run(app_engine, GenerationConfig(max_new_tokens=24, temperature=0.8, seed=1), PINNED_COSTS),
        "sampled tree": run(app_engine, GenerationConfig(max_new_tokens=24, temperature=0.8, seed=2, verify="tree"),
                            wide),
    }


def draft_blocks(events: list[BlockEvent]) -> list[BlockEvent]:
    return [ev for ev in events if ev.is_draft_block]


def committed_prefix(ev: BlockEvent) -> list[int]:
    return ev.committed[: ev.accepted]


@pytest.mark.parametrize("name", ["tree", "sampled tree"])
def test_tree_events_carry_every_checked_candidate_and_the_walk(replies, app_engine: Engine, name: str) -> None:
    events, _ = replies[name]
    blocks = draft_blocks(events)
    assert blocks and all(ev.tree is not None for ev in blocks)
    target = app_engine.target
    for ev in blocks:
        tree = ev.tree
        assert isinstance(tree, CandidateTree)
        nodes = tree.nodes
        assert len(nodes) == ev.tree_nodes  # exactly what the pass checked
        assert sum(n.source != "drafter" for n in nodes) == ev.lookup_nodes
        for i, n in enumerate(nodes):
            assert n.source in SOURCES
            assert n.parent < i  # best first: parents come first
            assert n.depth == (1 if n.parent < 0 else nodes[n.parent].depth + 1)
            assert n.text == target.token_strings([n.token])[0]
            if n.source == "drafter":  # the drafter's own candidates are among its top-k
                assert n.rank is not None and 0.0 <= n.prob <= 1.0
        # The walk is a path from the anchor, its tokens are the accepted drafts, and the
        # target's own token follows them.
        assert len(tree.walked) == ev.accepted
        assert [nodes[i].parent for i in tree.walked] == [-1, *tree.walked][: len(tree.walked)]
        if len(ev.committed) == ev.accepted + 1:  # not cut short by the end of the reply
            assert [nodes[i].token for i in tree.walked] == committed_prefix(ev)
            assert tree.target_text == ev.committed_text[-1]
        # Plain data only: the event goes to JSON as it is, and stays small.
        assert len(json.dumps(dataclasses.asdict(ev))) < 20_000


def test_greedy_trees_are_large_and_hold_lookup_guesses(replies, app_engine: Engine) -> None:
    blocks = draft_blocks(replies["tree"][0])
    assert max(len(ev.tree.nodes) for ev in blocks) >= 30
    sources = {n.source for ev in blocks for n in ev.tree.nodes}
    assert "lookup" in sources
    if app_engine.drafter.corpus is not None:  # the shipped drafter's n-gram table
        assert "ngram" in sources
    # A guess the drafter did not rank has no drafter probability; one it ranked keeps it.
    guesses = [n for ev in blocks for n in ev.tree.nodes if n.source != "drafter"]
    assert all((n.prob is None) == (n.rank is None) for n in guesses)


def check_picture(ev: BlockEvent) -> tree_view.Picture:
    """The invariants every picture keeps, whatever the block."""
    pic = picture(ev, "x")
    assert pic is not None
    nodes = pic.nodes
    assert pic.count(ACCEPTED) == ev.accepted and pic.count(TARGET) == 1
    own = next(n for n in nodes if n.verdict == TARGET)
    assert own.depth == ev.accepted + 1
    # Row 0 is exactly the committed path: the accepted nodes, then the target's own token.
    top = sorted((n.depth, n.verdict) for n in nodes if n.row == 0)
    assert top == [*((d, ACCEPTED) for d in range(1, ev.accepted + 1)), (ev.accepted + 1, TARGET)]
    assert len({(n.depth, n.row) for n in nodes}) == len(nodes)  # no two nodes on one spot
    for n in nodes:
        parent = nodes[n.parent] if n.parent >= 0 else None
        assert n.depth == (parent.depth if parent else 0) + 1
        assert n.row >= (parent.row if parent else 0)  # branches hang below, never above
        walked_parent = parent is None or parent.verdict == ACCEPTED
        if n.verdict == REJECTED:
            assert walked_parent
        if n.verdict == UNREACHED:
            assert not walked_parent
    assert pic.rows == max(n.row for n in nodes) + 1
    return pic


def node_traces(fig) -> list:
    """The traces of the tree's nodes, one per verdict (not the legend's markers, the edges or the anchor)."""
    names = {name for name, _ in tree_view.VERDICTS.values()}
    return [t for t in fig.data if t.name in names and t.x[0] is not None]


def check_figure(ev: BlockEvent, pic: tree_view.Picture) -> None:
    fig = tree_figure(ev, "x")
    names = {t.name for t in fig.data}
    drawn = {v for v in (ACCEPTED, REJECTED, UNREACHED, UNVERIFIED, TARGET) if pic.count(v)}
    for verdict in drawn:
        assert tree_view.VERDICTS[verdict][0] in names
    points = sum(len(t.x) for t in node_traces(fig))
    assert points == len(pic.nodes)  # every node drawn once
    # Readable however large: one fixed pixel height per row, labels cut short.
    margin = fig.layout.margin
    assert (fig.layout.height - margin.t - margin.b) / (pic.rows + 0.4) >= tree_view.ROW_PX - 1
    assert all(len(html.unescape(label(n.text))) <= tree_view.MAX_LABEL for n in pic.nodes)
    assert fig.layout.title.text.startswith(f"Block {ev.index} · a {pic.kind}")


@pytest.mark.parametrize("name", ["tree", "chain", "sampled chain", "sampled tree"])
def test_every_block_of_every_mode_draws_as_a_tree(replies, name: str) -> None:
    events, _ = replies[name]
    kinds = set()
    for ev in draft_blocks(events):
        pic = check_picture(ev)
        check_figure(ev, pic)
        kinds.add(pic.kind)
    assert kinds == ({"tree"} if "tree" in name else {"chain"})


def test_a_large_tree_block_draws_every_candidate_with_its_origin(replies) -> None:
    events, _ = replies["tree"]
    ev = max(draft_blocks(events), key=lambda e: (sum(n.source != "drafter" for n in e.tree.nodes), len(e.tree.nodes)))
    pic = check_picture(ev)
    assert len(pic.candidates) >= 30 and pic.rows >= 3
    fig = tree_figure(ev, tree_view.anchor_text(events, ev))
    symbols = [s for t in node_traces(fig) for s in t.marker.symbol]
    by_source = {n.source for n in pic.candidates}
    assert ("square" in symbols) == ("lookup" in by_source) and ("triangle-up" in symbols) == ("ngram" in by_source)
    assert "lookup" in by_source or "ngram" in by_source
    # Hover: the drafter's rank and probability, and for a rejected node what the target chose there.
    hovers = [h for t in fig.data if t.hovertext for h in t.hovertext]
    assert any("the drafter's first choice here, p = " in h for h in hovers)
    rejected = [h for h in hovers if "rejected: the target chose" in h]
    assert len(rejected) == pic.count(REJECTED)
    # The anchor is the previous block's last committed token.
    before = next(e for e in events if e.index == ev.index - 1)
    assert fig.data[[t.name for t in fig.data].index("anchor")].text[0] == label(before.committed_text[-1])


def test_chain_verdicts_follow_accepted_and_verified(replies) -> None:
    events, _ = replies["chain"]
    blocks = draft_blocks(events)
    assert any(ev.unverified for ev in blocks)  # the adaptive verify length left drafts unchecked
    for ev in blocks:
        pic = picture(ev)
        assert ev.tree is None and pic.kind == "chain"
        verdicts = [n.verdict for n in pic.candidates]
        assert verdicts[: ev.accepted] == [ACCEPTED] * ev.accepted
        assert verdicts.count(UNVERIFIED) == len(ev.unverified)
        assert verdicts.count(REJECTED) == (1 if ev.accepted < ev.checked else 0)
        assert [n.prob for n in pic.candidates] == pytest.approx(ev.steps[-1].probs)


def test_acceptance_by_position_over_a_reply_and_the_conversation(replies) -> None:
    s = Session()
    for name in ("chain", "tree"):
        events, fin = replies[name]
        s.begin(name)
        for ev in events:
            s.on_event(ev)
        s.finish(fin)
    reply, everything = s.dflash.draft_blocks, s.all_draft_blocks
    assert len(everything) == len(reply) + len(draft_blocks(replies["chain"][0]))
    fig = charts.position_figure(reply, everything)
    bars, line = fig.data
    assert bars.type == "bar" and line.type == "scatter"
    positions = max(b.block_size for b in everything) - 1
    assert list(bars.x) == list(range(1, positions + 1))
    for k, rate in zip(bars.x, bars.y, strict=True):
        assert rate == pytest.approx(sum(b.accepted >= k for b in reply) / len(reply))
    assert list(bars.y) == sorted(bars.y, reverse=True)  # a draft survives to k only through k-1
    assert 1 + sum(bars.y) == pytest.approx(s.dflash.tau)  # the bars add up to τ − 1
    assert f"τ = {s.dflash.tau:.2f}" in fig.layout.title.text
    assert list(line.y) == pytest.approx([k / len(everything) for k in survival(everything, positions)])
    s.reset()
    assert s.all_draft_blocks == [] and len(charts.position_figure([], []).data) == 0


def test_how_it_works_tells_the_tree_on_a_real_tree_block(replies) -> None:
    events, _ = replies["tree"]
    ev = teach.pick_tree_block(events)
    assert ev is not None and ev.tree is not None and teach.tree_example(events) is ev
    text = teach.tree_markdown(events)
    assert f"A tree, on your block {ev.index}" in text
    assert f"**{len(ev.tree.nodes)} candidates in one forward pass**" in text
    assert f"{ev.accepted + 1} tokens for one target forward" in text or ev.accepted == 0
    kept = teach.chain_kept(ev)
    assert 0 <= kept <= ev.accepted
    # The chain comparison is claimed only when the walk left the drafter's first choices.
    claim = "A chain of the drafter's first choices would have kept only"
    assert (claim in text) == (kept < ev.accepted)
    if kept < ev.accepted:
        assert ev.tree.nodes[ev.tree.walked[kept]].rank != 0
    # Chains only (sampling): told as chains, and the picture is one of the reply's blocks.
    chain_events, _ = replies["sampled chain"]
    assert "verified **chains**" in teach.tree_markdown(chain_events, greedy=False)
    assert teach.tree_example(chain_events) in chain_events


def test_blocks_without_a_draft_and_hostile_tokens() -> None:
    assert picture(prefill("P")) is None and picture(None) is None
    assert "no draft" in tree_figure(prefill("P")).layout.annotations[0].text
    ev = draft_block(1, 11, ["<b>x</b>", "&", "c"], accepted=0, target_text="<br>", tokens_before=1)
    fig = tree_figure(ev)
    texts = [t for tr in fig.data if tr.text for t in tr.text] + [h for tr in fig.data if tr.hovertext
                                                                   for h in tr.hovertext]
    assert not any("<b>x" in t or t == "<br>" for t in texts)  # tags in tokens are shown, not obeyed
    assert "&lt;b&gt;x&lt;/b&gt;" in texts and "&lt;br&gt;" in texts
    assert teach._plural(2, "prompt-lookup guess") == "2 prompt-lookup guesses"


def test_a_walk_that_accepts_nothing_puts_the_targets_token_first() -> None:
    ev = draft_block(1, 11, ["a", "b"], accepted=0, target_text="Z", tokens_before=1)
    nodes = [TreeNode(-1, 1, 1, "a", "drafter", 0.5, 0.6, 0), TreeNode(-1, 1, 2, "q", "lookup", 0.4),
             TreeNode(0, 2, 3, "b", "drafter", 0.3, 0.7, 0)]
    assert ev.tree is None  # a plain step: drawn as a chain
    ev.tree = CandidateTree(nodes, [], "Z")
    pic = check_picture(ev)
    rows = {n.text: (n.row, n.verdict) for n in pic.nodes}
    assert rows == {"Z": (0, TARGET), "a": (1, REJECTED), "b": (1, UNREACHED), "q": (2, REJECTED)}
    assert "correction" in next(h for t in tree_figure(ev).data if t.name == tree_view.VERDICTS[TARGET][0]
                                for h in t.hovertext)


def test_tree_nodes_remember_which_guess_proposed_them() -> None:
    from dflash_core.draft_tree import add_chain, grow_tree

    tree = grow_tree([[0.6, 0.3], [0.5, 0.4]], [[10, 11], [20, 21]], max_nodes=3)
    merged = add_chain(add_chain(tree, [10, 22], [0.9, 0.8]), [12, 23], [0.7, 0.5], source="ngram")
    by_token = {t: merged.source(i) for i, t in enumerate(merged.tokens)}
    assert by_token[10] == "drafter"  # a guess that agreed with the drafter stays the drafter's node
    assert by_token[22] == "lookup" and by_token[12] == "ngram" and by_token[23] == "ngram"
    small = merged.prefix(len(merged) - 1)
    assert [small.source(i) for i in range(len(small))] == [merged.source(i) for i in range(len(small))]

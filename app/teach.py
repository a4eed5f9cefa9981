"""The "How it works" tab: the draft → verify → accept cycle, told on the visitor's own reply.

Everything here is derived from the engine's events (plain data), so the explanation can
never drift from what actually happened: the blocks quoted are real blocks of the last reply.
Output is Markdown with a little inline HTML (coloured token chips, same classes as the
Speculation view); token text is escaped for both HTML and Markdown.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from dflash_core.events import BlockEvent, CandidateTree, TreeNode

from .render import ACCEPTED, REJECTED, TARGET, visible
from .session import RunStats, Session
from .tree_view import REJECTED as REJECTED_NODE
from .tree_view import UNREACHED as UNREACHED_NODE
from .tree_view import Picture, anchor_text, picture

MAX_EXAMPLES = 3  # blocks quoted from the reply: enough to show the pattern, short enough to read
# Markdown syntax characters as HTML entities: a token "**" must show as two stars, not start bold.
_MD_ENTITIES = str.maketrans({c: f"&#{ord(c)};" for c in "*_`[]\\$~|#!"})

GENERIC = """\
### The cycle: draft → verify → accept

1. **Draft.** A small *drafter* looks at the target's hidden states for everything written so far and proposes \
the next **B−1 tokens at once**, in one parallel denoising pass (a block-diffusion model: every position of the \
block is predicted together, optionally refined over a few denoising steps).
2. **Verify.** The big *target* model runs the whole block — the last committed token plus the B−1 drafts — in \
**one forward pass**, which tells it what it would have written at every position.
3. **Accept.** The longest prefix of drafts the target agrees with is kept, plus **one token of the target's \
own**: a *correction* at the first disagreement, or a *bonus* token when the whole block was accepted. So every \
target forward commits at least one token, and up to B.

**Lossless.** At temperature 0 the target keeps a draft only if it equals its own greedy choice, so the reply is \
*token for token identical* to plain greedy decoding. When sampling, draft token x (drawn from the drafter's q) \
is kept with probability min(1, p(x)/q(x)); at the first rejection a token is drawn from the normalised \
max(0, p − q). Every committed token then follows the target's distribution p *exactly*: same distribution as \
plain sampling (not the same sample).

**τ (tau)** is the mean number of tokens committed per target forward: accepted drafts + 1, averaged over the \
draft blocks. Plain decoding has τ = 1.

**Speed-up ≈ τ × t(1 token) / (t(block) + t(draft)).** Plain decoding pays one target forward, t(1 token), per \
token. DFlash pays one draft pass t(draft) plus one forward over the whole block t(block) per cycle, and gets τ \
tokens for it. On a GPU a forward over 16 tokens costs barely more than over one (it is memory-bound), and the \
drafter is small and drafts in one pass, so a high τ turns almost directly into speed. With a drafter that \
guesses badly, τ ≈ 1 and the extra draft and block costs make DFlash *slower* than plain decoding.

**Adaptive verify length.** On a CPU t(block) grows with the block, so the engine (verify length *auto* or \
*adaptive*) sends the target only the drafts worth checking: the prefix that maximises expected tokens per \
second, judged from the drafter's own confidence and the target's measured pass times. The output is the same; \
drafts past that prefix show as *not verified*.

**Tree verification** (verify length *tree* or *tree-full*). The drafter predicts every position at once, so \
it has a second and third guess at each position too. A tree spends the verify pass on the likeliest \
alternatives: each candidate sits at its own position and sees only its own ancestors, the target's choice at \
every candidate says which branch to follow, and only the accepted branch is kept. More tokens per target \
forward for the same pass size, and still lossless: every kept token is the target's own choice (or, when \
sampling, its own draw). The Studio's tree picture shows every candidate of a block and the branch the target \
walked. Trees also take *prompt-lookup* \
guesses: after the last few committed tokens, whatever followed them the last time they occurred (code repeats \
names, maths repeats numbers), and, when the drafter ships an n-gram table of the target's own replies, what \
the target most often wrote after the same tokens. They cost no model, and the target checks them in the same pass.

**Acceptance by position.** The share of blocks whose draft survived to position k: the diagnostic serving \
engines log for speculative decoding. It can only fall with k, since a draft counts only when every draft before \
it was accepted too, and 1 + the sum of the bars is τ. A drafter that is good at position 1 but falls off fast \
gains little from long blocks.
"""

BEFORE_REPLY = "\n*Ask something in the Studio tab: this page then walks through your own reply, block by block.*\n"


def shown(text: str) -> str:
    """A token with its whitespace made visible, so " the" and "the" read differently."""
    return visible(text.replace(" ", "·").replace("\n", "↵").replace("\t", "⇥")) or "∅"


def chip(text: str, cls: str) -> str:
    """A coloured token, safe inside Markdown: HTML-escaped, then Markdown syntax neutralised."""
    return f'<span class="tok {cls}">{html.escape(shown(text), quote=True).translate(_MD_ENTITIES)}</span>'


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('s') else 's'}"


def _kind(ev: BlockEvent) -> str:
    return "bonus" if ev.accepted == ev.checked else ("none" if ev.accepted == 0 else "correction")


def pick_examples(events: Sequence[BlockEvent], limit: int = MAX_EXAMPLES) -> list[BlockEvent]:
    """Representative draft blocks, in reply order: the best one, then one of each other outcome
    (a correction, a bonus, nothing accepted) that occurred; at least two when there are two."""
    blocks = [ev for ev in events if ev.is_draft_block]
    if not blocks:
        return []
    chosen = [max(blocks, key=lambda ev: (ev.accepted, -ev.index))]  # the most accepted, earliest on ties
    for kind in ("correction", "bonus", "none"):
        if kind not in {_kind(ev) for ev in chosen}:
            chosen += [ev for ev in blocks if _kind(ev) == kind][:1]
    if len(chosen) < 2:  # all blocks alike (e.g. an untrained drafter): one more, to show the pattern
        chosen += [ev for ev in blocks if ev not in chosen][:1]
    return sorted(chosen[:limit], key=lambda ev: ev.index)


def describe_block(ev: BlockEvent, greedy: bool = True) -> str:
    """One sentence on one real block: what was drafted, what the target kept, what got committed."""
    n, acc = ev.checked, ev.accepted  # the drafts the target checked (all, unless the verify length adapted)
    agree = "agreed with" if greedy else "accepted (by the min(1, p/q) test)"
    target_tok = ev.committed_text[-1] if ev.committed_text else "?"
    drafted = " ".join(chip(t, ACCEPTED if i < acc else REJECTED) for i, t in enumerate(ev.draft_text[:n]))
    head = f"In **block {ev.index}** the drafter proposed {drafted}"
    if ev.tree_nodes is not None:  # `draft` is the walked branch of a tree; the rest is in the picture
        head += f" along the branch the target walked through a tree of {_plural(ev.tree_nodes, 'candidate')}"
    elif ev.unverified:
        head += (f" (and {_plural(len(ev.unverified), 'more draft')} it was unsure of: with the adaptive verify "
                 "length the target did not check those)")
    if acc == n:
        verdict = (f"the target {agree} all {n} and added a bonus token {chip(target_tok, TARGET)}")
    elif acc == 0:
        verdict = (f"the target disagreed at the very first position and wrote {chip(target_tok, TARGET)} there "
                   f"instead of {chip(ev.draft_text[0] if ev.draft_text else '?', REJECTED)}; the other "
                   f"{_plural(n - 1, 'draft')} after it were dropped")
        if n == 1:
            verdict = verdict.split("; the other")[0]
    else:
        rejected = ev.draft_text[acc] if acc < len(ev.draft_text) else "?"
        ordinal = _ordinal(acc + 1)
        verdict = (f"the target {agree} the first {acc}, replaced the {ordinal} ({chip(rejected, REJECTED)}) with "
                   f"{chip(target_tok, TARGET)}")
        if acc + 1 < n:
            verdict += f" and dropped the {_plural(n - acc - 1, 'draft')} after it"
    k = len(ev.committed)
    tail = f"so **{_plural(k, 'token')} {'was' if k == 1 else 'were'} committed for one target forward**"
    if k != acc + 1:  # the reply ended inside the block (EOS, length, stop string)
        tail += " (the reply ended inside this block)"
    return f"{head}; {verdict}, {tail}."


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def speed_paragraph(dflash: RunStats, plain: RunStats | None) -> str:
    """The speed-up formula with this reply's measured times filled in."""
    blocks = dflash.draft_blocks
    if not blocks:
        return ""
    t_draft = _mean([b.draft_ms for b in blocks])
    t_block = _mean([b.verify_ms for b in blocks])
    text = (f"**Speed.** Here one cycle cost t(draft) = {t_draft:.1f} ms plus t(block) = {t_block:.1f} ms "
            f"for τ = {dflash.tau:.2f} tokens.")
    singles = [b.verify_ms for b in (plain.blocks if plain is not None else []) if b.index > 0]
    if singles:
        t_one = _mean(singles)
        estimate = dflash.tau * t_one / (t_block + t_draft) if t_block + t_draft > 0 else 0.0
        text += (f" Plain decoding took t(1 token) = {t_one:.1f} ms per token, so the expected speed-up is "
                 f"{dflash.tau:.2f} × {t_one:.1f} / ({t_block:.1f} + {t_draft:.1f}) ≈ **{estimate:.2f}×**")
        if plain is not None and plain.finished is not None and plain.tokens_per_s > 0:
            text += f" (measured on the whole reply, prefill included: {dflash.tokens_per_s / plain.tokens_per_s:.2f}×)"
        text += "."
    else:
        text += (" Tick *race plain decoding* to measure t(1 token) as well and see the estimated "
                 "speed-up τ × t(1 token) / (t(block) + t(draft)) for this reply.")
    return text


def reply_markdown(session: Session) -> str:
    """The cycle told on the session's latest reply (streamed or stepped, finished or not)."""
    events = session.events
    blocks = [ev for ev in events if ev.is_draft_block]
    if not blocks:
        return ""
    d = session.dflash
    lines = ["### Your last reply, block by block", ""]
    first = next((ev for ev in events if ev.index == 0), None)
    if first is not None and first.committed_text:
        lines.append(f"Reading the prompt (the *prefill*), the target chose the first token "
                     f"{chip(first.committed_text[0], TARGET)} itself. Then came {_plural(len(blocks), 'block')}, "
                     f"τ = **{d.tau:.2f}** tokens per target forward. Some of them:")
        lines.append("")
    for ev in pick_examples(events):
        lines.append(f"- {describe_block(ev, session.greedy)}")
    lines.append("")
    fin = d.finished
    if session.greedy:
        claim = "This reply is token for token what plain greedy decoding of the target writes"
        p = session.plain
        if fin is not None and p is not None and p.finished is not None and p.finished.reason != "cancelled":
            claim += (" — checked: the comparison run produced the identical tokens ✓"
                      if p.finished.token_ids == fin.token_ids else " — but the comparison run DIFFERS ✗")
        lines.append(claim + ".")
    else:
        lines.append("This reply was sampled: every token follows exactly the target's own distribution "
                     "(same distribution as plain sampling, not the same sample).")
    lines.append("")
    lines.append(speed_paragraph(d, session.plain))
    return "\n".join(lines)


def chain_kept(ev: BlockEvent) -> int:
    """Of a greedy tree block's accepted tokens, how many a chain of the drafter's first choices
    would have kept: the walk's leading nodes that were its first choice at their position."""
    tree = ev.tree
    if tree is None:
        return ev.accepted
    kept = 0
    for i in tree.walked:
        if tree.nodes[i].rank != 0:
            break
        kept += 1
    return kept


def pick_tree_block(events: Sequence[BlockEvent]) -> BlockEvent | None:
    """The block the tree is told on: where the tree beat a chain most, then the most accepted,
    then the most guesses and candidates (the earliest on ties); None without a tree block."""

    def merit(ev: BlockEvent) -> tuple[int, ...]:
        nodes = ev.tree.nodes if ev.tree is not None else []
        guesses = sum(n.source != "drafter" for n in nodes)
        return ev.accepted - chain_kept(ev), ev.accepted, guesses, len(nodes), -ev.index

    trees = [ev for ev in events if ev.tree is not None and ev.tree.nodes]
    return max(trees, key=merit) if trees else None


def tree_example(events: Sequence[BlockEvent]) -> BlockEvent | None:
    """The block the tab pictures: a tree block when the reply had one, else its best chain."""
    examples = pick_examples(events)
    return pick_tree_block(events) or (examples[0] if examples else None)


def _origin(node: TreeNode) -> str:
    if node.source == "lookup":
        return "a prompt-lookup guess"
    if node.source == "ngram":
        return "a guess from the n-gram table"
    return "the drafter's first choice" if node.rank == 0 else f"the drafter's {_ordinal((node.rank or 0) + 1)} choice"


def _sources(pic: Picture) -> str:
    parts = [f"the drafter's likeliest tokens at each position ({_plural(pic.guesses('drafter'), 'circle')})"]
    if pic.guesses("lookup"):
        parts.append(f"{_plural(pic.guesses('lookup'), 'prompt-lookup guess')} (squares: what followed the same "
                     "tokens earlier in the text)")
    if pic.guesses("ngram"):
        parts.append(f"{_plural(pic.guesses('ngram'), 'guess')} from the drafter's n-gram table (triangles)")
    return ", ".join(parts)


def _walk(pic: Picture, tree: CandidateTree) -> str:
    """The target's path through the tree, in words."""
    own = chip(tree.target_text, TARGET)
    last = tree.walked[-1] if tree.walked else -1
    beside = sum(n.verdict == REJECTED_NODE and n.parent == last for n in pic.nodes)
    if not tree.walked:
        return f"The target agreed with no candidate at position 1 and wrote its own token {own} there"
    path = " → ".join(f"{chip(tree.nodes[i].text, ACCEPTED)} ({_origin(tree.nodes[i])})" for i in tree.walked)
    if beside:
        others = ("the one candidate there did not match" if beside == 1
                  else f"none of the {beside} candidates there matched")
        return f"From the anchor it walked {path}, then wrote its own token {own}, a correction, where {others}"
    return f"From the anchor it walked {path}, then added its own token {own}, a bonus, after the branch's last node"


def tree_markdown(events: Sequence[BlockEvent], greedy: bool = True) -> str:
    """The tree told on one of the reply's own tree blocks (`pick_tree_block`), for the picture below it."""
    ev = pick_tree_block(events)
    pic = picture(ev, anchor_text(events, ev)) if ev is not None else None
    if ev is None or ev.tree is None or pic is None:
        chain = tree_example(events)
        if chain is None:
            return ""
        return (f"### The block as a picture\n\nThis reply verified **chains**, so block {chain.index} is drawn "
                "below as a one-branch tree. With verify length *tree* (or *auto* when greedy on a CPU) the target "
                "checks a whole tree of alternatives per block instead; hybrid targets verify chains only.")
    text = (f"In block {ev.index} the target checked **{_plural(len(ev.tree.nodes), 'candidate')} in one forward "
            f"pass** (pictured below): {_sources(pic)}. Each candidate sits at its own block position and sees only "
            "the committed text and its own ancestors, so the one pass tells the target what it would write after "
            f"every candidate at once. {_walk(pic, ev.tree)}: **{_plural(ev.accepted + 1, 'token')} for one target "
            "forward**.")
    kept = chain_kept(ev)
    if greedy and ev.accepted > kept:
        text += (f" A chain of the drafter's first choices would have kept only {kept} of the {ev.accepted} "
                 "accepted here: the tree found the branch the target wanted.")
    rejected, unreached = pic.count(REJECTED_NODE), pic.count(UNREACHED_NODE)
    if rejected:
        text += (f" The {_plural(rejected, 'red node')} {'was' if rejected == 1 else 'were'} rejected: the target "
                 "chose another token after the parent.")
    if unreached:
        text += (f" The {_plural(unreached, 'grey node')} {'hangs' if unreached == 1 else 'hang'} below rejected "
                 "ones: the target never got there, so the verdicts there never counted.")
    return f"### A tree, on your block {ev.index}\n\n{text}"


def reply_page(session: Session | None) -> str:
    """The tab's first part: the visitor's own reply and its tree (the picture follows it), or a
    note to ask something first. The general explanation, GENERIC, comes after the picture."""
    own = reply_markdown(session) if session is not None else ""
    if not own:
        return "## How it works\n\n" + BEFORE_REPLY
    assert session is not None
    return ("## How it works\n\n" + own + selector_markdown(session.events) + "\n\n"
            + tree_markdown(session.events, session.greedy))


def selector_markdown(events: Sequence[BlockEvent]) -> str:
    """DFlash 2 drafters: the candidate selector, on the visitor's drafted block that kept most."""
    blocks = [ev for ev in events if ev.selector]
    if not blocks:
        return ""
    ev = max(blocks, key=lambda e: (e.accepted, -e.index))
    steps = []
    for i, choice in enumerate(ev.selector[:3]):  # type: ignore[index]
        options = ", ".join(f"{chip(t, 'tok-candidate')} {p:.2f}" for t, p in
                            list(zip(choice.texts, choice.probs, strict=True))[:3])
        before = "the anchor" if i == 0 else f"its choice at position {i}"
        picked = choice.texts[choice.chosen] if 0 <= choice.chosen < len(choice.texts) else "?"
        steps.append(f"- position {i + 1}, after {before}: {options} → chose **{chip(picked, 'tok-candidate')}**")
    return (f"\n\n### The candidate selector (DFlash 2), on your block {ev.index}\n\n"
            "A DFlash 2 drafter still predicts every position of the block in one parallel pass, but it does "
            "not simply take each position's likeliest token: those guesses are made side by side, blind to "
            "one another, so they can clash (\"of of\", \"the a\"). Its selector walks the block left to "
            "right instead, rescoring each position's top candidates with a small learnt term that pairs "
            "the token it just chose with each candidate, and keeps the best. On your block:\n\n"
            + "\n".join(steps) + "\n\nThe numbers are the selector's probabilities; the target then "
            "verifies the chosen path exactly as before, so the reply is unchanged.")


def explain(session: Session | None) -> str:
    """The whole tab as text: the visitor's own reply first (when there is one), then the general explanation."""
    return reply_page(session) + "\n\n---\n\n" + GENERIC

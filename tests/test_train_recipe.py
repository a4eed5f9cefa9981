"""The training recipe: anchors, the block-sparse mask, the loss, and train/inference equality."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_core.drafter import DFlashDrafter, init_weights
from dflash_core.drafter_config import DFlashConfig, config_for_target
from dflash_core.train.batch import BatchOutput
from dflash_core.train.recipe import (
    IGNORE,
    block_attention_mask,
    build_blocks,
    default_gamma,
    position_weights,
    sample_anchors,
)

H, B, VOCAB, MASK = 32, 4, 50, 49


def tiny_drafter(seed: int = 0, layers: int = 2) -> DFlashDrafter:
    # GQA (4 query heads, 2 kv heads) so the head repetition path is exercised too.
    cfg = DFlashConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, num_target_layers=6,
                       target_layer_ids=[1, 4], mask_token_id=MASK, block_size=B, rope_theta=10_000.0)
    return init_weights(DFlashDrafter(cfg), std=0.2, seed=seed).eval()


def run_blocks(drafter: DFlashDrafter, embed: torch.nn.Embedding, feats: torch.Tensor, ids: torch.Tensor,
               anchors: list[int]) -> tuple[torch.Tensor, object]:
    bb = build_blocks(ids, anchors, drafter.block_size, drafter.mask_token_id)
    out = drafter.forward_train(feats[:, : bb.context_len], embed(bb.input_ids)[None], bb.positions, bb.mask)
    return out[0].reshape(len(anchors), drafter.block_size, -1), bb


# ----- anchors -----

def test_anchors_stay_inside_the_response() -> None:
    g = torch.Generator().manual_seed(0)
    for prompt_len, seq_len, n in [(5, 40, 6), (10, 12, 6), (3, 5, 1), (7, 30, 100)]:
        for _ in range(50):
            a = sample_anchors(prompt_len, seq_len, n, g)
            assert a == sorted(set(a))
            assert all(prompt_len <= x <= seq_len - 2 for x in a)  # anchor and next token in the response
            assert len(a) == min(n, seq_len - 1 - prompt_len)


def test_anchors_empty_when_no_room() -> None:
    assert sample_anchors(10, 11, 4) == []  # a single response token has no next token
    assert sample_anchors(10, 10, 4) == []
    with pytest.raises(ValueError):
        sample_anchors(0, 10, 2)


def test_anchors_cover_the_whole_response() -> None:
    g = torch.Generator().manual_seed(1)
    seen = set()
    for _ in range(300):
        seen.update(sample_anchors(4, 20, 3, g))
    assert seen == set(range(4, 19))


# ----- blocks, mask -----

def test_blocks_inputs_labels_and_ends() -> None:
    ids = torch.arange(10, 30)  # L = 20
    bb = build_blocks(ids, [6, 17], B, MASK)
    assert bb.input_ids.tolist() == [16, MASK, MASK, MASK, 27, MASK, MASK, MASK]
    assert bb.positions.tolist() == [6, 7, 8, 9, 17, 18, 19, 20]
    # position 20 is past the end of the sequence: ignored; the anchor is never a label
    assert bb.labels.tolist() == [IGNORE, 17, 18, 19, IGNORE, 28, 29, IGNORE]
    assert (bb.weights[bb.labels == IGNORE] == 0).all()
    assert bb.context_len == 17


def test_mask_shape_and_rules() -> None:
    anchors, t = [3, 5, 9], 9
    m = block_attention_mask(anchors, B, t)
    assert m.shape == (3 * B, t + 3 * B)
    for q in range(3 * B):
        j = q // B
        for k in range(t):
            assert bool(m[q, k]) == (k < anchors[j]), (q, k)  # context strictly before the anchor
        for k in range(3 * B):
            assert bool(m[q, t + k]) == (k // B == j), (q, k)  # its own block only, both directions
    with pytest.raises(ValueError):
        block_attention_mask([10], B, 9)


def test_block_cannot_see_forbidden_inputs_outputs_and_gradients() -> None:
    torch.manual_seed(0)
    drafter = tiny_drafter()
    embed = torch.nn.Embedding(VOCAB, H)
    L = 24
    ids = torch.randint(0, MASK, (L,))
    feats = torch.randn(1, L, 2 * H)
    anchors = [6, 11, 15]
    base, bb = run_blocks(drafter, embed, feats, ids, anchors)
    t = bb.context_len
    for j, a in enumerate(anchors):
        # (1) outputs: perturb the context at/after the anchor and every other block's input
        f2 = feats.clone()
        f2[:, a:] += 5 * torch.randn_like(f2[:, a:])
        emb = embed(bb.input_ids)[None].detach()
        e2 = emb.clone()
        others = torch.ones(len(anchors) * B, dtype=torch.bool)
        others[j * B:(j + 1) * B] = False
        e2[:, others] += 5 * torch.randn_like(e2[:, others])
        with torch.no_grad():
            out = drafter.forward_train(f2[:, :t], e2, bb.positions, bb.mask)[0].reshape(len(anchors), B, -1)
        torch.testing.assert_close(out[j], base[j], rtol=0, atol=1e-5)
        # ...while the change is visible to blocks that may see it (so the test can fail)
        if j + 1 < len(anchors):
            assert (out[j + 1] - base[j + 1]).abs().max() > 1e-3

        # (2) gradients of block j's outputs w.r.t. forbidden inputs are exactly zero
        ctx = feats[:, :t].clone().requires_grad_(True)
        e3 = emb.clone().requires_grad_(True)
        y = drafter.forward_train(ctx, e3, bb.positions, bb.mask)[0].reshape(len(anchors), B, -1)
        y[j].square().sum().backward()
        assert ctx.grad is not None and e3.grad is not None
        assert (ctx.grad[:, a:] == 0).all()
        assert ctx.grad[:, :a].abs().sum() > 0  # the allowed context does matter
        assert (e3.grad[:, others] == 0).all()
        assert e3.grad[:, ~others].abs().sum() > 0


def test_forward_train_equals_inference_step_tiny() -> None:
    torch.manual_seed(1)
    drafter = tiny_drafter(seed=3)
    embed = torch.nn.Embedding(VOCAB, H)
    L = 30
    ids = torch.randint(0, MASK, (L,))
    feats = torch.randn(1, L, 2 * H)
    anchors = [1, 8, 9, 20, 28]
    with torch.no_grad():
        train_out, bb = run_blocks(drafter, embed, feats, ids, anchors)
        for j, a in enumerate(anchors):
            cache = drafter.new_cache(L + B)
            block = embed(bb.input_ids[j * B:(j + 1) * B])[None]
            inf = drafter.step(block, a, cache, feats[:, :a])
            torch.testing.assert_close(train_out[j], inf[0], rtol=1e-4, atol=1e-5)


def test_inference_step_follows_weight_updates_and_copies() -> None:
    """`step` multiplies through joined, laid-out copies of the weights (`_fused`): an in-place
    update (an optimizer step between evaluations) must reach them, and a drafter that has run
    steps must still deep-copy (the laid-out copies are dropped, then rebuilt)."""
    import copy

    torch.manual_seed(2)
    drafter = tiny_drafter(seed=5)
    block, feats = torch.randn(1, B, H), torch.randn(1, 6, 2 * H)

    def run(d: DFlashDrafter) -> torch.Tensor:
        return d.step(block, 6, d.new_cache(6 + B), feats)

    before = run(drafter)
    with torch.no_grad():
        drafter.layers[0].self_attn.k_proj.weight.mul_(1.5)
        drafter.layers[1].mlp.up_proj.weight.add_(0.1)
    after = run(drafter)
    fresh = copy.deepcopy(drafter)
    assert fresh._joined is None
    torch.testing.assert_close(after, run(fresh), rtol=0, atol=0)
    assert not torch.allclose(after, before)


def test_forward_train_equals_inference_step_real_target(target_fp32) -> None:
    """Real shapes (SmolLM2 features, GQA 9/3 heads, B = 16) and real float32 target features: the
    training pass must give every block exactly what `step` gives it at inference. (Its own
    drafter: the shared `random_drafter` is cast in place by engines around the bf16 target.)"""
    cfg = config_for_target(target_fp32.config, num_layers=2, block_size=16, mask_token_id=0)
    drafter = init_weights(DFlashDrafter(cfg), seed=1).eval()
    ids = target_fp32.encode_chat([{"role": "user", "content": "Name three colours."}])
    ids = ids + [int(t) for t in torch.randint(100, 1000, (20,), generator=torch.Generator().manual_seed(0))]
    tcache = target_fp32.new_cache(len(ids) + 1)
    _, feats = target_fp32.forward(torch.tensor([ids]), tcache, drafter.config.target_layer_ids)
    feats = feats[None].clone()
    anchors = [len(ids) - 20, len(ids) - 9, len(ids) - 2]
    bs = drafter.block_size
    bb = build_blocks(ids, anchors, bs, drafter.mask_token_id)
    with torch.no_grad():
        emb = target_fp32.embed(bb.input_ids)[None]
        out = drafter.forward_train(feats[:, : bb.context_len], emb, bb.positions, bb.mask)[0]
        for j, a in enumerate(anchors):
            cache = drafter.new_cache(len(ids) + bs)
            inf = drafter.step(emb[:, j * bs:(j + 1) * bs], a, cache, feats[:, :a])
            torch.testing.assert_close(out[j * bs:(j + 1) * bs], inf[0], rtol=1e-4, atol=1e-4)
            assert not torch.allclose(inf[0], out[((j + 1) % 3) * bs:((j + 1) % 3 + 1) * bs])


# ----- loss -----

def test_position_weights() -> None:
    w = position_weights(16)
    assert w[0] == 0 and w[1] == 1
    assert math.isclose(float(w[15]), math.exp(-14 / 7), rel_tol=1e-6)
    assert (w[1:-1] > w[2:]).all()
    assert default_gamma(16) == 7.0 and default_gamma(8) == 4.0
    assert math.isclose(float(position_weights(4, gamma=2.0)[3]), math.exp(-1.0), rel_tol=1e-6)


def labelled(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> BatchOutput:
    """One sequence's labelled block positions, as `batch_forward` hands them to the loss."""
    valid = labels != IGNORE
    slots = torch.arange(len(labels)) % B
    return BatchOutput(logits=logits[valid], labels=labels[valid], weights=weights[valid].float(),
                       rows=torch.zeros(int(valid.sum()), dtype=torch.long), slots=slots[valid])


def test_weighted_loss_matches_hand_computation_and_ignores_invalid() -> None:
    torch.manual_seed(2)
    ids = torch.randint(0, 10, (12,))
    bb = build_blocks(ids, [5, 9], B, 0, gamma=3.0)  # block 2 (positions 9..12) runs past the end
    logits = torch.randn(2 * B, 10, requires_grad=True)
    loss = labelled(logits, bb.labels, bb.weights).loss()
    num, den = 0.0, 0.0
    for q in range(2 * B):
        k, lab = q % B, int(bb.labels[q])
        if lab == IGNORE:
            continue
        w = math.exp(-(k - 1) / 3.0)
        num += w * float(-torch.log_softmax(logits[q].detach(), -1)[lab])
        den += w
    assert math.isclose(float(loss.detach()), num / den, rel_tol=1e-5)
    loss.backward()
    ignored = bb.labels == IGNORE
    assert int(ignored.sum()) == 2 + 1  # two anchors + position 12 (past the end) of the second block
    assert (logits.grad[ignored] == 0).all()
    assert (logits.grad[~ignored].abs().sum(-1) > 0).all()


def test_position_hits_count_per_block_position() -> None:
    labels = torch.tensor([IGNORE, 1, 2, IGNORE, IGNORE, 3, 4, 5])
    logits = torch.full((8, 6), -1.0)
    for q, t in enumerate([0, 1, 0, 0, 0, 3, 0, 5]):
        logits[q, t] = 1.0
    hits, counts = labelled(logits, labels, torch.ones(8)).position_hits(4)
    assert counts.tolist() == [0, 2, 2, 1]
    assert hits.tolist() == [0, 2, 0, 1]

"""The training parts on the real target: feature cache, schedule, bigram floor, drafter init."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_core.train.batch import context_features
from dflash_core.train.drafter_init import build_drafter, init_from_target
from dflash_core.train.features import Sequence, build_features, load_feature_file, map_safetensors
from dflash_core.train.recipe import bigram_accuracy, build_blocks, lr_factor
from dflash_core.train.shards import encode_shard, write_atomic

LAYERS = [2, 20]


def make_data(folder: Path, target) -> list[dict]:
    """Two shards of three samples with replies of different lengths (some in one batch)."""
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    questions = ["What is 2+2?", "Name a colour.", "Say hi.", "Write one word.", "Count to three.", "Why?"]
    samples = []
    for k, q in enumerate(questions):
        reply = [*torch.randint(100, 5000, (12 + 5 * k,), generator=g).tolist(), 2]
        samples.append({"id": f"s{k}", "prompt_ids": target.encode_chat([{"role": "user", "content": q}]),
                        "response_ids": reply, "temperature": 0.0})
    write_atomic(folder / "shard-00000.jsonl.gz", encode_shard(samples[:3]))
    write_atomic(folder / "shard-00001.jsonl.gz", encode_shard(samples[3:]))
    return samples


@pytest.fixture(scope="module")
def feature_dir(tmp_path_factory, target_fp32) -> tuple[Path, list[dict]]:
    root = tmp_path_factory.mktemp("train")
    samples = make_data(root / "data", target_fp32)
    build_features(target_fp32, root / "data", root / "feats", LAYERS, batch_tokens=200, progress=False)
    return root, samples


def test_features_match_inference_and_resume(feature_dir, target_fp32) -> None:
    root, samples = feature_dir
    files = sorted((root / "feats").glob("feats-*.safetensors"))
    assert [f.name for f in files] == ["feats-00000.safetensors", "feats-00001.safetensors"]
    seqs = [s for f in files for s in load_feature_file(f)]
    assert [s.id for s in seqs] == [s["id"] for s in samples]
    for seq, sample in zip(seqs, samples, strict=True):
        ids = sample["prompt_ids"] + sample["response_ids"]
        assert seq.ids.tolist() == ids and seq.prompt_len == len(sample["prompt_ids"])
        # The features the engine computes at inference (cached prefill, no padding).
        _, ref = target_fp32.forward(torch.tensor([ids]), target_fp32.new_cache(len(ids)), LAYERS)
        assert seq.feats.dtype == torch.float16 and seq.feats.shape == ref.shape
        torch.testing.assert_close(seq.feats.float(), ref, rtol=2e-2, atol=2e-2)
    # A rerun skips finished shards.
    before = [f.stat().st_mtime_ns for f in files]
    build_features(target_fp32, root / "data", root / "feats", LAYERS, batch_tokens=200, progress=False)
    assert [f.stat().st_mtime_ns for f in files] == before


def test_mapped_safetensors_equal_load_file(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {"f16": torch.randn(5, 3).half(), "bf16": torch.randn(4).bfloat16(), "f32": torch.randn(2, 2, 2),
               "i32": torch.arange(7, dtype=torch.int32), "i64": torch.tensor([0, 3, 9]), "empty": torch.zeros(0, 4)}
    save_file(tensors, str(tmp_path / "t.safetensors"), metadata={"ids": "[\"a\"]"})
    mapped, meta = map_safetensors(tmp_path / "t.safetensors")
    ref = load_file(str(tmp_path / "t.safetensors"))
    assert meta == {"ids": "[\"a\"]"} and mapped.keys() == ref.keys()
    for k, v in ref.items():
        assert mapped[k].dtype == v.dtype and torch.equal(mapped[k], v), k
    mapped["f16"][0, 0] = 100.0  # private map: writes never reach the file
    assert torch.equal(load_file(str(tmp_path / "t.safetensors"))["f16"], ref["f16"])


def test_lr_schedule() -> None:
    assert lr_factor(0, 10, 100, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(55, 10, 100, 0.1) == pytest.approx(0.55)
    assert lr_factor(100, 10, 100, 0.1) == pytest.approx(0.1)


def test_build_drafter_inits(target) -> None:
    d = build_drafter(target, LAYERS, num_layers=1, block_size=8, init="target-last")
    assert d.config.target_layer_ids == LAYERS and d.config.block_size == 8
    assert torch.equal(d.layers[0].mlp.up_proj.weight, target.model.model.layers[29].mlp.up_proj.weight)
    r = build_drafter(target, LAYERS, num_layers=1, seed=1)
    assert not torch.equal(r.layers[0].mlp.up_proj.weight, d.layers[0].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="unknown init"):
        build_drafter(target, LAYERS, init="target-first")
    with pytest.raises(ValueError, match="unknown init"):
        build_drafter(target, LAYERS, init="target:29")


def test_warm_start_from_an_earlier_drafter(target, tmp_path: Path) -> None:
    old = build_drafter(target, LAYERS, num_layers=1, block_size=8, seed=3)
    old.save(tmp_path / "old", dtype=torch.float32)
    new = build_drafter(target, LAYERS, num_layers=1, block_size=8, seed=4, init=f"from:{tmp_path / 'old'}")
    for k, v in old.state_dict().items():
        assert torch.equal(new.state_dict()[k], v), k
    with pytest.raises(ValueError, match="block_size 8 \\(want 16\\)"):
        build_drafter(target, LAYERS, num_layers=1, block_size=16, init=f"from:{tmp_path / 'old'}")


def test_bigram_accuracy() -> None:
    def seq(ids: list[int], p: int) -> Sequence:
        return Sequence(id="x", ids=torch.tensor(ids), prompt_len=p, feats=torch.zeros(len(ids), 1))

    train_seqs = [seq([9, 9, 1, 2, 1, 2, 1, 3], 2)]  # reply: 1 -> 2 twice, 1 -> 3 once, 2 -> 1 twice
    assert bigram_accuracy(train_seqs, [seq([5, 1, 2, 1, 3], 1)]) == pytest.approx(2 / 3)  # misses 1 -> 3
    assert bigram_accuracy(train_seqs, [seq([5, 1, 2], 1)]) == 1.0


def test_init_from_target_copies_layers(target) -> None:
    from dflash_core.drafter import DFlashDrafter
    from dflash_core.drafter_config import config_for_target

    d = DFlashDrafter(config_for_target(target.config, num_layers=2, mask_token_id=0))
    init_from_target(d, target.model, [28, 29])
    src = target.model.model.layers[29]
    assert torch.equal(d.layers[1].self_attn.q_proj.weight, src.self_attn.q_proj.weight)
    assert torch.equal(d.layers[1].mlp.down_proj.weight, src.mlp.down_proj.weight)
    assert torch.equal(d.layers[0].input_layernorm.weight, target.model.model.layers[28].input_layernorm.weight)
    with pytest.raises(ValueError):
        init_from_target(d, target.model, [29])


def test_warm_start_grows_a_deeper_drafter_that_computes_the_same(target_fp32, tmp_path: Path) -> None:
    """--init from:DIR with more layers: the old layers are copied, the new one starts as an
    identity (zero output projections), so the grown drafter's output equals the old one's, and
    training then reaches the new layer's other weights."""
    old = build_drafter(target_fp32, LAYERS, num_layers=1, block_size=8, seed=3)
    old.save(tmp_path / "old", dtype=torch.float32)
    new = build_drafter(target_fp32, LAYERS, num_layers=2, block_size=8, seed=4, init=f"from:{tmp_path / 'old'}")
    assert len(new.layers) == 2 and new.config.num_hidden_layers == 2
    for k, v in old.state_dict().items():
        assert torch.equal(new.state_dict()[k], v), k
    ids = torch.randint(100, 5000, (40,), generator=torch.Generator().manual_seed(0))
    bb = build_blocks(ids, [10, 25], 8, 0)
    ctx = context_features(target_fp32, ids[None, : bb.context_len], LAYERS)
    emb = target_fp32.embed(bb.input_ids[None])
    with torch.no_grad():
        ref = old.forward_train(ctx, emb, bb.positions, bb.mask)
    out = new.forward_train(ctx, emb, bb.positions, bb.mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.square().mean().backward()  # the zeroed projections get gradients: the new layer can learn
    assert new.layers[1].self_attn.o_proj.weight.grad.abs().sum() > 0
    assert new.layers[1].mlp.down_proj.weight.grad.abs().sum() > 0
    new.save(tmp_path / "new", dtype=torch.float32)
    with pytest.raises(ValueError, match="a different drafter shape"):  # shallower is not a growth
        build_drafter(target_fp32, LAYERS, num_layers=1, block_size=8, init=f"from:{tmp_path / 'new'}")


def test_warm_start_widens_to_more_target_layers(target_fp32, tmp_path: Path) -> None:
    """--init from:DIR with --target-layers a superset: fc's old columns move with their layers and
    the new layer's start at zero, so the wider drafter computes what the old one did, and the new
    columns get gradients."""
    old = build_drafter(target_fp32, LAYERS, num_layers=1, block_size=8, seed=3)
    old.save(tmp_path / "old", dtype=torch.float32)
    wide_layers = [LAYERS[0], 9, LAYERS[1]]
    new = build_drafter(target_fp32, wide_layers, num_layers=1, block_size=8, seed=4, init=f"from:{tmp_path / 'old'}")
    assert new.config.target_layer_ids == wide_layers
    h = target_fp32.config.hidden_size
    assert torch.equal(new.fc.weight[:, :h], old.fc.weight[:, :h])
    assert torch.equal(new.fc.weight[:, 2 * h:], old.fc.weight[:, h:])
    assert not new.fc.weight[:, h:2 * h].any()
    ids = torch.randint(100, 5000, (40,), generator=torch.Generator().manual_seed(0))
    bb = build_blocks(ids, [10, 25], 8, 0)
    emb = target_fp32.embed(bb.input_ids[None])
    with torch.no_grad():
        ref = old.forward_train(context_features(target_fp32, ids[None, : bb.context_len], LAYERS), emb,
                                bb.positions, bb.mask)
    out = new.forward_train(context_features(target_fp32, ids[None, : bb.context_len], wide_layers), emb,
                            bb.positions, bb.mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.square().mean().backward()
    assert new.fc.weight.grad[:, h:2 * h].abs().sum() > 0
    with pytest.raises(ValueError, match="a different drafter shape"):  # not a superset: no silent guess
        build_drafter(target_fp32, [LAYERS[0], 9], num_layers=1, block_size=8, init=f"from:{tmp_path / 'old'}")


def test_feature_cache_serves_adjacent_layer_subsets(feature_dir, target_fp32) -> None:
    """A cache of layers [a, b] serves [a] and [b] as views (no second target pass); [b, a] is not
    a run of its columns, so it is refused with a clear message instead of read wrongly."""
    root, _ = feature_dir
    files = sorted((root / "feats").glob("feats-*.safetensors"))
    stamps = [f.stat().st_mtime_ns for f in files]
    full = [s for f in files for s in load_feature_file(f)]
    h = target_fp32.config.hidden_size
    for k, layer in enumerate(LAYERS):
        build_features(target_fp32, root / "data", root / "feats", [layer], batch_tokens=200, progress=False)
        assert [f.stat().st_mtime_ns for f in files] == stamps  # reused, not recomputed
        part = [s for f in files for s in load_feature_file(f, [layer])]
        for a, b in zip(full, part, strict=True):
            assert torch.equal(b.feats, a.feats[:, k * h:(k + 1) * h])
    with pytest.raises(ValueError, match="side by side"):
        load_feature_file(files[0], LAYERS[::-1])


def test_data_folders_with_repeats(tmp_path: Path) -> None:
    from dflash_core.errors import DFlashError
    from dflash_core.train.samples import load_samples, parse_data_folders, repeat_samples

    a, b = tmp_path / "a", tmp_path / "b"
    folders, repeats = parse_data_folders(f"{a}, {b}*3,")
    assert folders == [a, b] and repeats == {b: 3}
    assert parse_data_folders(f"{a}*1")[1] == {}
    for bad in (f"{a}*0", f"{a}*x", f"{a}*"):
        with pytest.raises(DFlashError, match="whole number"):
            parse_data_folders(bad)
    with pytest.raises(DFlashError, match="at least one folder"):
        parse_data_folders(" , ")
    for folder, ids in ((a, ["x", "y"]), (b, ["z"])):
        folder.mkdir()
        write_atomic(folder / "shard-00000.jsonl.gz", encode_shard(
            [{"id": i, "prompt_ids": [1, 2], "response_ids": [3, 4], "temperature": 0.0} for i in ids]))
    samples = load_samples(folders)  # each sample knows the folder it came from
    out = repeat_samples(samples, repeats)
    assert [s.id for s in out] == ["x", "y", "z", "z", "z"]
    assert out[2] is out[3] is samples[2]  # the same sample: its cached features attach once

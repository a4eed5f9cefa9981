"""The compiled batch-invariant kernels (dflash_core/cpu_kernels.py): built where the target runs
in bf16, the attention and the linear layers they claim to be, and a row's bits independent of the
pass it is in and of the threads that compute it."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from test_batch_invariant import reference_attention

from dflash_core import batch_invariant, cpu_kernels, layers
from dflash_core.targets import Target

needs_kernel = pytest.mark.skipif(cpu_kernels.kernel() is None,
                                  reason=f"no compiled kernels here: {cpu_kernels.unavailable_reason()}")


def test_it_is_built_wherever_the_target_runs_in_bf16() -> None:
    """On a CPU with bf16 units and a C++ compiler, the kernels must build: a silent fall back to
    the torch calls would cost a third of the speed and no test would notice."""
    if not batch_invariant.bf16_gemm_available() or shutil.which("c++") is None:
        pytest.skip("no bf16 units or no C++ compiler: the torch calls are the attention here")
    assert cpu_kernels.kernel() is not None, cpu_kernels.unavailable_reason()
    module = cpu_kernels.linear_kernel()
    assert module is not None
    assert module.linear_units() == batch_invariant.bf16_units()  # AMX's tiles where the CPU has them
    assert cpu_kernels.describe() == f"[cpu kernels] ready (attention, linear layers on {module.linear_units()})"


def test_turned_off_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_CPU_KERNEL", "0")
    cpu_kernels._load.cache_clear()
    try:
        assert cpu_kernels.kernel() is None
        assert "DFLASH_CPU_KERNEL=0" in str(cpu_kernels.unavailable_reason())
    finally:
        monkeypatch.delenv("DFLASH_CPU_KERNEL")
        cpu_kernels._load.cache_clear()


def random_cache(kv: int, length: int, hd: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys [kv, length, hd] and values with the ones column a batch-invariant cache keeps."""
    gen = torch.Generator().manual_seed(seed)
    keys = (torch.randn(kv, length, hd, generator=gen) * 2).bfloat16()
    values = F.pad(torch.randn(kv, length, hd, generator=gen), (0, 1), value=1.0).bfloat16()
    return keys, values


def run(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, before: list[int],
        after: list[list[int]]) -> torch.Tensor:
    width = max((len(a) for a in after), default=0)
    table = torch.tensor([a + [0] * (width - len(a)) for a in after], dtype=torch.long).view(len(before), width)
    return cpu_kernels.kernel().attention(q, keys, values, torch.tensor(before), table,
                                            torch.tensor([len(a) for a in after]), q.shape[-1] ** -0.5)


@needs_kernel
@pytest.mark.parametrize(("heads", "kv", "hd"), [(4, 4, 16), (4, 2, 32), (9, 3, 64), (8, 2, 128), (4, 1, 256)])
def test_it_computes_softmax_attention_over_the_keys_each_row_sees(heads: int, kv: int, hd: int) -> None:
    keys, values = random_cache(kv, 120, hd, seed=hd)
    q = torch.randn(heads, 4, hd, generator=torch.Generator().manual_seed(1)).bfloat16()
    # Rows: two chain rows, then two tree rows that see the first 90 keys and a few later ones.
    before, after = [100, 101, 90, 90], [[], [], [95, 97], [95, 99, 104]]
    visible = torch.zeros(4, 120, dtype=torch.bool)
    for r, (b, a) in enumerate(zip(before, after, strict=True)):
        visible[r, :b] = True
        visible[r, a] = True
    want = reference_attention(q, keys, values[..., :hd], visible, hd**-0.5)
    torch.testing.assert_close(run(q, keys, values, before, after).float(), want, atol=2e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize(("length", "hd"), [(300, 16), (290, 32), (300, 64), (283, 128), (280, 256)])
def test_a_rows_bits_depend_only_on_the_keys_it_sees(length: int, hd: int) -> None:
    """The same query over the same keys: alone, as one row of a chain, as a tree row whose
    ancestors are gathered from elsewhere in the buffer (up to its last row, which ends inside a
    tile of 16 keys), on one thread or two."""
    keys, values = random_cache(3, length, hd, seed=7)
    q = torch.randn(9, 1, hd, generator=torch.Generator().manual_seed(2)).bfloat16()
    alone = run(q, keys, values, [261], [[]])  # keys 0..260
    others = torch.randn(9, 20, hd, generator=torch.Generator().manual_seed(3)).bfloat16()
    for size in (2, 5, 12, 20):  # the kernel groups a pass's queries in tiles sized by its row count
        for pos in range(size):
            chain = torch.cat([others[:, :pos], q, others[:, pos + 1 : size]], 1)
            got = run(chain, keys, values, [261 - pos + i for i in range(size)], [[]] * size)  # row pos: 0..260
            assert torch.equal(got[:, pos], alone[:, 0]), (size, pos)
    # The tree row: keys 0..249 in place, then 250..260, which a tree pass writes to other rows.
    moved_keys, moved_values = keys.clone(), values.clone()
    moved = list(range(length - 11, length))
    moved_keys[:, moved], moved_values[:, moved] = keys[:, 250:261], values[:, 250:261]
    moved_keys[:, 250:261] = moved_values[:, 250:261] = 0
    tree = run(q, moved_keys, moved_values, [250], [moved])
    assert torch.equal(tree, alone)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(others, keys, values, list(range(250, 270)), [[]] * 20)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, run(others, keys, values, list(range(250, 270)), [[]] * 20))


@needs_kernel
def test_other_head_sizes_take_the_torch_calls() -> None:
    keys, values = random_cache(2, 40, 48, seed=4)
    q = torch.randn(4, 2, 48, generator=torch.Generator().manual_seed(5)).bfloat16()
    with pytest.raises(RuntimeError, match="head_dim 48"):
        run(q, keys, values, [31, 32], [[], []])
    plan = batch_invariant.AttentionPlan.chain(30, 2, torch.device("cpu"))
    visible = torch.arange(40)[None, :] < torch.tensor([31, 32])[:, None]
    want = reference_attention(q, keys, values[..., :48], visible, 48**-0.5)
    got = batch_invariant.attention(q, keys, values, plan, 48**-0.5)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)


@needs_kernel
@pytest.mark.parametrize("hd", [64, 48])
def test_a_drafters_full_attention_is_sdpas(hd: int) -> None:
    """Every block row sees every key (the drafter's bidirectional layers): the kernel where the
    head size has one, SDPA otherwise, the same attention either way."""
    keys, values = random_cache(3, 70, hd, seed=hd)
    q = torch.randn(9, 16, hd, generator=torch.Generator().manual_seed(6)).bfloat16()
    want = F.scaled_dot_product_attention(q[None].float(), keys[None].float(), values[None, ..., :hd].float(),
                                          enable_gqa=True)[0]
    got = layers.full_attention(q, keys, values[..., :hd])
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


needs_linear = pytest.mark.skipif(cpu_kernels.linear_kernel() is None,
                                  reason="the compiled linear layers need AVX512-BF16")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    module = cpu_kernels.linear_kernel()
    return module.linear(x, module.pack_linear(weight), bias)


@needs_linear
@pytest.mark.parametrize(("rows", "out", "inp"),
                         [(1, 16, 2), (3, 48, 64), (8, 960, 576), (13, 80, 1536), (40, 576, 200)])
def test_the_linear_kernel_is_a_bf16_linear_layer(rows: int, out: int, inp: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inp, generator=gen).bfloat16()
    weight = (torch.randn(out, inp, generator=gen) / inp**0.5).bfloat16()
    bias = torch.randn(out, generator=gen).bfloat16()
    want = F.linear(x.float(), weight.float(), bias.float())
    got = linear(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(linear(x, weight).float(), want - bias.float(), atol=2e-2, rtol=1e-2)


@needs_linear
@pytest.mark.parametrize("inputs", [1536, 1000])  # on AMX: tile multiplies, and vdpbf16ps (not a multiple of 32)
def test_a_linear_rows_bits_depend_only_on_the_row(inputs: int) -> None:
    """Every row count from 1 to 40 (one register or AMX tile, several, panels of the reduction),
    on one thread or two: row i's output is the same bits as row i alone."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(40, inputs, generator=gen).bfloat16()
    # 38 blocks of 16 outputs: a tail past whole tiles of 3 blocks (vdpbf16ps) and of 4 (AMX)
    weight = (torch.randn(576 + 32, inputs, generator=gen) / 40).bfloat16()
    module = cpu_kernels.linear_kernel()
    packed = module.pack_linear(weight)
    alone = torch.cat([module.linear(x[i : i + 1], packed, None) for i in range(40)])
    for rows in range(1, 41):
        assert torch.equal(module.linear(x[:rows], packed, None), alone[:rows]), rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = module.linear(x, packed, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, alone)


@needs_linear
def test_the_linear_kernel_refuses_what_it_cannot_lay_out() -> None:
    module = cpu_kernels.linear_kernel()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        module.pack_linear(torch.zeros(20, 8, dtype=torch.bfloat16))
    assert not cpu_kernels.linear_fits(torch.zeros(20, 8)) and cpu_kernels.linear_fits(torch.zeros(32, 8))
    with pytest.raises(RuntimeError, match="for 8 inputs"):
        packed = module.pack_linear(torch.zeros(16, 6, dtype=torch.bfloat16))
        module.linear(torch.zeros(2, 8, dtype=torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="a bias of 16 outputs"):
        module.linear(torch.zeros(2, 6, dtype=torch.bfloat16), packed, torch.zeros(15))
    # A layer the kernel cannot lay out multiplies through oneDNN, rows still invariant.
    odd = batch_invariant.InvariantLinear.of(torch.randn(20, 8).bfloat16(), None)
    assert odd.compiled is None
    x = torch.randn(5, 8).bfloat16()
    assert torch.equal(odd(x)[2:3], odd(x[2:3]))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rowwise_kernels_give_torchs_bits(rows: int) -> None:
    """RMSNorm and RoPE as one compiled call each (layers.py), on real-sized rows, for one row or
    many: RoPE rounds as torch's bf16 calls do, so its bits are theirs; the norm sums its squares
    in its own order, so it is torch's within bf16 rounding (in practice the same bits)."""
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=gen) * 3).bfloat16()
    weight = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    with torch.no_grad():
        compiled = layers.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(compiled, torch_rms_norm(x, weight, 1e-5), atol=0, rtol=2**-7)
    cos, sin = layers.rope_cos_sin(torch.arange(100, 100 + rows), 64, 100000.0, torch.bfloat16)
    q = torch.randn(rows, 9, 64, generator=gen).bfloat16().transpose(0, 1)  # [heads, rows, hd], strided
    with torch.no_grad():
        assert torch.equal(layers.apply_rope(q, cos, sin), torch_rope(q, cos, sin))


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7])
def test_swiglu_is_torchs_within_bf16_rounding(rows: int) -> None:
    gate_up = (torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(rows)) * 4).bfloat16()
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-30, -1e-30, 20.0, -20.0])  # the exp's edges
    got = layers.swiglu(gate_up)
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(got, F.silu(gate) * up, atol=0, rtol=2**-7)  # one bf16 step at most
    assert torch.equal(layers.swiglu(gate_up[:1]), got[:1])  # a row alone, the same bits


@needs_linear
def test_a_drafter_layer_as_one_call_gives_the_torch_call_layers_bits(target: Target,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`draft_layer` (cpu_layer.cpp) runs the shipped drafter's layers as `DFlashDrafter.step`'s
    torch calls do: the block's hidden states and the draft cache's keys and values, bit for bit,
    with new context rows and without."""
    from dflash_core.drafter import DFlashDrafter, load_drafter
    from dflash_core.loading import SHIPPED_DRAFTER

    if target.dtype != torch.bfloat16:
        pytest.skip("the target runs in float32 here")
    drafter = load_drafter(SHIPPED_DRAFTER, target=target).to(torch.bfloat16)
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size

    def steps() -> list[torch.Tensor]:
        cache = drafter.new_cache(64)
        gen = torch.Generator().manual_seed(0)
        first = drafter.step(target.embed(torch.tensor([[5] + [0] * 15])), 20, cache,
                             torch.randn(1, 20, width, generator=gen).bfloat16())
        again = drafter.step(target.embed(torch.tensor([[7] + [0] * 15])), 20, cache)  # no new context
        last = drafter.step(target.embed(torch.tensor([[9] + [0] * 9])), 23, cache,
                            torch.randn(1, 3, width, generator=gen).bfloat16())
        return [first, again, last, cache.keys[:, :, :, :33].clone(), cache.values[:, :, :, :33].clone()]

    compiled = steps()
    with torch.no_grad():  # the kernel is the path that ran
        assert drafter._layer_kernel(compiled[0][0], drafter._fused(), {(None, False): (0, None)}) is not None
    monkeypatch.setattr(DFlashDrafter, "_layer_kernel", lambda *args: None)
    assert all(torch.equal(a, b) for a, b in zip(compiled, steps(), strict=True))


def test_training_keeps_the_torch_calls() -> None:
    """With gradients wanted, the norm is torch's (the compiled call has no backward)."""
    x = torch.randn(3, 64).bfloat16().requires_grad_()
    layers.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-5).sum().backward()
    assert x.grad is not None


@needs_kernel
@pytest.mark.parametrize("n", [1, 5, 16, 17, 49152, 49157])
def test_argmax_rows_is_torchs_max_index(n: int) -> None:
    """Greedy decoding is exact only if every path picks the same token: the compiled argmax must
    give torch's `max(-1).indices` on any row, ties (the first wins), -inf rows, signed zeros and
    NaNs (the first NaN wins) included, at any length (a tail past the last 16 values too)."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(12, n, generator=gen).mul(8).round()  # integers: many ties
    x[1] = float("-inf")
    x[2] = 0.0
    x[2, n // 2] = -0.0
    x[3, torch.randint(n, (3,), generator=gen)] = float("nan")
    x[4, -1] = 1e30  # the largest value in the tail
    x[5, torch.randint(n, (2,), generator=gen)] = float("inf")
    x[6, 0] = float("nan")
    x[7] = float("nan")
    got = cpu_kernels.kernel().argmax_rows(x)
    assert got.dtype == torch.long
    assert torch.equal(got, x.max(-1).indices)
    assert torch.equal(cpu_kernels.kernel().argmax_rows(x.t().contiguous().t()), x.max(-1).indices)


@needs_linear
def test_the_linear_kernel_and_onednn_take_turns() -> None:
    """On AMX both configure the tile registers: oneDNN's bf16 GEMM (training, odd layers) gives
    the same bits before and after the kernel's calls, and the kernel's own bits hold after oneDNN's."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(12, 576, generator=gen).bfloat16()
    weight = (torch.randn(960, 576, generator=gen) / 24).bfloat16()
    onednn = batch_invariant.onednn_weight(weight)
    before = batch_invariant.onednn_linear(x, onednn, None)
    ours = linear(x[:3], weight)
    assert torch.equal(batch_invariant.onednn_linear(x, onednn, None), before)
    assert torch.equal(linear(x[:3], weight), ours)

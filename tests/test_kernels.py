"""The Triton accept kernels (dflash_core/kernels.py) against the plain-torch rules (verify.py), on CPU.

Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernels with numpy. Triton reads that
variable when a kernel is decorated, i.e. when dflash_core.kernels is first imported, and
conftest.py has imported it (through dflash_core.engine) before this module is collected;
setting the variable here would also leak into every later module of the same pytest process.
So the kernel tests run in a child pytest process whose environment has TRITON_INTERPRET=1 from
the start (`test_kernels_in_triton_interpreter`). In the parent process they are skipped; in the
child, where `kernels.INTERPRETED` is true, they run and that launcher is skipped instead.
Running the suite with TRITON_INTERPRET=1 set runs them directly.

On a CUDA machine, `DFLASH_KERNEL_TEST_DEVICE=cuda pytest tests/test_kernels.py` runs the same
kernel tests compiled for the GPU: inputs are built on the CPU as here, the kernels run on the
device, and results (and token buffers) come back to be compared with the torch rules on the CPU.

Exactness: greedy results and the accept count are compared exactly. The sampled token is
compared exactly too: both sides accumulate the inverse CDF in float64, in different orders, so
only a u within ~1e-12 (relative) of a CDF boundary could differ — for random u, odds of about
1e-9 per draw. Boundary ties themselves are tested with exactly representable weights.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_core import kernels
from dflash_core.verify import draw_uniforms, greedy_accept, speculative_accept, speculative_accept_u

ROOT = Path(__file__).resolve().parent.parent
HAVE_TRITON = kernels.triton is not None
DEVICE = torch.device(os.environ.get("DFLASH_KERNEL_TEST_DEVICE", "cpu"))
ON_GPU = HAVE_TRITON and DEVICE.type == "cuda" and torch.cuda.is_available() and not kernels.INTERPRETED
KERNEL_DEVICE = DEVICE if ON_GPU else torch.device("cpu")  # where the kernels under test run
in_interpreter = pytest.mark.skipif(
    not (kernels.INTERPRETED or ON_GPU),
    reason="runs in the TRITON_INTERPRET=1 child process (test_kernels_in_triton_interpreter), or on a GPU",
)
CHILD_TESTS_AT_LEAST = 40  # the child must really have run the kernel tests, not skipped them


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
@pytest.mark.skipif(kernels.INTERPRETED, reason="already in the interpreter: the tests below run directly")
def test_kernels_in_triton_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("DFLASH_KERNEL_TEST_DEVICE", None)  # the interpreter's kernels take CPU tensors
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__).resolve())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    report = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, report
    passed = re.search(r"(\d+) passed", result.stdout)
    assert passed and int(passed.group(1)) >= CHILD_TESTS_AT_LEAST, report
    assert "failed" not in result.stdout and "error" not in result.stdout.lower(), report


def greedy_k(draft, logits, out=None, length=None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.greedy_accept_triton on DEVICE; results (and a token buffer) back on the CPU."""
    return _kernel_on_device(kernels.greedy_accept_triton, (draft, logits), out, length)


def spec_k(draft, q, p, u, out=None, length=None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.speculative_accept_triton on DEVICE; results (and a token buffer) back on the CPU."""
    return _kernel_on_device(kernels.speculative_accept_triton, (draft, q, p, u), out, length)


def _kernel_on_device(fn, args: tuple, out: torch.Tensor | None, length: torch.Tensor | None):
    if not ON_GPU:
        return fn(*args, out, length)
    d_out = None if out is None else out.to(DEVICE)
    d_len = None if length is None else length.to(DEVICE)
    acc, tok = fn(*(a.to(DEVICE) for a in args), d_out, d_len)
    if out is not None and length is not None:
        out.copy_(d_out.cpu())
        length.copy_(d_len.cpu())
    return acc.cpu(), tok.cpu()


# ----- the dispatcher (no interpreter needed) -----


def test_use_triton_dispatch() -> None:
    assert kernels.use_triton("cuda") == HAVE_TRITON
    assert kernels.use_triton(torch.device("cuda", 0)) == HAVE_TRITON
    assert not kernels.use_triton("cpu")  # CPU keeps the torch rules by default
    assert not kernels.use_triton(torch.zeros(1))
    assert kernels.use_triton("cpu", interpret=True) == kernels.INTERPRETED  # CPU only through the interpreter


def commit_reference(out: torch.Tensor, length: torch.Tensor, draft: torch.Tensor, accepted: torch.Tensor,
                     token: torch.Tensor) -> None:
    """The kernels' buffer write in plain torch, without a host sync: out[length + i] for i <= accepted."""
    B = draft.shape[0] + 1
    pos = torch.arange(B, device=out.device)
    where = length.reshape(1) + pos
    values = torch.where(pos < accepted, torch.cat([draft, draft.new_zeros(1)]), token).to(out.dtype)
    out[where] = torch.where(pos <= accepted, values, out[where])
    length += accepted + 1


def test_speculative_accept_is_the_rule_on_drawn_uniforms() -> None:
    """The engine's two paths consume the generator identically: same seed, same block."""
    g = torch.Generator().manual_seed(0)
    for B in (2, 5, 9):
        p = torch.softmax(torch.randn(B, 50, generator=g), -1)
        q = torch.softmax(torch.randn(B - 1, 50, generator=g), -1)
        draft = torch.multinomial(q, 1, generator=g)[:, 0]
        state = g.get_state()
        acc, tok = speculative_accept(draft, q, p, g)
        g2 = torch.Generator()
        g2.set_state(state)
        acc2, tok2 = speculative_accept_u(draft, q, p, draw_uniforms(B - 1, g2, "cpu"))
        assert (int(acc), int(tok)) == (int(acc2), int(tok2))
        assert torch.equal(g.get_state(), g2.get_state())


# ----- greedy -----


def logits_with_accept_length(B: int, V: int, k: int, dtype: torch.dtype,
                              seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random logits [B, V] and a draft [B-1] that matches their argmax at exactly its first k positions."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 3).to(dtype)
    choice = logits.argmax(-1)
    draft = choice[:-1].clone()
    if k < B - 1:
        draft[k] = (choice[k] + 1 + torch.randint(V - 1, (), generator=g)) % V  # any other token
        draft[k + 1 :] = torch.where(torch.rand(B - 2 - k, generator=g) < 0.5, choice[k + 1 : -1], draft[k + 1 :])
    return logits, draft


def ints(*ts: torch.Tensor) -> tuple[int, ...]:
    for t in ts:
        assert t.dim() == 0 and t.dtype == torch.int64
    return tuple(int(t) for t in ts)


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B", [2, 4, 8, 16])
def test_greedy_every_accept_length(B: int, dtype: torch.dtype) -> None:
    V = 1000
    for k in range(B):
        logits, draft = logits_with_accept_length(B, V, k, dtype, seed=100 * B + k)
        ref = ints(*greedy_accept(draft, logits))
        assert ref[0] == k
        assert ints(*greedy_k(draft, logits)) == ref, k


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_greedy_large_vocab(dtype: torch.dtype) -> None:
    """V = 49152 (not a power of two, many programs per row) at every accept length of a 4-block."""
    for k in range(4):
        logits, draft = logits_with_accept_length(4, 49152, k, dtype, seed=7 + k)
        ref = ints(*greedy_accept(draft, logits))
        assert ref[0] == k
        assert ints(*greedy_k(draft, logits)) == ref


@in_interpreter
@pytest.mark.parametrize("max_split", [64, 2])
@pytest.mark.parametrize("V", [7, 1000, 5000])
def test_greedy_ties_take_the_first_index(V: int, max_split: int, monkeypatch: pytest.MonkeyPatch) -> None:
    # Equal maxima inside one chunk and, for V=5000, across the programs of a row (MAX_SPLIT 64)
    # or across the chunks one program loops over (MAX_SPLIT 2).
    monkeypatch.setattr(kernels, "MAX_SPLIT", max_split)
    logits = torch.zeros(3, V)
    spots = [[V - 1, V // 2, 3], [1, 2, V - 2], [V // 3, V - 1, V // 3 + 1]]
    for row, cols in enumerate(spots):
        logits[row, cols] = 4.0
    choice = [min(cols) for cols in spots]
    draft = torch.tensor(choice[:2])
    assert ints(*greedy_k(draft, logits)) == (2, choice[2])
    assert ints(*greedy_accept(draft, logits)) == (2, choice[2])
    # All -inf but one row: torch.argmax picks index 0 of an all -inf row.
    logits[1] = float("-inf")
    draft = torch.tensor([choice[0], 0])
    assert ints(*greedy_k(draft, logits)) == ints(*greedy_accept(draft, logits)) == (2, choice[2])


@in_interpreter
def test_greedy_strided_logits() -> None:
    logits, draft = logits_with_accept_length(5, 3000, 2, torch.float32, seed=3)
    wide = torch.full((5, 3100), 99.0, device=KERNEL_DEVICE)  # made there: a copy would be contiguous
    wide[:, 50:3050] = logits.to(KERNEL_DEVICE)
    view = wide[:, 50:3050]  # row stride 3100, not contiguous as a whole
    assert not view.is_contiguous()
    expected = (2, int(logits[2].argmax()))
    assert ints(*greedy_k(draft, view)) == ints(*greedy_accept(draft, logits)) == expected


@in_interpreter
@pytest.mark.parametrize("B", [2, 4, 8, 16])
def test_greedy_commits_into_the_token_buffer(B: int) -> None:
    out = torch.full((2 + 3 * B,), -7, dtype=torch.long)
    length = torch.tensor([2])
    expected = [-7, -7]
    ref_out, ref_len = out.clone(), length.clone()
    for j, k in enumerate([B - 1, 0, B // 2]):  # three blocks appended one after another
        logits, draft = logits_with_accept_length(B, 300, k, torch.float32, seed=j)
        acc, tok = greedy_k(draft, logits, out, length)
        assert ints(acc, tok) == ints(*greedy_accept(draft, logits))
        expected += [*draft[:k].tolist(), int(tok)]
        assert out[: len(expected)].tolist() == expected
        assert (out[len(expected) :] == -7).all()  # nothing written past the committed tokens
        assert length.tolist() == [len(expected)]
        commit_reference(ref_out, ref_len, draft, acc, tok)
        assert torch.equal(ref_out, out) and torch.equal(ref_len, length)


# ----- speculative sampling -----


def random_block(B: int, V: int, dtype: torch.dtype, g: torch.Generator, sharp: float):
    p = torch.softmax(torch.randn(B, V, generator=g) * sharp, -1)
    q = torch.softmax(torch.randn(B - 1, V, generator=g) * sharp, -1)
    # Mix in p so acceptance is neither always nor never: every accept length shows up.
    mix = torch.rand(B - 1, 1, generator=g)
    q = mix * q + (1 - mix) * p[:-1]
    draft = torch.multinomial(q, 1, generator=g)[:, 0]
    return draft, q.to(dtype), p.to(dtype)


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("B", [2, 4, 8, 16])
def test_speculative_matches_reference(B: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(B)
    seen = set()
    for trial in range(12):
        draft, q, p = random_block(B, 1000, dtype, g, sharp=1.0 + trial % 4)
        u = draw_uniforms(B - 1, g, "cpu")
        ref = ints(*speculative_accept_u(draft, q, p, u))
        assert ints(*spec_k(draft, q, p, u)) == ref, trial
        seen.add(ref[0])
    assert len(seen) >= min(B, 3)  # several accept lengths, not one degenerate case


@in_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_speculative_large_vocab(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(11)
    for sharp in (0.3, 3.0):  # near-uniform rows (long CDF) and peaked ones
        draft, q, p = random_block(4, 49152, dtype, g, sharp)
        u = draw_uniforms(3, g, "cpu")
        assert ints(*spec_k(draft, q, p, u)) == ints(*speculative_accept_u(draft, q, p, u))


@in_interpreter
@pytest.mark.parametrize("B", [2, 4, 8, 16])
def test_speculative_every_accept_length(B: int) -> None:
    """u = 0 accepts (p > 0 at the draft token); a q far above p at position k with u = 0.5 rejects."""
    g = torch.Generator().manual_seed(40 + B)
    V = 97
    for k in range(B):
        draft, q, p = random_block(B, V, torch.float32, g, sharp=2.0)
        u = draw_uniforms(B - 1, g, "cpu")
        u[:k] = 0.0
        if k < B - 1:
            q[k] = 0.01 / (V - 1)
            q[k, draft[k]] = 0.99
            p[k, draft[k]] = 0.2 / V
            p[k] /= p[k].sum()
            u[k] = 0.5
        ref = ints(*speculative_accept_u(draft, q, p, u))
        assert ref[0] == k
        assert ints(*spec_k(draft, q, p, u)) == ref
        if k < B - 1:
            assert p[k, ref[1]] > q[k, ref[1]]  # the correction comes from max(0, p - q)


@in_interpreter
def test_speculative_empty_residual_falls_back_to_p() -> None:
    # p's row 0 is half of q's: max(0, p - q) is empty, the rule samples from p's row instead
    # (unnormalised: CDF 0.05, 0.05, 0.35, 0.5, 0.5 of a total 0.5).
    q = torch.tensor([[0.1, 0.0, 0.6, 0.3, 0.0]])
    p = torch.cat([q * 0.5, torch.tensor([[0.2, 0.2, 0.2, 0.2, 0.2]])])
    draft = torch.tensor([2])
    for u_final, token in [(0.0, 0), (0.05, 0), (0.3, 2), (0.65, 2), (0.75, 3), (0.999, 3)]:
        u = torch.tensor([0.9, u_final], dtype=torch.float64)  # 0.9 * 0.6 >= 0.3: rejected
        assert ints(*speculative_accept_u(draft, q, p, u)) == (0, token)
        assert ints(*spec_k(draft, q, p, u)) == (0, token)


@in_interpreter
def test_speculative_cdf_boundaries_and_zero_weights() -> None:
    # Full accept (u = 0): the bonus comes from p's last row, whose weights are binary fractions,
    # so the CDF [0, 0.25, 0.5, 0.5, 1.0, 1.0] is exact: a u on a boundary goes to the next token.
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0], [0.0, 0.25, 0.25, 0.0, 0.5, 0.0]])
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0, 0.0, 0.0]])
    draft = torch.tensor([1])
    largest_u = 1.0 - 2.0**-53  # torch.rand's largest float64
    for u_final, token in [(0.0, 1), (0.1, 1), (0.25, 2), (0.4999, 2), (0.5, 4), (0.75, 4), (largest_u, 4)]:
        u = torch.tensor([0.0, u_final], dtype=torch.float64)
        assert ints(*speculative_accept_u(draft, q, p, u)) == (1, token), u_final
        assert ints(*spec_k(draft, q, p, u)) == (1, token), u_final
    # A row that ends in zeros: the largest u lands on the last positive token. So does u = 1
    # (torch.rand never draws it), which stands in for rounding that puts u * total at or past
    # the cdf's end (the kernel sums the total and the cdf in different orders): never a
    # zero-weight token, never an index past the vocabulary.
    p = torch.softmax(torch.randn(2, 3001, generator=torch.Generator().manual_seed(5)), -1)
    p[1, 2000:] = 0.0
    q = p[:1].clone()
    draft = torch.tensor([int(p[0].argmax())])
    for u_final in (largest_u, 1.0):
        u = torch.tensor([0.0, u_final], dtype=torch.float64)
        assert ints(*speculative_accept_u(draft, q, p, u)) == (1, 1999)
        assert ints(*spec_k(draft, q, p, u)) == (1, 1999)


@in_interpreter
@pytest.mark.parametrize("B", [2, 4, 8, 16])
def test_speculative_commits_into_the_token_buffer(B: int) -> None:
    g = torch.Generator().manual_seed(B + 1)
    out = torch.full((3 + 4 * B,), -7, dtype=torch.long)
    length = torch.tensor([3])
    expected = [-7, -7, -7]
    for _ in range(4):
        draft, q, p = random_block(B, 200, torch.float32, g, sharp=2.0)
        u = draw_uniforms(B - 1, g, "cpu")
        acc, tok = spec_k(draft, q, p, u, out, length)
        a, t = ints(acc, tok)
        assert (a, t) == ints(*speculative_accept_u(draft, q, p, u))
        expected += [*draft[:a].tolist(), t]
        assert out[: len(expected)].tolist() == expected
        assert (out[len(expected) :] == -7).all()
        assert length.tolist() == [len(expected)]


@pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed")
def test_bad_arguments_are_refused() -> None:
    logits = torch.randn(4, 10)
    with pytest.raises(ValueError, match="draft"):
        kernels.greedy_accept_triton(torch.zeros(4, dtype=torch.long), logits)
    with pytest.raises(ValueError, match="both"):
        kernels.greedy_accept_triton(torch.zeros(3, dtype=torch.long), logits, out=torch.zeros(8, dtype=torch.long))
    with pytest.raises(ValueError, match="shapes"):
        kernels.speculative_accept_triton(torch.zeros(3, dtype=torch.long), torch.rand(3, 10), torch.rand(4, 10),
                                          torch.rand(3, dtype=torch.float64))


# ----- the engine on the kernel path -----


@pytest.fixture(scope="module")
def toy_engine():
    """On the CPU for the interpreter's kernels; on the GPU with DFLASH_KERNEL_TEST_DEVICE=cuda."""
    from toy import toy_target

    from dflash_core.drafter import DFlashDrafter, init_weights
    from dflash_core.drafter_config import config_for_target
    from dflash_core.engine import Engine
    from dflash_core.targets import Target

    target = toy_target()  # vocabulary of 4: a random drafter is right often enough
    if ON_GPU:
        target = Target(model=target.model.to(DEVICE), tokenizer=target.tokenizer, name=target.name,
                        device=DEVICE, dtype=torch.float32)
    cfg = config_for_target(target.config, num_layers=1, block_size=4, mask_token_id=3)
    return Engine(target, init_weights(DFlashDrafter(cfg), std=0.3, seed=2))  # moved to the target's device


@in_interpreter
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_kernel_path_matches_torch_path(toy_engine, temperature: float,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from dflash_core.config import GenerationConfig

    calls = {"n": 0}
    use_triton = kernels.use_triton
    for name in ("greedy_accept_triton", "speculative_accept_triton"):
        original = getattr(kernels, name)

        def counted(*args, _original=original, **kwargs):
            calls["n"] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernels, name, counted)

    def run(kernel_path: bool, seed: int) -> list[tuple[int, list[int]]]:
        # On the CPU the engine takes the kernels only through the interpreter, when asked to.
        monkeypatch.setattr(kernels, "use_triton", lambda device: kernel_path and use_triton(device, interpret=True))
        # A chain (the kernels' accept step), as "auto" picks on a CPU when sampling; greedy "auto" would
        # verify a tree, whose walk runs on the host.
        cfg = GenerationConfig(max_new_tokens=14, block_size=4, temperature=temperature, seed=seed, verify="adaptive")
        events = list(toy_engine.generate(prompts[seed], cfg))
        return [(ev.accepted, ev.committed) for ev in events[:-1]] + [events[-1].token_ids]

    prompts = [[1, 3, 0, 2], [2, 2, 1], [0, 1, 2, 3, 3], [3, 0]]
    accepted = set()
    for seed in range(len(prompts)):
        torch_path = run(False, seed)
        assert calls["n"] == 0
        kernel_path = run(True, seed)
        assert calls["n"] > 0  # the kernels really ran
        calls["n"] = 0
        assert kernel_path == torch_path
        if temperature == 0.0:  # and both are plain greedy decoding's tokens
            plain = list(toy_engine.generate(prompts[seed], GenerationConfig(max_new_tokens=14), plain=True))
            assert kernel_path[-1] == plain[-1].token_ids
        accepted |= {a for a, _ in torch_path[1:-1]}
    assert len(accepted) >= 2  # the comparison saw blocks with different accept lengths

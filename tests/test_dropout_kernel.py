"""Dropout's keep masks (`keep_mask`): hfgpt's C generator (modeling/csrc/dropout.c) and its torch twin
against SplitMix64 written out in Python integers, and the masks' statistics."""

import os
import shutil

import pytest
import torch
from kernel_testing import (  # tests/ is on sys.path
    fresh_kernel_cache,  # noqa: F401 (autouse: each test loads the kernels afresh)
    without_kernel,
)
from test_int8_kernel import portable_library  # tests/ is on sys.path
from test_performance import OpRecorder

from hfgpt.cpu import kernels, native
from hfgpt.cpu import ops as ops_hfgpt
from hfgpt.cpu.ops import keep_mask

CPU = torch.device("cpu")
needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="the dropout kernel needs a C compiler"
)


def splitmix64_keep(n: int, seed: int, p: float) -> list[bool]:
    """The keep mask by definition: word w is SplitMix64's output for seed + (w + 1) * golden ratio (mod
    2^64); element 2w reads its low 32 bits, 2w + 1 its high ones; kept when at least round(p * 2^32)."""
    threshold = min(round(p * 2**32), 2**32 - 1)
    keep = []
    for w in range((n + 1) // 2):
        z = splitmix64_word(seed, w)
        keep += [z & 0xFFFFFFFF >= threshold, z >> 32 >= threshold]
    return keep[:n]


def splitmix64_word(seed: int, w: int) -> int:
    mask = 2**64 - 1
    z = (seed + (w + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def drawn_seed(torch_seed: int) -> int:
    """The 64-bit seed `keep_mask` draws after `torch.manual_seed(torch_seed)`, as an unsigned number."""
    torch.manual_seed(torch_seed)
    return torch.randint(-(2**63), 2**63 - 1, (), dtype=torch.int64).item() % 2**64


def torch_ops_only(monkeypatch) -> None:
    without_kernel(monkeypatch, "dropout")


@pytest.mark.parametrize("path", ["C", "torch"])
@pytest.mark.parametrize(("n", "p", "torch_seed"), [(1, 0.5, 0), (7, 0.3, 1), (1001, 0.1, 2), (4096, 0.9, 3)])
def test_keep_mask_is_splitmix64_of_a_seed_from_torchs_generator(path, n, p, torch_seed, monkeypatch):
    if path == "C":
        if shutil.which(os.environ.get("CC", "cc")) is None:
            pytest.skip("the dropout kernel needs a C compiler")
        assert kernels.available("dropout")
    else:
        torch_ops_only(monkeypatch)
    expected = splitmix64_keep(n, drawn_seed(torch_seed), p)
    torch.manual_seed(torch_seed)
    assert keep_mask((n,), p, CPU).tolist() == expected


@pytest.mark.parametrize("path", ["C", "torch"])
def test_an_element_whose_bits_equal_the_threshold_is_kept(path, monkeypatch):
    """P(drop) is the threshold over 2^32 exactly: the lowest `threshold` values drop, the value equal
    to it is kept."""
    if path == "torch":
        torch_ops_only(monkeypatch)
    elif shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("the dropout kernel needs a C compiler")
    low = splitmix64_word(drawn_seed(5), 0) & 0xFFFFFFFF  # the first element's 32 bits
    for threshold, kept in ((low, True), (low + 1, False)):
        torch.manual_seed(5)
        assert keep_mask((1,), threshold / 2**32, CPU).item() is kept


def test_the_torch_twin_wraps_words_past_two_to_the_63_as_the_c_does():
    """Seeds near 2^64 and 2^63 overflow the signed words in the first step and in both products."""
    for seed in (2**64 - 3, 2**63 - 1, 2**63 + 17):
        got = ops_hfgpt._keep_mask_torch(301, torch.tensor(ops_hfgpt._signed(seed)), round(0.4 * 2**32))
        assert got.tolist() == splitmix64_keep(301, seed, 0.4)


@needs_compiler
@pytest.mark.parametrize("threads", [1, 2])
def test_the_c_generator_is_the_torch_twin_on_any_number_of_threads(threads, monkeypatch):
    """From 65,536 elements the words are split between threads: the same bits on one and on two, with
    an odd count's last half word."""
    shape = (3, 257, 129)  # 99,459 elements
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(4)
        native_mask = keep_mask(shape, 0.2, CPU)
    finally:
        torch.set_num_threads(previous)
    torch_ops_only(monkeypatch)
    torch.manual_seed(4)
    assert torch.equal(native_mask, keep_mask(shape, 0.2, CPU))


def test_keep_mask_pairs_of_one_word_are_independent():
    """The two halves of a word decide neighbouring elements: each of the four (kept, kept) combinations
    is a quarter of the pairs at p = 1/2 (Binomial(500,000, 1/4): standard deviation 306, 6 sigma 1,837),
    and 2 x 2 neighbours across words too."""
    torch.manual_seed(0)
    keep = keep_mask((1_000_000,), 0.5, CPU).view(-1, 2).long()
    for pairs in (keep, keep.view(-1)[1:-1].view(-1, 2)):
        counts = torch.bincount(pairs[:, 0] * 2 + pairs[:, 1], minlength=4)
        assert (counts - len(pairs) / 4).abs().max() < 6 * (len(pairs) * 3 / 16) ** 0.5, counts


def test_successive_masks_differ_and_the_seed_repeats_them():
    torch.manual_seed(9)
    first, second = keep_mask((4, 100), 0.5, CPU), keep_mask((4, 100), 0.5, CPU)
    assert not torch.equal(first, second)
    torch.manual_seed(9)
    assert torch.equal(keep_mask((4, 100), 0.5, CPU), first)


@needs_compiler
def test_a_dispatch_mode_sees_the_c_generator_as_one_operator():
    """The C generator is a torch operator (`torch.ops.hfgpt.keep_mask`): a torch dispatch mode (make_fx,
    FlopCounterMode, a profiler's timer) records it as one op, and it computes the same bits there."""

    torch.manual_seed(2)
    plain = keep_mask((70_000,), 0.1, CPU)
    torch.manual_seed(2)
    with OpRecorder() as recorder:
        recorded = keep_mask((70_000,), 0.1, CPU)
    assert torch.equal(recorded, plain)
    assert torch.ops.hfgpt.keep_mask.default in recorder.ops
    assert torch.ops.aten.mul_.Tensor not in recorder.ops  # (SplitMix64's products in torch's ops)


@needs_compiler
def test_the_c_generator_refuses_a_thread_count_below_one():
    library = native.kernel("dropout")
    keep = torch.empty(10, dtype=torch.bool)
    assert library.hfgpt_keep_mask(keep.data_ptr(), 10, 1, 0, 0) == 2
    assert library.hfgpt_keep_mask(keep.data_ptr(), -1, 1, 0, 1) == 2


def test_hfgpt_native_0_gives_the_same_masks(monkeypatch):
    torch.manual_seed(6)
    default = keep_mask((5, 3000), 0.25, CPU)
    monkeypatch.setenv("HFGPT_NATIVE", "0")
    native.kernel.cache_clear()
    assert not kernels.available("dropout")
    torch.manual_seed(6)
    assert torch.equal(keep_mask((5, 3000), 0.25, CPU), default)


@needs_compiler
def test_a_build_without_march_native_gives_the_same_bits(tmp_path):
    """On a CPU without AVX-512 the loop is compiled for plain x86-64 (or another architecture): the same
    words, on one thread and split between two."""
    library = portable_library(tmp_path, "dropout")
    seed, threshold = 2**64 - 12345, round(0.3 * 2**32)
    expected = ops_hfgpt._keep_mask_torch(70_001, torch.tensor(ops_hfgpt._signed(seed)), threshold)
    for threads in (1, 2):
        keep = torch.empty(70_001, dtype=torch.bool)
        assert library.hfgpt_keep_mask(keep.data_ptr(), 70_001, seed, threshold, threads) == 0
        assert torch.equal(keep, expected)

"""hfgpt's row product kernels (cpu/csrc/row_product.c): `few_rows_product` at 1 to 16 float32 rows (an
`[out, in]` weight: the LM head of a decoding step, a decoding copy's layers) and `one_row_bfloat16` against
torch's products, in a decoding step, and where they step aside."""

import pytest
import torch
import torch.nn.functional as F
from conftest import intra_op_threads  # tests/ is on sys.path
from kernel_testing import (  # tests/ is on sys.path
    NARROW_TARGETS,
    OpRecorder,
    fresh_kernel_cache,  # noqa: F401 (autouse: each test loads the kernels afresh)
    narrow_build,
    needs_kernel,
    record_kernel_calls,
    using_library,
)
from transformers import GPT2LMHeadModel

from hfgpt.cpu import kernels, native, quantization
from hfgpt.cpu.products import few_rows_applies, few_rows_product, one_row_bfloat16
from hfgpt.cpu.quantization import quantize_for_decoding
from hfgpt.modeling import GPTConfig, GPTForCausalLM
from hfgpt.modeling.interop import to_transformers

pytestmark = needs_kernel  # the same C compiler as the attention kernel


@pytest.fixture
def kernel_calls(monkeypatch) -> list[str]:
    """The names of the kernel's entry points as they are called (and still run)."""
    return record_kernel_calls(monkeypatch, "row_product")


def assert_as_close_as_torch(got: torch.Tensor, torchs: torch.Tensor, exact: torch.Tensor) -> None:
    """`got` within 4x torch's own largest error of the float64 product (sums of thousands of terms round
    differently in another order), plus 1e-6."""
    tolerance = 4 * (torchs.double() - exact).abs().max().item() + 1e-6
    torch.testing.assert_close(got.double(), exact, atol=tolerance, rtol=0)


# (out, in): a single vector and a partial one, whole blocks of 64 inputs and a tail, more output rows
# than the threads split evenly, GPT-2's shapes
SHAPES = [(1, 1), (5, 15), (7, 17), (33, 64), (97, 130), (2304, 768), (768, 3072)]


@pytest.mark.parametrize("torch_threads", [2, 3], indirect=True)
@pytest.mark.parametrize("rows, bias", [(1, False), (2, True), (3, False), (16, True)])
@pytest.mark.parametrize("out, width", SHAPES)
def test_row_product_equals_f_linear(out, width, rows, bias, torch_threads, kernel_calls):
    generator = torch.Generator().manual_seed(out + width)
    x, weight = torch.randn(rows, width, generator=generator), torch.randn(out, width, generator=generator)
    b = torch.randn(out, generator=generator) if bias else None
    with torch.no_grad():
        assert few_rows_applies(x, weight, b)
        got = few_rows_product(x, weight, b)
    assert kernel_calls == ["hfgpt_row_product"]
    assert got.shape == (rows, out) and got.is_contiguous()
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert_as_close_as_torch(got, F.linear(x, weight, b), exact)


def test_a_rows_products_do_not_depend_on_the_rows_beside_it_or_the_threads(kernel_calls):
    """Each row of x is summed in the same order alone, in a pair or as the odd row out, on any number of
    threads: a sequence's logits are the same bits at every batch size."""
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(16, 203, generator=generator), torch.randn(97, 203, generator=generator)
    with torch.no_grad():
        with intra_op_threads(2):
            batch = few_rows_product(x, weight)
            assert torch.equal(few_rows_product(x[3:6], weight), batch[3:6])  # row 5 the odd one out
            for row in range(16):
                assert torch.equal(few_rows_product(x[row : row + 1], weight), batch[row : row + 1])
        with intra_op_threads(3):
            assert torch.equal(few_rows_product(x, weight), batch)
    assert kernel_calls == ["hfgpt_row_product"] * 19


def test_the_row_product_steps_aside_for_what_it_would_misread(kernel_calls):
    """A strided weight or bias, one of another dtype or shape, gradients, more than `FEW_ROWS` rows: not the
    kernel's (no exception where `F.linear` raises none); the float32 decoding copy's layer runs `F.linear`."""
    x, weight, bias = torch.randn(2, 48), torch.randn(40, 48), torch.randn(80)
    with torch.no_grad():
        assert few_rows_applies(x, weight, bias[:40]) and few_rows_applies(x, weight)
        for args in [
            (x, weight, bias[::2]), (x, weight.T.contiguous().T), (x, weight, bias[:40].double()),
            (x, weight, bias[:40, None]), (torch.randn(17, 48), weight),
        ]:  # fmt: skip
            assert not few_rows_applies(*args)
        layer = quantization.DecodingLinear(48, 40)
        layer.bias = torch.nn.Parameter(bias[::2])
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, bias[::2]))
    assert not few_rows_applies(x, weight.requires_grad_())
    assert kernel_calls == []


@pytest.mark.parametrize("torch_threads", [2], indirect=True)
def test_row_products_keep_nans_and_infinities(torch_threads, kernel_calls):
    x, weight = torch.ones(1, 40), torch.ones(6, 40)
    weight[1, 3], weight[2, 39], weight[3, 0] = float("nan"), float("inf"), float("-inf")
    with torch.no_grad():
        torch.testing.assert_close(few_rows_product(x, weight), F.linear(x, weight), equal_nan=True)
    assert kernel_calls == ["hfgpt_row_product"]


@pytest.mark.parametrize("torch_threads", [2], indirect=True)
@pytest.mark.parametrize("family, batch", [("gpt2", 1), ("gpt1", 1), ("gpt2", 3), ("gpt1", 3)])
def test_greedy_decoding_runs_the_kernel_with_transformers_tokens(family, batch, torch_threads, kernel_calls):
    """A decoding step runs every block in one call into csrc/row_product.c's step and the LM head on the
    `[out, in]` row product, in the model and in its float32 decoding copy alike, at batch size 1 and with
    a left-padded batch of 3: the tokens are transformers' on the same weights, the logits equal to float
    rounding."""
    torch.manual_seed(0)
    config = GPTConfig.from_preset(
        "gpt2" if family == "gpt2" else "openai-gpt", n_embd=128, n_layer=2, n_head=2, vocab_size=500,
        n_positions=64,
    )  # fmt: skip
    model = GPTForCausalLM(config).eval()
    peer = to_transformers(model).eval()
    copy = quantize_for_decoding(model, torch.float32)
    ids, mask = torch.randint(0, 500, (batch, 9)), torch.ones(batch, 9, dtype=torch.long)
    mask[1:, :3] = 0  # (rows after the first left-padded)
    settings = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        expected = peer.generate(ids, **settings)
        for decoder in (model, copy):
            kernel_calls.clear()
            assert torch.equal(decoder.generate(ids, **settings), expected)
            # each of the 11 steps after the prompt's: the blocks in one call, then the LM head
            assert kernel_calls == ["hfgpt_float_decode_step", "hfgpt_row_product"] * 11
        step = ids[:, -1:]
        cache = model(ids[:, :-1], attention_mask=mask[:, :-1], use_cache=True).past_key_values
        torch.testing.assert_close(
            model(step, attention_mask=mask, past_key_values=cache).logits,
            peer(ids, attention_mask=mask).logits[:, -1:], atol=1e-5, rtol=1e-5,
        )  # fmt: skip
    assert isinstance(peer, GPT2LMHeadModel) == (family == "gpt2")


@pytest.mark.parametrize("torch_threads", [2], indirect=True)
def test_a_dispatch_mode_sees_the_row_product_kernel_and_hfgpt_native_0_leaves_it(
    torch_threads, kernel_calls, monkeypatch
):
    """The kernel is a torch operator (`torch.ops.hfgpt.row_product`): a dispatch mode records it as one op.
    With `HFGPT_NATIVE=0` it does not apply, and the caller's own product runs."""
    x, weight = torch.randn(4, 48), torch.randn(40, 48)
    with torch.no_grad():
        with OpRecorder() as recorder:
            got = few_rows_product(x, weight)
        assert kernel_calls == ["hfgpt_row_product"] and torch.ops.hfgpt.row_product.default in recorder.ops
        assert torch.ops.aten.mm.default not in recorder.ops  # (torch's product)
        torch.testing.assert_close(got, F.linear(x, weight), atol=1e-5, rtol=1e-5)
        monkeypatch.setenv("HFGPT_NATIVE", "0")
        native.kernel.cache_clear()
        assert not kernels.available("row_product") and not few_rows_applies(x, weight)


@pytest.mark.parametrize("target", NARROW_TARGETS)
def test_a_build_for_narrower_vectors_gives_the_same_row_products(target, tmp_path, monkeypatch):
    """csrc/row_product.c built for narrower vectors than the host's (`NARROW_TARGETS`: AVX2's 8 lanes, the
    baseline's 4 without FMA) is the same source as
    the native build: the same products to float rounding, at widths that end in a partial vector, the
    bfloat16 one's included."""
    generator = torch.Generator().manual_seed(0)
    x, weight = torch.randn(5, 203, generator=generator), torch.randn(45, 203, generator=generator)
    bias = torch.randn(45, generator=generator)
    halves = [t.bfloat16() for t in (x[:1], weight, bias)]
    results = []
    library = narrow_build(tmp_path, "row_product", target)
    for build in (None, library):
        with monkeypatch.context() as patch:  # (undone before the fixture clears the real kernel's cache)
            if build is not None:
                using_library(patch, "row_product", build)
            products = []
            for threads in (2, 3):
                with intra_op_threads(threads):
                    products += [
                        kernels.row_product(x, weight, bias),
                        kernels.row_product(x[:1], weight, None),
                    ]
            results.append((*products, kernels.row_product_bf16(*halves)))
    for got, narrow in zip(*results, strict=True):  # (bfloat16 sums may round apart in the last place)
        rtol = 1e-5 if got.dtype == torch.float32 else 2.0**-7
        torch.testing.assert_close(narrow.float(), got.float(), atol=1e-5, rtol=rtol)
    expected_products = [F.linear(x, weight, bias), F.linear(x[:1], weight)] * 2
    for got, expected in zip(results[1][:4], expected_products, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)
    exact = F.linear(*(t.double() for t in halves))
    assert ((results[1][4].double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-6).all()


@pytest.mark.parametrize("torch_threads", [2, 3], indirect=True)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out, width", [*SHAPES, (3, 31), (4, 95)])  # and tails of 8, 16 and 32 inputs
def test_bfloat16_row_product_equals_torchs(out, width, bias, torch_threads, kernel_calls):
    """Exact products summed in float32, the bias added, one rounding: torch's bfloat16 product gives
    the same bits but for a rare last-place difference where the float32 sums round apart."""
    generator = torch.Generator().manual_seed(out + width)
    x = torch.randn(1, width, generator=generator).bfloat16()
    weight = (torch.randn(out, width, generator=generator) * 0.1).bfloat16()
    b = torch.randn(out, generator=generator).bfloat16() if bias else None
    with torch.no_grad():
        got = one_row_bfloat16(x, weight, b)
        theirs = F.linear(x, weight, b)
    assert kernel_calls == ["hfgpt_row_product_bf16"]
    assert got.dtype == torch.bfloat16 and got.shape == (1, out)
    exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
    assert (got == theirs).float().mean() >= 0.99
    # one bfloat16 rounding of a float32 sum: within 2^-8 of the exact value, as torch's
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0**-8 + 1e-6).all()


def test_bfloat16_row_product_keeps_nans_and_infinities():
    x, weight = torch.ones(1, 40, dtype=torch.bfloat16), torch.ones(4, 40, dtype=torch.bfloat16)
    weight[1, 3], weight[2, 39], weight[3, 0] = float("nan"), float("inf"), float("-inf")
    with torch.no_grad():
        got = one_row_bfloat16(x, weight, None)
    torch.testing.assert_close(got, F.linear(x, weight), equal_nan=True)


def test_bfloat16_row_product_steps_aside_for_gradients_other_dtypes_and_strides(kernel_calls):
    x, weight = torch.randn(1, 48).bfloat16(), torch.randn(40, 48).bfloat16()
    with torch.no_grad():
        assert one_row_bfloat16(x.float(), weight.float(), None) is None
        assert one_row_bfloat16(x, weight.T.contiguous().T, None) is None
    assert one_row_bfloat16(x, weight.requires_grad_(), None) is None
    assert kernel_calls == []


def test_bfloat16_decoding_copy_runs_the_kernel_with_torchs_logits(kernel_calls, monkeypatch):
    """Every layer and the LM head of a bfloat16 decoding copy at batch size 1 run on the kernel; the
    logits of a decoding step are those of torch's bfloat16 products to bfloat16 rounding."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=500, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    copy = quantize_for_decoding(GPTForCausalLM(config).eval(), torch.bfloat16)
    ids = torch.randint(0, 500, (1, 9))
    with torch.no_grad():
        cache = copy(ids[:, :-1], use_cache=True).past_key_values
        kernel_calls.clear()
        logits = copy(ids[:, -1:], past_key_values=cache).logits
        assert kernel_calls == ["hfgpt_row_product_bf16"] * (4 * config.n_layer + 1)
        monkeypatch.setattr(quantization, "one_row_bfloat16", lambda *args: None)
        cache = copy(ids[:, :-1], use_cache=True).past_key_values
        theirs = copy(ids[:, -1:], past_key_values=cache).logits
    torch.testing.assert_close(logits.float(), theirs.float(), atol=0.02, rtol=0.02)

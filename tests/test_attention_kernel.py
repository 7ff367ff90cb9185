"""hfgpt's causal attention kernel for CPU prefill (cpu/csrc/attention.c, `native_causal_attention`)
against torch's sdpa, where the model runs it, and where it steps aside."""

import contextlib
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import (
    NARROW_TARGETS,
    fresh_kernel_cache,  # noqa: F401 (autouse: each test loads the kernels afresh)
    narrow_build,
    using_library,
)
from test_performance import (  # tests/ is on sys.path
    OpRecorder,
    assert_checkpointing_keeps_the_gradients,
    band_keep_masks,
    masked_softmax_attention,
    seeded_step,
)
from torch.testing._internal.two_tensor import TwoTensor

from hfgpt.cpu import decoding, kernels
from hfgpt.cpu import ops as ops_hfgpt
from hfgpt.cpu.ops import (
    native_attention_applies,
    native_causal_attention,
    native_decode_attention,
)
from hfgpt.modeling import GPTConfig, GPTForCausalLM

# The kernels are one portable source each, built with the machine's C compiler for its own vectors (AVX2,
# AVX-512, NEON): they run wherever there is a compiler. Without one the model runs sdpa, which the tests
# below of where the kernel steps aside exercise.
needs_kernel = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="hfgpt's C kernels need a C compiler"
)


def _config(**overrides) -> GPTConfig:
    """A two-layer model with heads of 64 (128 wide, 2 heads), as every GPT-1 and GPT-2 size has."""
    return GPTConfig(
        **{"vocab_size": 96, "n_positions": 160, "n_embd": 128, "n_layer": 2, "n_head": 2, **overrides}
    )


def _qkv(batch: int, heads: int, length: int, scale: float = 1.0, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Queries, keys and values as the model hands them over: (B, H, T, 64) views of one projection."""
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, length, 3, heads, 64, generator=generator) * scale
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal sdpa in float64, as (B, T, H, D) float32."""
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, scale=scaling)
    return out.transpose(1, 2).float()


def _assert_as_close_as_sdpa(got: torch.Tensor, q, k, v, scaling: float) -> None:
    """Against sdpa in float64: on average within a small factor of torch's float32 sdpa's own error (a few
    1e-7 for GPT-like scores), and at most 2.5 times its largest error plus 2e-6."""
    want = _sdpa(q, k, v, scaling)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling).transpose(1, 2)
    error, sdpa_error = (got - want).abs(), (sdpa - want).abs()
    assert error.mean() <= 2.5 * sdpa_error.mean() + 1e-9
    assert error.max() <= 2.5 * sdpa_error.max() + 2e-6


@needs_kernel
@pytest.mark.parametrize(
    "batch,heads,length",
    [(1, 1, 1), (1, 2, 7), (2, 3, 8), (1, 2, 9), (2, 1, 33), (1, 3, 100), (1, 12, 512), (2, 2, 1030)],
)
def test_kernel_equals_causal_sdpa(batch, heads, length):
    """Lengths around the kernel's blocks of 8 query rows and 32 keys, from one position to past GPT-2's
    1024: as close to sdpa in float64 as torch's own float32 sdpa is."""
    q, k, v = _qkv(batch, heads, length, scale=2.0)
    assert native_attention_applies(q, k, v, None)
    got, weights = native_causal_attention(torch.nn.Module(), q, k, v, None, scaling=0.125)
    assert weights is None and got.shape == (batch, length, heads, 64) and got.is_contiguous()
    _assert_as_close_as_sdpa(got, q, k, v, 0.125)


@needs_kernel
def test_kernel_is_stable_for_large_scores_and_contiguous_inputs():
    """Scores in the thousands (the softmax subtracts each row's maximum; weights far below it underflow
    to zero) and contiguous (B, H, T, D) inputs, whose row strides differ from the projection's views."""
    q, k, v = (t.contiguous() for t in _qkv(2, 3, 70, scale=8.0))
    got, _ = native_causal_attention(torch.nn.Module(), q, k, v, None, scaling=1.0)
    assert torch.isfinite(got).all()
    _assert_as_close_as_sdpa(got, q, k, v, 1.0)


@needs_kernel
def test_a_non_finite_input_reaches_only_the_rows_that_see_it():
    """A NaN in position 20's query makes row 20 NaN; a NaN in position 30's key or value makes rows 30
    and later NaN, and never an earlier row, even one in the same block of 8 (torch's flash kernel lets
    a NaN value reach earlier rows of its block); every other row is unchanged."""
    clean = [t.contiguous() for t in _qkv(1, 2, 40)]
    q, k, v = (t.clone() for t in clean)
    q[0, 0, 20, 5] = float("nan")
    v[0, 0, 30, 3] = float("nan")
    k[0, 1, 30, 0] = float("nan")
    got, _ = native_causal_attention(torch.nn.Module(), q, k, v, None, scaling=0.125)
    expected_nan = torch.zeros(1, 40, 2, dtype=torch.bool)  # (B, T, H)
    expected_nan[0, 20, 0] = True
    expected_nan[0, 30:, :] = True
    assert torch.equal(got.isnan().any(-1), expected_nan)
    want, _ = native_causal_attention(torch.nn.Module(), *clean, None, scaling=0.125)
    assert torch.equal(got[~expected_nan], want[~expected_nan])


@needs_kernel
def test_kernel_result_does_not_depend_on_the_thread_count():
    q, k, v = _qkv(2, 5, 77)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = native_causal_attention(torch.nn.Module(), q, k, v, None, scaling=0.125)
        torch.set_num_threads(3)
        three, _ = native_causal_attention(torch.nn.Module(), q, k, v, None, scaling=0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, three)


@needs_kernel
def test_native_attention_applies_only_to_unmasked_float32_causal_inference():
    q, k, v = _qkv(1, 2, 16)
    assert native_attention_applies(q, k, v, None)
    assert not native_attention_applies(q, k, v, torch.ones(16, 16, dtype=torch.bool).tril())  # padding
    assert not native_attention_applies(q[:, :, -1:], k, v, None)  # a decoding step against cached keys
    assert not native_attention_applies(*(t.bfloat16() for t in (q, k, v)), None)  # bf16 or autocast
    assert not native_attention_applies(*(t[..., :32] for t in (q, k, v)), None)  # heads of 32
    assert not native_attention_applies(*(t.transpose(2, 3) for t in (q, k, v)), None)  # strided rows
    assert not native_attention_applies(q.clone().requires_grad_(), k, v, None)  # autograd: sdpa's backward
    assert not native_attention_applies(*(t.to("meta") for t in (q, k, v)), None)  # no values to read
    # A __torch_dispatch__ subclass, whose data_ptr() is 0
    two = [TwoTensor(t, t * 2) for t in (t.contiguous() for t in (q, k, v))]
    assert not native_attention_applies(*two, None)
    # A negated view holds the negatives of its values: torch's dispatcher hands the kernel's operator the
    # values themselves.
    assert native_attention_applies(q, torch._neg_view(k), v, None)
    got = native_causal_attention(torch.nn.Module(), q, torch._neg_view(k), v, None, scaling=0.125)[0]
    _assert_as_close_as_sdpa(got, q, -k, v, 0.125)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # sdpa would compute in bfloat16
        assert not native_attention_applies(q, k, v, None)
    # Shapes sdpa broadcasts or accepts, which the kernel does not read: fewer key and value heads, values
    # of another width, a 3-D input.
    assert not native_attention_applies(q, k[:, :1], v[:, :1], None)
    assert not native_attention_applies(q, k, v[..., :32], None)
    assert not native_attention_applies(q[0], k[0], v[0], None)


@needs_kernel
def test_dispatch_modes_see_the_kernel_as_one_operator():
    """The kernel is a torch operator (`torch.ops.hfgpt.causal_attention`): `make_fx` records it in its
    graph (replayed on new inputs it gives their attention), and a mode that counts ops (as FlopCounterMode
    does) sees it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def attention(q, k, v):
        if native_attention_applies(q, k, v, None):
            return native_causal_attention(torch.nn.Module(), q, k, v, None, scaling=0.125)[0]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125).transpose(1, 2)

    q, k, v = (t.contiguous() for t in _qkv(1, 2, 40))
    graph = make_fx(attention, tracing_mode="real")(q, k, v)
    new = [t.contiguous() for t in _qkv(1, 2, 40, seed=1)]
    torch.testing.assert_close(graph(*new), _sdpa(*new, 0.125), atol=1e-5, rtol=1e-5)
    assert torch.ops.hfgpt.causal_attention.default in {node.target for node in graph.graph.nodes}
    with OpRecorder() as recorder:
        attention(q, k, v)
    assert torch.ops.hfgpt.causal_attention.default in recorder.ops
    assert not any("scaled_dot_product" in str(op) for op in recorder.ops)


def test_without_the_kernel_prefill_takes_sdpa(monkeypatch):
    """`HFGPT_NATIVE=0` (or no compiler): the kernel is off and the model's prefill runs
    sdpa (in bands), with the same logits as its autograd forward."""
    monkeypatch.setenv("HFGPT_NATIVE", "0")
    q, k, v = _qkv(1, 2, 16)
    assert not kernels.available("attention") and not native_attention_applies(q, k, v, None)
    model = GPTForCausalLM(_config()).eval()
    ids = torch.randint(0, 96, (2, 150))
    with torch.no_grad():
        got = model(ids).logits
    torch.testing.assert_close(got, model(ids).logits.detach(), atol=1e-5, rtol=1e-5)


@pytest.fixture
def prefill_calls(monkeypatch) -> list[torch.Size]:
    """Records the query shape of each attention the model runs on the kernel without autograd."""
    calls = []
    monkeypatch.setattr(
        ops_hfgpt,
        "native_causal_attention",
        lambda *a, **k: calls.append(a[1].shape) or native_causal_attention(*a, **k),
    )
    return calls


@needs_kernel
@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
def test_model_prefill_runs_the_kernel_and_equals_its_autograd_forward(layer_norm_position, prefill_calls):
    """A GPT-2 (pre-norm) or GPT-1 (post-norm) model with heads of 64: inference without a mask runs the
    kernel in every layer and gives the logits of the autograd forward (sdpa); with left padding (a mask)
    it runs sdpa."""
    config = _config(layer_norm_position=layer_norm_position)
    torch.manual_seed(0)
    model = GPTForCausalLM(config).eval()
    ids = torch.randint(0, 96, (2, 150))
    expected = model(ids).logits.detach()
    assert not prefill_calls  # autograd: sdpa
    with torch.inference_mode():
        got = model(ids).logits
    assert prefill_calls == [(2, 2, 150, 64)] * 2
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0
    with torch.no_grad():
        model(ids, attention_mask=mask)
    assert len(prefill_calls) == 2


@pytest.fixture
def decode_calls(monkeypatch) -> list[tuple]:
    """Records (query shape, key shape, mask shape or None) of each decoding step's attention on the kernel
    (`native_decode_attention`)."""
    calls = []

    def spy(*args, **kwargs):
        mask = args[4]
        calls.append(
            (tuple(args[1].shape), tuple(args[2].shape), None if mask is None else tuple(mask.shape))
        )
        return native_decode_attention(*args, **kwargs)

    monkeypatch.setattr(ops_hfgpt, "native_decode_attention", spy)
    return calls


@needs_kernel
@pytest.mark.parametrize("batch", [1, 3])
def test_generate_with_the_kernels_gives_the_tokens_of_sdpa(batch, prefill_calls, decode_calls, monkeypatch):
    """Greedy decoding of a GPT-2-shaped model block by block: the prompt's prefill on the causal kernel
    (without padding), then each cached step on the decoding kernel, left-padded rows through its key mask;
    the same tokens as with both kernels off (sdpa). (A whole step in one call: tests/test_float_step.py.)"""
    monkeypatch.setattr(decoding, "decodes_in_one_call", lambda *args: False)
    torch.manual_seed(0)
    model = GPTForCausalLM(_config()).eval()
    ids = torch.randint(0, 96, (batch, 40))
    mask = torch.ones_like(ids)
    mask[1:, :7] = 0  # rows after the first left-padded
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=95)
    with_kernel = model.generate(ids, **kwargs)
    assert prefill_calls == ([(1, 2, 40, 64)] * 2 if batch == 1 else [])  # the prefill, in both layers
    key_mask = None if batch == 1 else (batch, 1, 1)
    assert decode_calls == [
        ((batch, 2, 1, 64), (batch, 2, 40 + step, 64), key_mask and (*key_mask, 40 + step))
        for step in range(1, 12)
        for _ in range(2)
    ]
    monkeypatch.setattr(ops_hfgpt, "native_attention_applies", lambda *a: False)
    monkeypatch.setattr(ops_hfgpt, "native_decode_attention_applies", lambda *a: False)
    assert torch.equal(with_kernel, model.generate(ids, **kwargs))
    assert len(prefill_calls) == (2 if batch == 1 else 0) and len(decode_calls) == 22


def _cached_step(batch: int, heads: int, keys: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """One decoding step's query (a view of its projection) and cached keys and values (the first `keys`
    positions of buffers with spare ones)."""
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, 1, 3, heads, 64, generator=generator).permute(2, 0, 3, 1, 4)[0]
    key, value = (
        torch.randn(batch, heads, keys + 24, 64, generator=generator)[:, :, :keys] for _ in range(2)
    )
    return query, key, value


def _sdpa64(query, key, value, mask, scaling: float) -> torch.Tensor:
    """sdpa in float64, as (B, 1, H, D)."""
    out = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), mask, scale=scaling)
    return out.transpose(1, 2)


@needs_kernel
@pytest.mark.parametrize("batch,heads,keys", [(1, 12, 1), (1, 12, 77), (4, 3, 130), (2, 2, 1100)])
@pytest.mark.parametrize("masked", [False, True])
def test_decoding_kernel_is_sdpa_to_float_rounding(batch, heads, keys, masked):
    """Against sdpa in float64: within 2.5 times float32 sdpa's own largest error plus 2e-7, with a key mask
    per batch entry (transformers' (B, 1, 1, T) for padded prompts) or none."""
    query, key, value = _cached_step(batch, heads, keys)
    mask = None
    if masked:
        mask = torch.rand(batch, 1, 1, keys, generator=torch.Generator().manual_seed(1)) > 0.4
        mask[..., -1] = True  # (the step's own position)
    assert ops_hfgpt.native_decode_attention_applies(query, key, value, mask)
    got, _ = native_decode_attention(torch.nn.Module(), query, key, value, mask, scaling=0.125)
    want = _sdpa64(query, key, value, mask, 0.125)
    theirs = F.scaled_dot_product_attention(query, key, value, mask, scale=0.125).transpose(1, 2)
    assert got.shape == (batch, 1, heads, 64)
    assert (got - want).abs().max() <= 2.5 * (theirs - want).abs().max() + 2e-7


@needs_kernel
def test_decoding_kernel_reads_masks_of_any_batch_stride_and_gives_sdpas_zeros_for_a_row_that_sees_nothing():
    query, key, value = _cached_step(3, 2, 20)
    shared = torch.rand(1, 1, 1, 20, generator=torch.Generator().manual_seed(2)) > 0.5
    shared[..., 0] = True
    last_rows = torch.rand(3, 1, 20, 20, generator=torch.Generator().manual_seed(3)) > 0.5
    last_rows[..., 0] = True
    for mask in (shared, last_rows[:, :, -1:]):  # one row for all (stride 0); rows 400 apart
        got, _ = native_decode_attention(torch.nn.Module(), query, key, value, mask, scaling=0.125)
        torch.testing.assert_close(got, _sdpa64(query, key, value, mask, 0.125).float(), atol=1e-6, rtol=1e-6)
    nothing = torch.ones(3, 1, 1, 20, dtype=torch.bool)
    nothing[1] = False
    got, _ = native_decode_attention(torch.nn.Module(), query, key, value, nothing, scaling=0.125)
    theirs = F.scaled_dot_product_attention(query, key, value, nothing, scale=0.125).transpose(1, 2)
    assert torch.equal(got[1], theirs[1]) and not got[1].any()
    torch.testing.assert_close(got, theirs, atol=1e-6, rtol=1e-6)


@needs_kernel
def test_decoding_kernel_reads_keys_and_values_of_different_layouts():
    """Values laid out otherwise than the keys (batch-major copies, a head stride of 0 from `expand`):
    each read at its own strides."""
    query, key, value = _cached_step(2, 3, 40)
    values = value.transpose(0, 1).contiguous().transpose(0, 1)  # (B, H, T, D) with heads outermost
    shared = value[:, :1].expand(2, 3, 40, 64)
    for v in (values, shared):
        assert ops_hfgpt.native_decode_attention_applies(query, key, v, None)
        got, _ = native_decode_attention(torch.nn.Module(), query, key, v, None, scaling=0.125)
        torch.testing.assert_close(got, _sdpa64(query, key, v, None, 0.125).float(), atol=1e-6, rtol=1e-6)


@needs_kernel
def test_decoding_kernel_never_reads_masked_keys_and_values():
    """Masked positions weigh exactly 0 and are not read: NaN keys and infinite values there leave the
    output that of the same step with finite values in their place (sdpa would give NaN)."""
    query, key, value = _cached_step(2, 2, 24)
    mask = torch.ones(2, 1, 1, 24, dtype=torch.bool)
    mask[:, ..., 3:6] = False
    want, _ = native_decode_attention(torch.nn.Module(), query, key, value, mask, scaling=0.125)
    torch.testing.assert_close(want, _sdpa64(query, key, value, mask, 0.125).float(), atol=1e-6, rtol=1e-6)
    key, value = key.clone(), value.clone()
    key[:, :, 3], value[:, :, 4], value[:, :, 5] = float("nan"), float("inf"), 1e30
    got, _ = native_decode_attention(torch.nn.Module(), query, key, value, mask, scaling=0.125)
    assert torch.equal(got, want)


@needs_kernel
def test_decoding_kernel_result_does_not_depend_on_the_thread_count():
    query, key, value = _cached_step(2, 12, 90)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(
                native_decode_attention(torch.nn.Module(), query, key, value, None, scaling=0.125)[0]
            )
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], other) for other in results[1:])


def test_decoding_kernel_applies_only_to_one_float32_query_against_cached_heads_of_64():
    query, key, value = _cached_step(2, 2, 30)
    mask = torch.ones(2, 1, 1, 30, dtype=torch.bool)
    takes = kernels.available("attention")  # (without a compiler: never)
    assert ops_hfgpt.native_decode_attention_applies(query, key, value, None) == takes
    assert ops_hfgpt.native_decode_attention_applies(query, key, value, mask) == takes
    assert ops_hfgpt.native_decode_attention_applies(query, key, value, mask[:1]) == takes  # broadcast
    last_row = torch.ones(2, 1, 30, 30, dtype=torch.bool)[:, :, -1:]  # a view with other strides
    assert ops_hfgpt.native_decode_attention_applies(query, key, value, last_row) == takes
    q2, k2, v2 = _qkv(2, 2, 30)
    refused = [
        (q2, k2, v2, None),  # a prompt's queries: the causal kernel's or sdpa's
        (query, key, value, mask.float()),  # an additive mask
        (query, key, value, torch.ones(2, 1, 2, 30, dtype=torch.bool)),  # masks for two query rows
        (query, key, value, torch.ones(2, 2, 1, 30, dtype=torch.bool)),  # a mask per head
        (query, key, value, mask[..., :29]),  # another number of keys
        (query.bfloat16(), key.bfloat16(), value.bfloat16(), None),
        (query[..., :32], key[..., :32], value[..., :32], None),  # heads of 32
        (query, key[:, :1], value[:, :1], None),  # fewer key and value heads
        (query, key.transpose(2, 3).contiguous().transpose(2, 3), value, None),  # strided rows
        (query, key, value, torch.ones(30, 2, dtype=torch.bool).t()[:, None, None, :]),  # strided mask row
        (query.clone().requires_grad_(), key, value, None),  # autograd
        (*(t.to("meta") for t in (query, key, value)), None),  # no values to read
        (*(TwoTensor(t, t * 2) for t in (t.contiguous() for t in (query, key, value))), None),  # data_ptr() 0
    ]
    for index, args in enumerate(refused):
        assert not ops_hfgpt.native_decode_attention_applies(*args), index
    with torch.autocast("cpu", dtype=torch.bfloat16):  # sdpa would compute in bfloat16
        assert not ops_hfgpt.native_decode_attention_applies(query, key, value, None)


@needs_kernel
def test_a_dispatch_mode_sees_the_decoding_kernel_as_one_operator():
    query, key, value = _cached_step(1, 2, 30)
    with OpRecorder() as recorder:
        assert ops_hfgpt.native_decode_attention_applies(query, key, value, None)
        got = ops_hfgpt.native_decode_attention(torch.nn.Module(), query, key, value, None, scaling=0.125)[0]
    assert torch.ops.hfgpt.decode_attention.default in recorder.ops
    torch.testing.assert_close(got.double(), _sdpa64(query, key, value, None, 0.125), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_the_decoding_kernel_reads_negated_views_and_zero_tensors_as_their_values():
    """torch's dispatcher hands the kernel's operator the values of a negated view and of a zero tensor
    (which has no memory of its own)."""
    query, key, value = _cached_step(2, 2, 30)
    zeros = torch._efficientzerotensor(value.shape)
    assert ops_hfgpt.native_decode_attention_applies(query, torch._neg_view(key), zeros, None)
    got = ops_hfgpt.native_decode_attention(
        torch.nn.Module(), query, torch._neg_view(key), zeros, None, 0.125
    )
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    got = ops_hfgpt.native_decode_attention(
        torch.nn.Module(), query, torch._neg_view(key), value, None, 0.125
    )
    want = _sdpa64(query, -key, value, None, 0.125)
    torch.testing.assert_close(got[0].double(), want, atol=1e-5, rtol=1e-5)


# --- training: attention with dropout, forward and backward on the kernel ------------------------------


@pytest.fixture
def kernel_calls(monkeypatch) -> list[str]:
    """Records each forward and backward that runs on the kernel."""
    calls = []
    forward, backward = ops_hfgpt._native_dropout_attention, ops_hfgpt._native_dropout_attention_backward
    monkeypatch.setattr(
        ops_hfgpt, "_native_dropout_attention", lambda *a: calls.append("forward") or forward(*a)
    )
    monkeypatch.setattr(
        ops_hfgpt, "_native_dropout_attention_backward", lambda *a: calls.append("backward") or backward(*a)
    )
    return calls


@needs_kernel
@pytest.mark.parametrize("length", [128, 150, 300])
def test_training_attention_on_the_kernel_is_causal_attention_with_the_drawn_masks(length, kernel_calls):
    """From 128 positions on, training attention with dropout runs forward and backward on the kernel,
    with the keep masks drawn band by band as in sdpa's stand-in: its values and its gradients (through
    the (B, T, 3, H, D) projection the model hands it, from an upstream gradient of another layout) are
    those of the formula in float64, to float rounding."""
    batch, heads, p, scaling = 2, 3, 0.2, 0.125
    qkv = (
        torch.randn(batch, length, 3, heads, 64, generator=torch.Generator().manual_seed(0))
    ).requires_grad_()
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    torch.manual_seed(5)
    got, _ = ops_hfgpt.cpu_dropout_attention(torch.nn.Module(), q, k, v, None, scaling=scaling, dropout=p)
    keep = band_keep_masks(5, batch, heads, length, p)
    upstream = torch.randn(batch, heads, length, 64).transpose(1, 2)  # (B, T, H, D), not contiguous
    (grad,) = torch.autograd.grad(got, qkv, upstream)
    assert kernel_calls == ["forward", "backward"]

    qkv64 = qkv.detach().double().requires_grad_()
    expected = masked_softmax_attention(*qkv64.permute(2, 0, 3, 1, 4).unbind(0), keep, scaling, p)
    (expected_grad,) = torch.autograd.grad(expected, qkv64, upstream.double())
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, expected_grad.float(), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_training_attention_on_the_kernel_has_the_second_derivatives_of_the_formula(kernel_calls):
    """A backward with create_graph=True (a gradient penalty) differentiates the bands through autograd's
    ops with the kernel's keep masks: second derivatives equal the plain formula's."""
    q, k, v = (t.detach().requires_grad_() for t in _qkv(1, 2, 130, seed=1))
    torch.manual_seed(3)
    got, _ = ops_hfgpt.cpu_dropout_attention(torch.nn.Module(), q, k, v, None, scaling=0.125, dropout=0.1)
    keep = band_keep_masks(3, 1, 2, 130, 0.1)
    expected = masked_softmax_attention(q.double(), k.double(), v.double(), keep, 0.125, 0.1).float()
    penalty = sum(
        g.square().sum() for g in torch.autograd.grad(got.sin().sum(), (q, k, v), create_graph=True)
    )
    want = sum(
        g.square().sum() for g in torch.autograd.grad(expected.sin().sum(), (q, k, v), create_graph=True)
    )
    second, want_second = torch.autograd.grad(penalty, q), torch.autograd.grad(want, q)
    # The first backward builds a graph (autograd's ops); the second goes through `got` (sin's derivative)
    # and runs the kernel's backward.
    assert kernel_calls == ["forward", "backward"]
    torch.testing.assert_close(second[0], want_second[0], atol=1e-4, rtol=1e-4)


@needs_kernel
@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
def test_training_step_with_the_kernel_equals_the_step_without_it(
    layer_norm_position, kernel_calls, monkeypatch
):
    """A GPT-2- or GPT-1-shaped model with dropout, heads of 64 and 150 positions: the same seed gives the
    same loss and gradients with the kernel as with torch's bands (the same keep masks)."""
    config = _config(layer_norm_position=layer_norm_position)
    torch.manual_seed(0)
    model = GPTForCausalLM(config).train()
    ids = torch.randint(0, 96, (2, 150))

    loss, grads = seeded_step(model, ids)
    assert kernel_calls == ["forward"] * 2 + ["backward"] * 2  # both layers
    monkeypatch.setattr(ops_hfgpt, "native_attention_takes", lambda *a: False)
    plain_loss, plain_grads = seeded_step(model, ids)
    assert len(kernel_calls) == 4
    torch.testing.assert_close(loss, plain_loss, atol=1e-6, rtol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@needs_kernel
@pytest.mark.parametrize("target", NARROW_TARGETS)
def test_a_build_for_narrower_vectors_gives_the_same_attention(target, tmp_path, monkeypatch):
    """csrc/attention.c built for narrower vectors than the host's (`NARROW_TARGETS`: AVX2's 8 lanes, the
    baseline's 4 without FMA; 4 query rows a block)
    is the same source as the native build: the same prefill and decoding attention, and the same
    training step with dropout, to float rounding."""
    q, k, v = _qkv(2, 3, 45, scale=2.0)
    query, key, value = _cached_step(2, 3, 45)
    mask = torch.rand(2, 1, 1, 45, generator=torch.Generator().manual_seed(1)) > 0.3
    torch.manual_seed(0)
    model = GPTForCausalLM(_config()).train()
    ids = torch.randint(0, 96, (2, 150))
    results = []
    for library in (None, narrow_build(tmp_path, "attention", target)):
        with monkeypatch.context() as patch:  # (undone before the fixture clears the real kernel's cache)
            if library is not None:
                using_library(patch, "attention", library)
            prefill = kernels.causal_attention(q, k, v, 0.125)
            decode = kernels.decode_attention(query, key, value, mask, 0.125)
            loss, grads = seeded_step(model, ids)
            results.append((prefill, decode, loss, *grads.values()))
    _assert_as_close_as_sdpa(results[1][0], q, k, v, 0.125)
    for index, (got, narrow) in enumerate(zip(*results, strict=True)):
        torch.testing.assert_close(narrow, got, atol=1e-5, rtol=1e-4, msg=str(index))


@needs_kernel
def test_a_dispatch_mode_entered_after_the_kernels_forward_sees_its_backward(kernel_calls):
    """A mode around the backward (FlopCounterMode's place) sees the kernel's backward as one operator
    (`torch.ops.hfgpt.attention_train_backward`), with the same gradients."""
    qkv = torch.randn(1, 150, 3, 2, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    upstream = torch.randn(1, 150, 2, 64)
    grads = []
    for mode in (contextlib.nullcontext, OpRecorder):
        torch.manual_seed(4)
        out, _ = ops_hfgpt.cpu_dropout_attention(torch.nn.Module(), q, k, v, None, scaling=0.125, dropout=0.1)
        with mode() as recorder:
            grads.append(torch.autograd.grad(out, qkv, upstream)[0])
    assert kernel_calls == ["forward", "backward"] * 2
    assert torch.ops.hfgpt.attention_train_backward.default in recorder.ops
    torch.testing.assert_close(grads[1], grads[0], atol=1e-5, rtol=1e-5)


@needs_kernel
def test_gradient_checkpointing_replays_the_kernels_keep_masks(kernel_calls):
    """Checkpointing runs each block's forward again in backward: the kernel's keep masks come from the
    default generator, whose state torch.utils.checkpoint restores, so the gradients are those of the
    plain step."""
    torch.manual_seed(0)
    model = GPTForCausalLM(_config(resid_pdrop=0.3, attn_pdrop=0.3)).train()
    assert_checkpointing_keeps_the_gradients(model, torch.randint(0, 96, (2, 150)))
    assert kernel_calls.count("forward") == 2 + 4  # the checkpointed step runs each forward twice

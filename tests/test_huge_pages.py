"""Decoding copies keep their weights in one mapping advised into transparent huge pages
(`hfgpt.cpu.huge_pages`), with every value, tie and output unchanged."""

import copy
import gc
import sys
from pathlib import Path

import pytest
import torch
from test_modeling import Logits  # tests/ is on sys.path
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from hfgpt.cpu import ops, runtime
from hfgpt.cpu.huge_pages import HUGE_PAGE, gather_into_huge_pages, huge_page_buffer
from hfgpt.cpu.quantization import Int8Linear, quantize_for_decoding
from hfgpt.modeling import GPTConfig, GPTForCausalLM

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_for_advised_memory() -> bool:
    """Whether this kernel backs memory advised with MADV_HUGEPAGE by huge pages."""
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    return "[madvise]" in setting or "[always]" in setting


def huge_page_bytes_at(address: int) -> int:
    """AnonHugePages of the mapping holding `address`, from /proc/self/smaps."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def tiny_config(**overrides) -> GPTConfig:
    fields = dict(vocab_size=1000, n_positions=64, n_embd=128, n_layer=2, n_head=4)
    return GPTConfig(**{**fields, **overrides})


def test_buffer_starts_on_a_huge_page_and_is_zeroed():
    buffer, advised = huge_page_buffer(3 * HUGE_PAGE + 100)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 3 * HUGE_PAGE + 100
    assert buffer.data_ptr() % HUGE_PAGE == 0
    assert not buffer.any()
    assert advised == sys.platform.startswith("linux")
    if advised and thp_for_advised_memory():
        buffer.fill_(1)  # the first touch, after the advice, is what gets huge pages (the last one too)
        assert huge_page_bytes_at(buffer.data_ptr()) == 4 * HUGE_PAGE


def test_buffer_outlives_every_reference_but_its_views():
    buffer, _ = huge_page_buffer(HUGE_PAGE)
    view = buffer[64:128].view(torch.float32)
    del buffer
    gc.collect()
    view.fill_(2.5)  # the mapping is still there: the view holds it
    assert view.sum().item() == 2.5 * 16


def test_empty_buffer():
    buffer, _ = huge_page_buffer(0)
    assert buffer.numel() == 0


@pytest.mark.parametrize("family", ["gpt2", "gpt1"])
def test_gathering_keeps_values_ties_and_outputs(family):
    torch.manual_seed(0)
    post_norm = dict(layer_norm_position="post", bos_token_id=None, eos_token_id=None)
    config = tiny_config(**(post_norm if family == "gpt1" else {}))
    model = GPTForCausalLM(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    with torch.no_grad():
        before = model(ids).logits
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    small = model.transformer.h[0].ln_1.weight  # 512 bytes: stays where it is
    small_address = small.data_ptr()

    gather_into_huge_pages(model)

    assert model.lm_head.weight is model.transformer.wte.weight  # still tied, stored once
    moved = [p for p in model.parameters() if p.nbytes >= 1 << 16]
    assert len(moved) >= 2 * config.n_layer + 1
    storages = {p.untyped_storage().data_ptr() for p in moved}
    assert len(storages) == 1
    assert all(p.data_ptr() % 64 == 0 for p in moved)
    assert small.data_ptr() == small_address
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
        twin = copy.deepcopy(model)  # ordinary memory again, the same values
        assert torch.equal(twin(ids).logits, before)


@pytest.mark.parametrize("dtype", [torch.qint8, torch.float32, torch.bfloat16])
def test_decoding_copies_stream_from_one_advised_mapping(dtype):
    torch.manual_seed(0)
    model = GPTForCausalLM(tiny_config(vocab_size=8000, n_embd=256)).eval()  # megabytes to gather
    decoding = quantize_for_decoding(model, dtype)
    large = [t for t in [*decoding.parameters(), *decoding.buffers()] if t.nbytes >= 1 << 16]
    if dtype == torch.qint8:
        assert any(isinstance(m, Int8Linear) and m.packed.nbytes >= 1 << 16 for m in decoding.modules())
    assert len({t.untyped_storage().data_ptr() for t in large}) == 1
    first = min(t.data_ptr() for t in large)
    assert first % HUGE_PAGE == 0
    if sys.platform.startswith("linux") and thp_for_advised_memory():
        assert huge_page_bytes_at(first) > 0
    # The model it was made from keeps its own memory.
    assert all(p.untyped_storage().data_ptr() != first for p in model.parameters())


def test_logits_from_32_mib_on_are_written_into_huge_pages():
    """`row_aligned_mm` (the LM head of a prefill on MKL) writes logits of `HUGE_PAGES_FROM` bytes or more
    into an advised mapping, padded rows included, with `torch.mm`'s values; smaller ones into torch's
    memory."""
    hidden = torch.randn(128, 32, generator=torch.Generator().manual_seed(0))
    weight = torch.randn(65536, 32, generator=torch.Generator().manual_seed(1))
    assert ops.HUGE_PAGES_FROM == 128 * 65536 * 4
    with torch.no_grad(), ops.onednn_products(False):  # (the MKL path, which pads the rows)
        for rows, huge in ((128, True), (127, False)):
            logits = ops.row_aligned_mm(hidden[:rows], weight)
            torch.testing.assert_close(logits, hidden[:rows] @ weight.T, atol=0, rtol=0)
            assert logits.shape == (rows, 65536) and logits.stride() == (65536, 1)
            assert (logits.data_ptr() % HUGE_PAGE == 0) == huge
            if huge and thp_for_advised_memory():
                assert huge_page_bytes_at(logits.data_ptr()) == 16 * HUGE_PAGE


def test_large_empty_keeps_the_dtype_and_shape_asked_for():
    like = torch.zeros((), dtype=torch.bfloat16)
    tensor = ops.large_empty(4096, 4096, like)  # 32 MiB of bfloat16
    assert tensor.dtype == torch.bfloat16 and tensor.shape == (4096, 4096) and tensor.is_contiguous()
    assert tensor.data_ptr() % HUGE_PAGE == 0
    tensor.fill_(1.5)
    assert tensor.float().sum().item() == 1.5 * 4096 * 4096
    assert ops.large_empty(3, 5, like).shape == (3, 5)


def test_large_empty_leaves_kept_heap_memory_and_fake_tensors_to_torch(monkeypatch):
    """After `keep_freed_memory()` malloc's heap serves large blocks already faulted in, and a fake tensor
    (a shape-only pass) has no memory to map: both get `new_empty`."""
    mapped = []
    monkeypatch.setattr(
        ops, "huge_page_buffer", lambda nbytes: mapped.append(nbytes) or huge_page_buffer(nbytes)
    )
    like = torch.zeros(())
    ops.large_empty(2048, 4096, like)
    assert mapped == [ops.HUGE_PAGES_FROM]
    monkeypatch.setattr(runtime, "_kept", True)
    assert ops.large_empty(2048, 4096, like).shape == (2048, 4096)
    monkeypatch.setattr(runtime, "_kept", False)
    with FakeTensorMode() as mode:
        fake = ops.large_empty(2048, 4096, mode.from_tensor(like))
    assert isinstance(fake, FakeTensor) and fake.shape == (2048, 4096)
    assert mapped == [ops.HUGE_PAGES_FROM]


def test_a_traced_model_writes_fresh_logits_on_every_call():
    """Under `torch.jit.trace` the logits come from torch's memory (`new_empty`), which the trace records as
    an op: a huge-page buffer would be kept as a constant, and every call of the traced model would
    overwrite the logits the last one returned."""
    torch.manual_seed(0)
    model = GPTForCausalLM(tiny_config(vocab_size=65536, n_positions=128, n_embd=32, n_head=1)).eval()
    ids = torch.randint(0, 65536, (1, 128))
    with torch.no_grad(), ops.onednn_products(False):  # (the MKL path: 128 x 65536 logits, 32 MiB)
        traced = torch.jit.trace(Logits(model), ids, check_trace=False)
        first = traced(ids)
        expected = first.clone()
        traced(torch.randint(0, 65536, (1, 128)))
        torch.testing.assert_close(first, expected, atol=0, rtol=0)
        torch.testing.assert_close(first, model(ids).logits, atol=1e-6, rtol=1e-5)

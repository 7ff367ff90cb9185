"""Decoding copies keep their weights in one mapping advised into transparent huge pages
(`hfgpt.cpu.huge_pages`), with every value, tie and output unchanged."""

import copy
import gc
import sys
from pathlib import Path

import pytest
import torch

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

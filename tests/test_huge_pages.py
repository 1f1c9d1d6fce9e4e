"""The weights and the KV cache in transparent huge pages (workers/engine/huge_pages.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from workers.engine import huge_pages


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    current = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(part, 16) for part in head.split("-"))
                current = start <= address < end
            elif head == "VmFlags:" and current:
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # one Parameter in two modules
        self.proj = nn.Linear(16, 24)
        self.register_buffer("table", torch.arange(12, dtype=torch.float32))
        self.register_buffer("table_view", self.table[4:10])  # a view of another buffer


needs_thp = pytest.mark.skipif(not huge_pages.available(),
                               reason="this kernel gives no transparent huge pages")


@needs_thp
def test_weights_move_into_a_huge_page_mapping_and_keep_their_values_and_ties():
    torch.manual_seed(0)
    model = _Tied()
    before = {name: t.clone() for name, t in model.state_dict().items()}
    params = {name: p for name, p in model.named_parameters(remove_duplicate=False)}
    x = torch.randint(0, 50, (3,))
    expected = model.head(model.proj.weight[:3, :16] + model.embed(x))

    moved = huge_pages.move_to_huge_pages(model)

    # each storage once (the tied weight, the buffer and its view), on cache lines
    assert moved == sum(-(-n // 64) * 64 for n in (50 * 16 * 4, 24 * 16 * 4, 24 * 4, 12 * 4))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
    for name, p in model.named_parameters(remove_duplicate=False):
        assert p is params[name]  # the same Parameter objects, new memory
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert model.table_view.data_ptr() == model.table.data_ptr() + 4 * 4
    model.table[5] = 100.0
    assert model.table_view[1] == 100.0  # still a view of the buffer
    assert torch.equal(model.head(model.proj.weight[:3, :16] + model.embed(x)), expected)
    # every tensor sits in one mapping that asked for huge pages, from a huge page on
    first = min(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
    assert first % huge_pages.HUGE_PAGE_BYTES == 0
    assert "hg" in _vm_flags(first)
    assert {_vm_flags(p.data_ptr()) == _vm_flags(first) for p in model.parameters()} == {True}


@needs_thp
def test_kv_cache_zeros_in_huge_pages():
    cache = huge_pages.zeros((3, 2, 4, 5), torch.bfloat16)
    assert cache.shape == (3, 2, 4, 5) and cache.dtype == torch.bfloat16
    assert cache.is_contiguous() and not cache.any()
    assert cache.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert "hg" in _vm_flags(cache.data_ptr())
    cache[2, 1] = 1.5
    assert cache.sum().item() == 1.5 * 20


def test_off_keeps_torch_allocations(monkeypatch):
    monkeypatch.setenv(huge_pages.SETTING_ENV, "off")
    model = _Tied()
    ptr = model.proj.weight.data_ptr()
    assert not huge_pages.available()
    assert huge_pages.move_to_huge_pages(model) == 0
    assert model.proj.weight.data_ptr() == ptr
    cache = huge_pages.zeros((2, 3), torch.float32)
    assert "hg" not in _vm_flags(cache.data_ptr())


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv(huge_pages.SETTING_ENV, "yes")
    with pytest.raises(ValueError, match="LLMQ_HUGE_PAGES"):
        huge_pages.available()


def test_thp_mode_reads_the_bracketed_word(tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert huge_pages.thp_mode(setting) == "madvise"
    setting.write_text("[never]\n")
    assert huge_pages.thp_mode(setting) == "never"
    assert huge_pages.thp_mode(tmp_path / "missing") == ""

"""QuantizedTensor's storage, numel, pinning and stream ops, for every recipe and role (the pinning,
device-copy and stream tests need CUDA).
"""

from __future__ import annotations

import pytest
import torch
from quant_tensors_op_test_helpers import (
    CASE_IDS,
    CASES,
    EXPECTED_CLASS,
    SHAPE_2D,
    SHAPE_3D,
    assert_same_values,
    aten,
    columnwise_values,
    present_buffers,
    quantized,
    raw,
)

pytestmark = pytest.mark.usefixtures("fresh_fallback_warnings")  # every test starts with no fallback warned


# ---- storage, numel, pinning, streams -------------------------------------------------------------


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_untyped_storage_is_the_data_buffers(name, role):
    _, t = quantized(name, role)
    storage = t.untyped_storage()
    assert isinstance(storage, torch.UntypedStorage)
    assert storage.data_ptr() == t.rowwise_data.untyped_storage().data_ptr()
    assert storage.nbytes() == t.rowwise_data.untyped_storage().nbytes() == t.rowwise_data.nbytes
    # A view reports the storage of the buffer it shares.
    assert t.view(2, 128, 384).untyped_storage().data_ptr() == storage.data_ptr()
    # Without rowwise data, the columnwise data's storage.
    alias = aten.alias.default(t)
    alias.update_usage(rowwise=False)
    assert alias.untyped_storage().data_ptr() == t.columnwise_data.untyped_storage().data_ptr()
    assert alias.untyped_storage().nbytes() == t.columnwise_data.nbytes


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_numel_counts_logical_elements(name, role):
    _, t = quantized(name, role)
    assert t.numel() == 256 * 384
    _, t3 = quantized(name, role, SHAPE_3D)
    assert t3.numel() == 2 * 128 * 256
    if name == "nvfp4":  # two codes per byte: the data buffer holds half as many elements
        assert t.rowwise_data.numel() == t.numel() // 2


@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_is_pinned_is_false_on_plain_cpu_buffers(name, role):
    _, t = quantized(name, role)
    assert t.is_pinned() is False
    assert not any(b.is_pinned() for b in present_buffers(t).values())


@pytest.mark.cuda  # pinning needs an accelerator in recent torch ("Cannot access accelerator device")
@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_pin_memory_pins_every_buffer(name, role):
    _, t = quantized(name, role)
    pinned = t.pin_memory()
    assert type(pinned) is EXPECTED_CLASS[name]
    assert pinned.shape == SHAPE_2D
    assert pinned.dtype == torch.bfloat16
    assert pinned.device.type == "cpu"
    assert pinned.is_pinned() is True
    assert t.is_pinned() is False
    assert all(b.is_pinned() for b in present_buffers(pinned).values())
    assert_same_values(pinned, t.dequantize(), columnwise_values(t))
    via_to = aten._to_copy.default(t, pin_memory=True)
    assert type(via_to) is EXPECTED_CLASS[name]
    assert via_to.is_pinned() is True
    assert torch.equal(via_to.dequantize(), t.dequantize())


@pytest.mark.cuda
@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_to_copy_between_cpu_and_cuda(name, role):
    _, t = quantized(name, role)
    on_gpu = t.to("cuda")
    assert type(on_gpu) is EXPECTED_CLASS[name]
    assert on_gpu.device.type == "cuda"
    assert on_gpu.shape == SHAPE_2D
    assert on_gpu.dtype == torch.bfloat16
    assert all(b.device.type == "cuda" for b in present_buffers(on_gpu).values())
    for name_, buffer in present_buffers(t).items():
        assert torch.equal(raw(getattr(on_gpu, name_)).cpu(), raw(buffer)), name_
    back = on_gpu.to("cpu")
    assert type(back) is EXPECTED_CLASS[name]
    assert back.device.type == "cpu"
    assert_same_values(back, t.dequantize(), columnwise_values(t))


@pytest.mark.cuda
@pytest.mark.parametrize(("name", "role"), CASES, ids=CASE_IDS)
def test_record_stream_holds_every_buffer_for_the_stream(name, role):
    # The caching allocator reuses a freed block at once on its own stream unless another stream
    # recorded a use of it; then only after that stream's queued work is done.
    _, t_cpu = quantized(name, role)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = t_cpu.to("cuda")  # every buffer allocated on the side stream
    side.synchronize()
    pointers = {b.data_ptr() for b in present_buffers(t).values()}
    sizes = [b.untyped_storage().nbytes() for b in present_buffers(t).values()]
    main = torch.cuda.current_stream()
    torch.cuda._sleep(1_000_000_000)  # keeps the main stream busy for a while
    assert t.record_stream(main) is None
    del t
    with torch.cuda.stream(side):
        while_busy = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    assert not pointers & {b.data_ptr() for b in while_busy}, "a buffer was reused while the stream used it"
    del while_busy
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        after = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    assert pointers & {b.data_ptr() for b in after}, "the freed buffers should be reusable once the stream is done"

"""Host staging of slow-link payloads (`dilocox.net.staging`): the reusable buffers, and the CPU path, which must
hand gloo the very tensors the plain path did. The CUDA path (pinned buffers, side stream) is held to the CPU's
results by tests/gpu/test_staging.py."""

import torch

from dilocox.net.staging import HostBuffers, HostStaging


def test_buffers_are_reused_across_transfers_and_grow_only_when_too_small():
    buffers = HostBuffers(pin=False)
    first = [buffers.take(1000, torch.float32), buffers.take(300, torch.uint8)]
    assert [t.shape for t in first] == [(1000,), (300,)] and [t.dtype for t in first] == [torch.float32, torch.uint8]
    assert first[0].data_ptr() != first[1].data_ptr()  # two buffers of one transfer never overlap
    buffers.release()
    for _ in range(3):  # later rounds of the same sizes, or smaller, allocate nothing
        again = [buffers.take(1000, torch.float32), buffers.take(200, torch.uint8)]
        assert [t.data_ptr() for t in again] == [t.data_ptr() for t in first]
        buffers.release()
    assert buffers.num_allocations == 2 and buffers.nbytes == 2 * 65536  # the smallest size class
    bigger = buffers.take(40000, torch.float32)  # 160,000 bytes: the first position grows to 2^18
    same = buffers.take(300, torch.uint8)
    assert bigger.numel() == 40000 and same.data_ptr() == first[1].data_ptr()
    assert buffers.num_allocations == 3 and buffers.nbytes == (1 << 18) + 65536
    third = buffers.take(5, torch.bfloat16)  # a new position within one transfer
    assert third.dtype == torch.bfloat16 and buffers.num_allocations == 4
    buffers.release()
    assert buffers.take(0, torch.float32).numel() == 0


def test_a_buffer_holds_what_was_written_in_its_dtype():
    buffers = HostBuffers(pin=False)
    values = torch.randn(77)
    buffers.take(77, torch.float32).copy_(values)
    buffers.release()
    assert torch.equal(buffers.take(77, torch.float32), values)  # the same bytes come back the next round


def test_the_cpu_path_hands_gloo_the_tensors_themselves():
    """No ticket for host payloads; every step returns (or writes) its input, the bytes of the plain `.cpu()`
    path, and nothing is pinned or pooled."""
    staging = HostStaging()
    assert staging.ticket(torch.device("cpu")) is None and staging.ticket(None) is None
    payload = torch.randn(6, 5)
    with staging.running(None):
        host = staging.to_host(payload)
        assert host is payload and torch.equal(host, payload.cpu())
        strided = payload.t()  # gloo needs contiguous buffers: a strided payload is copied, values equal
        contiguous = staging.to_host(strided)
        assert contiguous.is_contiguous() and torch.equal(contiguous, strided.cpu())
        assert staging.to_device(host, torch.device("cpu")) is host
        target = torch.zeros(6, 5)
        assert staging.copy_to_device_(target, host) is target and torch.equal(target, payload)
        first, second = staging.host_buffer(10, torch.uint8), staging.host_buffer(10, torch.uint8)
        assert first.data_ptr() != second.data_ptr()  # handed to the caller: never a shared pooled buffer
        staging.finish(None, [host])
    assert staging.buffers.num_allocations == 0 and staging.buffers.nbytes == 0

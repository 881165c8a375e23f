"""Host memory for the wire (issue 10): the compute thread hands the loop host tensors, the loop
only wraps them, and a buffer handed to ZeroMQ stays alive until the zero-copy send is done."""

import gc
import threading
import time
from types import SimpleNamespace

import pytest
import torch
import zmq
from torch.multiprocessing.reductions import StorageWeakRef

from mapl_swarm.compress.codebook_sync import CodebookSlice
from mapl_swarm.peer.host import HostRuntime, slices_to_host, tensors_to_host, to_host
from mapl_swarm.pipeline.tensors import from_wire, to_wire
from mapl_swarm.pipeline.stage import ForwardResult
from mapl_swarm.wire import Message, MessageType, decode, encode


def test_to_wire_refuses_what_the_compute_thread_should_have_brought_to_the_host():
    with pytest.raises(ValueError, match="compute thread"):
        to_wire(torch.empty(4, 4, device="meta"))  # any non-CPU device: the GPU's case without a GPU
    with pytest.raises(ValueError, match="non-contiguous"):
        to_wire(torch.zeros(4, 4).t())


def test_cpu_tensors_reach_the_host_without_a_copy_when_contiguous():
    a = torch.arange(12.0, requires_grad=True).reshape(3, 4) * 1  # contiguous, part of a graph
    b = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()  # a strided view
    host = tensors_to_host({"a": a, "b": b})
    assert host["a"].data_ptr() == a.data_ptr() and not host["a"].requires_grad
    assert host["b"].is_contiguous() and torch.equal(host["b"], b)
    assert to_host(b).is_contiguous()
    sl = CodebookSlice("act", 3, 0, False, torch.randn(2, 4, 3, 2).transpose(1, 2),
                       index=torch.tensor([[0, 2]], dtype=torch.uint8))
    (out,) = slices_to_host([sl])
    assert (out.stream, out.version, out.start, out.full) == ("act", 3, 0, False)
    assert out.codes.is_contiguous() and torch.equal(out.codes, sl.codes)
    assert out.index.data_ptr() == sl.index.data_ptr()  # contiguous: no copy


def test_host_runtime_converts_wire_tensors_in_and_returns_host_tensors():
    act = torch.randn(2, 5, 4).to(torch.bfloat16)
    ids = torch.randint(0, 500, (2, 6), dtype=torch.int64).to(torch.uint16)
    seen = {}

    def forward(micro, *, ids=None, payload=None, train=True, cver=None):
        seen.update(payload)
        act = payload["act"].float().transpose(0, 2).contiguous().transpose(0, 2)  # strided (2, 5, 4)
        return ForwardResult({"act": act, "ids": payload["ids"]}, None, 10)

    host = HostRuntime(SimpleNamespace(forward=forward, device=torch.device("cpu")))
    assert not host.pin  # pinning needs a CUDA stage
    res = host.forward(0, wire={"act": to_wire(act), "ids": to_wire(ids)}, train=True, cver=None)
    assert seen["act"].dtype == torch.bfloat16 and torch.equal(seen["act"], act)  # bit for bit
    assert seen["ids"].dtype == torch.uint16 and torch.equal(seen["ids"], ids)
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in res.payload.values())
    assert res.tokens == 10


def test_a_frame_keeps_its_tensor_alive_until_zeromq_has_sent_it():
    t = torch.randn(256, 256)  # 256 KiB: above pyzmq's copy threshold, so really zero-copy
    storage = StorageWeakRef(t.untyped_storage())
    expected = t.clone()
    frames = encode(Message(type=MessageType.PROJ, run_id="r", src=0, dst=1, pver=1,
                            tensors={"proj": to_wire(t)}))
    del t
    gc.collect()
    assert not storage.expired()  # frame -> array view -> array -> base tensor -> storage

    ctx = zmq.Context()
    try:
        dealer, router = ctx.socket(zmq.DEALER), ctx.socket(zmq.ROUTER)
        for s in (dealer, router):
            s.setsockopt(zmq.LINGER, 0)
        dealer.connect("inproc://host-test")  # nobody bound yet: the message waits in libzmq
        dealer.send_multipart(frames, copy=False)
        del frames
        gc.collect()
        assert not storage.expired()  # pyzmq holds the buffer while libzmq holds the message
        router.bind("inproc://host-test")
        assert router.poll(10_000), "the queued message was not delivered"
        parts = router.recv_multipart(copy=False)
        msg = decode([p.buffer for p in parts[1:]])
        assert torch.equal(from_wire(msg.tensors["proj"]), expected)
        del parts, msg
        gc.collect()
        deadline = time.monotonic() + 10.0  # libzmq frees the message, pyzmq's gc thread drops the buffer
        released = threading.Event()
        while not storage.expired() and time.monotonic() < deadline:
            released.wait(0.01)
        assert storage.expired(), "the tensor outlived its send (leak)"
        dealer.close(linger=0)
        router.close(linger=0)
    finally:
        ctx.term()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_results_land_in_pinned_host_memory_and_come_back_asynchronously():
    x = torch.randn(1024, 1024, device="cuda")
    for _ in range(50):  # queued kernels still running when the copy is queued
        x = torch.tanh(x @ x / 1024)
    act, idx = x.to(torch.bfloat16), torch.arange(20, device="cuda")[::2]  # idx: strided
    host = tensors_to_host({"act": act, "idx": idx})
    for name, dev in (("act", act), ("idx", idx)):
        assert host[name].device.type == "cpu" and host[name].is_pinned() and host[name].is_contiguous()
        assert torch.equal(host[name], dev.cpu())  # the worker's event wait covered the copies
    host_rt = HostRuntime(SimpleNamespace(device=torch.device("cuda")))
    assert host_rt.pin
    (back,) = host_rt.received({"act": to_wire(host["act"])}).values()
    assert back.is_pinned() and torch.equal(back.to("cuda", non_blocking=True).cpu(), act.cpu())

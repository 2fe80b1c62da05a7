"""Full garbage collections wait while dynamo captures one of our graphs (`gc_during_capture`), and the
collector's thresholds are the process's own again afterwards, whatever happened in between."""

import gc
import threading

import pytest
import torch
from torch import nn

from offload_compiler import OffloadPolicy, offload_compile
from offload_compiler.gc_during_capture import DeferFullCollections


@pytest.fixture
def thresholds():
    saved = gc.get_threshold()
    gc.set_threshold(701, 11, 9)  # the process's own, unlike the defaults
    yield (701, 11, 9)
    gc.set_threshold(*saved)


def test_a_capture_defers_full_collections_and_gives_the_thresholds_back(thresholds, monkeypatch):
    import offload_compiler.backend as backend
    seen, compile_graph = [], backend.compile_graph

    def recording(gm, example_inputs, runtime):
        seen.append(gc.get_threshold())
        return compile_graph(gm, example_inputs, runtime)
    monkeypatch.setattr(backend, "compile_graph", recording)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).eval(), torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
        m = offload_compile(model, OffloadPolicy(strategy="layerwise", device="cpu"))
        assert torch.equal(m(x), expected)
    assert seen and all(t[:2] == thresholds[:2] and t[2] > 10**6 for t in seen)  # young generations as they were
    assert gc.get_threshold() == thresholds
    with torch.no_grad(), pytest.raises(RuntimeError):  # a capture that fails (a wrong input shape)
        m(torch.randn(2, 5))
    assert gc.get_threshold() == thresholds


def test_deferral_is_process_wide_reentrant_and_keeps_thresholds_set_meanwhile(thresholds):
    defer = DeferFullCollections()
    entered, leave = threading.Event(), threading.Event()

    def other_thread():
        with defer:
            entered.set()
            leave.wait(10)
    worker = threading.Thread(target=other_thread)
    with defer:
        worker.start()
        entered.wait(10)
        with defer:  # nested on this thread
            pass
        assert gc.get_threshold()[2] > 10**6
    assert gc.get_threshold()[2] > 10**6  # the other thread's capture still runs
    leave.set()
    worker.join()
    assert gc.get_threshold() == thresholds  # the last to leave restores
    with defer:
        gc.set_threshold(500, 5, 5)  # set by the process during a capture: its own from then on
    assert gc.get_threshold() == (500, 5, 5)

import gc
import os
import tempfile

# inductor's FX-graph cache does not key on custom-op tags; keep each run's compiled code to itself. The workers of
# one run share it: a fresh cache costs each process about 15 s on a 2-core machine before its first kernel (inductor
# builds a test program per vector instruction set to choose one, and caches the answer there).
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"offload_compiler_inductor_{_RUN}")
                      if _RUN else tempfile.mkdtemp(prefix="offload_compiler_inductor_"))

# One intra-op thread in every test process, and in the subprocesses tests start (examples, ranks): the tests
# compare eager CPU outputs with the plain model's bit for bit, and torch's multi-threaded CPU kernels do not
# promise the same bits from run to run (at six threads a plain Llama's logits differed from its own by 4e-5 between two calls);
# the timing checks want steady timings too. Under pytest-xdist (`-n 2`, see pyproject.toml) each worker also
# compiles in-process, so that two workers do not oversubscribe a 2-core machine (a pool of compile
# subprocesses per worker). Set before torch (and inductor's config) load.
os.environ["OMP_NUM_THREADS"] = "1"
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

torch.set_num_threads(1)

# The simulated accelerator is installed before any test runs a backward: autograd's engine sizes its per-device
# queues once, at the process's first backward, from the devices registered then (a real accelerator's backend
# registers at import, as this does here).
from offload_compiler.testing import simulated_device  # noqa: E402

simulated_device()

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


# One process runs every test: by the end it holds over a million objects (torch, transformers, diffusers and
# what earlier tests left for the collector), and each full collection walks them all -- seconds per
# gc.collect() late in a run, in the tests and benchmarks that call it, and in the collector's own passes.
# During a test the objects from before it are frozen (gc.freeze: left out of every collection), so a collection
# walks only what the test made; every FULL_COLLECTION_EVERY tests they are unfrozen and collected at once (a
# few seconds late in a run; gc.get_freeze_count() walks them all too, so the count of tests decides).
# Nothing is lost: an object is only collected later, never kept. (gc.get_objects() leaves frozen objects out:
# the backend route finds its model among the objects a test made itself.)
FULL_COLLECTION_EVERY = 150
_tests_since_full_collection = 0


@pytest.fixture(autouse=True)
def _collect_only_what_the_test_made():
    global _tests_since_full_collection
    if _tests_since_full_collection >= FULL_COLLECTION_EVERY:
        gc.collect()
        _tests_since_full_collection = 0
    _tests_since_full_collection += 1
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

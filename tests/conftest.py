import os
import shutil
import tempfile

import pytest
import torch

_CACHE_DIR: str | None = None


def pytest_configure(config):
    # Tokenizer and token caches of the whole session (and of the CLI subprocesses it starts) go to one temporary
    # directory, never to ~/.cache; DILOCOX_TEST_CACHE keeps them across sessions for local iteration.
    global _CACHE_DIR
    if os.environ.get("DILOCOX_TEST_CACHE"):
        os.environ["DILOCOX_CACHE"] = os.environ["DILOCOX_TEST_CACHE"]
    else:
        _CACHE_DIR = tempfile.mkdtemp(prefix="dilocox-test-cache-")
        os.environ["DILOCOX_CACHE"] = _CACHE_DIR
    os.environ["HF_HOME"] = os.path.join(os.environ["DILOCOX_CACHE"], "hf")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def pytest_collection_modifyitems(config, items):
    # CI has no GPU: tests that need CUDA say so and are skipped, never silently passed.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA GPU (torch {torch.__version__} sees none)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    # item.rep_setup / rep_call / rep_teardown: a fixture's teardown can tell whether its test failed
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report


def pytest_unconfigure(config):
    if _CACHE_DIR:
        shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def _one_thread_and_clean_groups():
    torch.set_num_threads(1)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()

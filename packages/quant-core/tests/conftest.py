from __future__ import annotations

import importlib.util
import threading

import pytest

import quant_core
from quant_core.testing import TritonInterpreterRun, kernel_backends


@pytest.fixture(params=kernel_backends())
def backend(request: pytest.FixtureRequest):
    """Each non-reference backend available here, forced for the duration of the test."""
    with quant_core.use_backend(request.param):
        yield request.param


# [Note: interpreted kernels in the background] A test marked `triton_interpreter(source)` checks
# a Triton kernel by running `source` in the interpreter, in a fresh process of a few to twenty
# seconds, mostly on one core. The scripts of the selected tests start when collection ends, one
# at a time, in the order of their tests, so they run beside the single-process tests on the core
# those leave idle; each test then waits for its own run (the `triton_interpreter` fixture).


class _BackgroundRuns:
    """The interpreter runs of `sources`, one after the other on a thread of their own."""

    def __init__(self, sources: list[str]) -> None:
        self._runs: dict[str, TritonInterpreterRun] = {}
        self._started = {source: threading.Event() for source in sources}
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(target=self._run_all, name="triton-interpreter", daemon=True).start()

    def _run_all(self) -> None:
        for source, started in self._started.items():
            with self._lock:
                if self._stopped:
                    return
                run = self._runs[source] = TritonInterpreterRun(source)
            started.set()
            run.wait()

    def run_of(self, source: str) -> TritonInterpreterRun | None:
        """The run of `source` once started; None if `source` is not one of these."""
        started = self._started.get(source)
        if started is None:
            return None
        started.wait()
        return self._runs[source]

    def stop(self) -> None:
        """Kills the run under way; starts no more."""
        with self._lock:
            self._stopped = True
            runs = list(self._runs.values())
        for run in runs:
            run.kill()


_BACKGROUND = pytest.StashKey[_BackgroundRuns]()


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly or importlib.util.find_spec("triton") is None:
        return
    markers = (item.get_closest_marker("triton_interpreter") for item in session.items)
    sources = list(dict.fromkeys(marker.args[0] for marker in markers if marker is not None))
    if sources:
        session.config.stash[_BACKGROUND] = _BackgroundRuns(sources)


def pytest_sessionfinish(session: pytest.Session) -> None:
    background = session.config.stash.get(_BACKGROUND, None)
    if background is not None:
        background.stop()


@pytest.fixture
def triton_interpreter(request: pytest.FixtureRequest) -> TritonInterpreterRun:
    """The interpreter run of the test's `triton_interpreter(source)` marker ([Note: interpreted
    kernels in the background]): started at collection's end, or now if it was not."""
    source = request.node.get_closest_marker("triton_interpreter").args[0]
    background = request.config.stash.get(_BACKGROUND, None)
    run = None if background is None else background.run_of(source)
    return TritonInterpreterRun(source) if run is None else run

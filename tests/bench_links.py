"""What the benchmarks' tests share: a bad command line gives one error line and builds nothing;
a run on shaped links leaves no namespace behind."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from types import ModuleType

import pytest

from scripts.tools.worker_process import ROOT
from swarm.netlab import PREFIX, LabError
from swarm.netlab import lab as lab_module
from tests.children import still_running


def main_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], bench: ModuleType, *args: str
) -> str:
    """`bench.main()` with these arguments: it must exit 2 with one error line and build no lab
    (`bench.Lab`); returns that line."""

    def no_lab(*_: object, **__: object) -> None:
        raise AssertionError("a lab was built")

    prog = f"{bench.__name__.rpartition('.')[2]}.py"
    monkeypatch.setattr(bench.Lab, "create", no_lab)
    monkeypatch.setattr(sys, "argv", [prog, *args])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith(f"{prog}: error: "), lines
    return lines[-1]


def namespaces_of(pid: int) -> list[str]:
    """The network namespaces of the run of process `pid` (swarm.netlab's names)."""
    return [ns for ns in lab_module.namespaces() if ns.startswith(f"{PREFIX}{pid}-")]


@contextlib.contextmanager
def removed_after(pid: int) -> Iterator[None]:
    """Whatever happens in the test, the run's namespaces (and what runs inside) go at the end."""
    try:
        yield
    finally:
        with contextlib.suppress(LabError):
            lab_module.remove(sorted(namespaces_of(pid), key=len, reverse=True))


def pids_inside(pid: int) -> list[int]:
    """The processes in the run's endpoint namespaces (the bridge's holds none)."""
    with contextlib.suppress(LabError):  # a namespace made or removed while we look
        return [int(p) for ns in namespaces_of(pid) for p in lab_module.run(("ip", "netns", "pids", ns)).split()]
    return []


def _reap(proc: subprocess.Popen[str]) -> None:
    """A benchmark that is still running (a failed wait): killed and reaped."""
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def run_on_links(command: list[str], timeout: float) -> str:
    """Run a benchmark on shaped links to its end: it must exit 0 and leave no namespace. Its stdout."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    with removed_after(proc.pid):
        try:
            out, err = proc.communicate(timeout=timeout)
        finally:
            _reap(proc)
        assert proc.returncode == 0, err[-3000:]
        assert not namespaces_of(proc.pid), "the run's namespaces are still there"
    return out


def sigterm_on_links(command: list[str], children: int) -> None:
    """SIGTERM a benchmark once `children` processes run in its namespaces: it exits 143 and
    leaves no namespace and no child behind."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    with removed_after(proc.pid):
        try:
            deadline = time.monotonic() + 60
            while len(inside := pids_inside(proc.pid)) < children:
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=60)
        finally:
            _reap(proc)
        assert proc.returncode == 143, err[-3000:]
        assert not namespaces_of(proc.pid), "the run's namespaces are still there"
        running = still_running(inside)  # a child killed as the run ended is a zombie until init reaps it
        assert not running, f"a child outlived the run: {running}"

"""What a person sees of a local run, and where the rest of its output goes.

``kfp.local`` prints everything on stdout: its own log lines (``Executing task 'x'``, each task's executor input
and outputs) and every line the task's process writes. :class:`RunConsole` takes that stream line by line and

- writes all of it to ``<run dir>/logs/run.log`` and each task's lines to ``<run dir>/logs/<task>.log``;
- shows, by default, one line per finished stage (start time, duration, its headline figures, from the
  ``lmforge.stage`` record the component writes last) and the training progress lines; with ``verbose``
  every line as it comes; with ``quiet`` nothing (the caller prints the summary);
- remembers the last ``error:`` line of a failed task, so the caller can end with it.
"""

from __future__ import annotations

import io
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

ANSI = re.compile(r"\x1b\[[0-9;]*m")
KFP_LINE = re.compile(r"^\d\d:\d\d:\d\d\.\d+ - (?P<level>\w+) - (?P<message>.*)$")
EXECUTING = re.compile(r"^Executing task '(?P<task>[^']+)'")
FINISHED = re.compile(r"^Task '(?P<task>[^']+)' finished with status (?P<status>\w+)")
RETRYING = re.compile(r"^Task (?P<task>\S+) failed \(attempt (?P<attempt>\d+)/(?P<of>\d+)\)")
# The component's last record (lmforge_kfp.runtime): "lmforge.stage: done {json}".
STAGE_DONE = re.compile(r"lmforge\.stage: done (?P<json>\{.*\})\s*$")
PROGRESS = re.compile(r"lmforge\.\w+: (?P<text>\w+ step \d+/\d+: .*)$")
ERROR = re.compile(r"(?:^|\s)(?P<line>error: .*)$")
MODES = ("quiet", "default", "verbose")


@dataclass
class TaskLog:
    """One task's lines so far and what was learnt from them."""

    name: str
    started: float = field(default_factory=time.time)
    error: str | None = None
    done: dict | None = None


class RunConsole(io.TextIOBase):
    """A text stream for ``contextlib.redirect_stdout`` that routes a local run's output (see the module doc)."""

    def __init__(self, log_dir: Path, out: TextIO, mode: str = "default") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.mode = mode
        self._pending = ""
        self._run_log = open(log_dir / "run.log", "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._task_files: dict[str, TextIO] = {}
        self.tasks: dict[str, TaskLog] = {}
        self.current: str | None = None
        self.failed: str | None = None
        self.erred: str | None = None  # the last task that wrote an ``error:`` line

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self._pending += text
        *lines, self._pending = self._pending.split("\n")
        for line in lines:
            self._line(line)
        return len(text)

    def flush(self) -> None:
        self._run_log.flush()
        self.out.flush()

    def close(self) -> None:
        """Write what is pending and close the log files (again: nothing)."""
        if self.closed:
            return
        if self._pending:
            self._line(self._pending)
            self._pending = ""
        super().close()  # flushes first
        self._run_log.close()
        for handle in self._task_files.values():
            handle.close()

    @property
    def failed_task(self) -> str | None:
        """The task that failed: the one kfp.local reported, else the last one that wrote an ``error:`` line,
        else the one running (kfp.local raises for a failed task without logging it, and runs a loop's iterations
        and independent steps on, so the current task need not be the failed one)."""
        return self.failed or self.erred or self.current

    @property
    def error_line(self) -> str | None:
        """The failed task's own ``error:`` line, if it wrote one."""
        task = self.tasks.get(self.failed_task or "")
        return task.error if task else None

    def log_path(self, task: str | None = None) -> Path:
        """The run's log, or one task's."""
        return self.log_dir / (f"{task}.log" if task else "run.log")

    def _line(self, raw: str) -> None:
        line = ANSI.sub("", raw).rstrip("\r")
        self._run_log.write(line + "\n")
        if self.mode == "verbose":
            self.out.write(raw + "\n")
        match = KFP_LINE.match(line)
        message = match.group("message") if match else None
        if message and (started := EXECUTING.match(message)):
            self.current = started.group("task")
            self.tasks[self.current] = TaskLog(self.current)
        if self.current:
            handle = self._task_files.get(self.current)
            if handle is None:
                handle = self._task_files[self.current] = open(  # noqa: SIM115 - closed in close()
                    self.log_dir / f"{self.current}.log", "a", encoding="utf-8"
                )
            handle.write(line + "\n")
        if message and (finished := FINISHED.match(message)):
            self._finished(finished.group("task"), finished.group("status"))
            return
        if message and (retry := RETRYING.match(message)):
            self._show(f"  {retry.group('task')}: failed, retrying (attempt {retry.group('attempt')} of "
                       f"{int(retry.group('of'))})")  # fmt: skip
            return
        task = self.tasks.get(self.current or "")
        if task is None:
            return
        if done := STAGE_DONE.search(line):
            task.done = json.loads(done.group("json"))
        elif error := ERROR.search(line):
            task.error = error.group("line").strip()
            self.erred = task.name
        elif progress := PROGRESS.search(line):
            self._show(f"  {progress.group('text')}")

    def _finished(self, name: str, status: str) -> None:
        task = self.tasks.get(name) or TaskLog(name)
        seconds = time.time() - task.started
        if status != "SUCCESS":
            self.failed = name
            self._show(f"✗ {name:<16} failed after {seconds:.0f} s (log: {self.log_path(name)})")
            return
        figures = ", ".join((task.done or {}).get("headline", []))
        clock = time.strftime("%H:%M:%S", time.localtime(task.started))
        self._show(f"✓ {name:<16} {clock}  {seconds:5.1f} s" + (f"  {figures}" if figures else ""))
        self.current = None

    def _show(self, text: str) -> None:
        if self.mode == "default":
            self.out.write(text + "\n")
            self.out.flush()

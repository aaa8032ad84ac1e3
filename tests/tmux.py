"""A terminal program under tmux for tests: start it in a detached session of a tmux server of its
own (its own socket, so the test's environment is the program's), read the screen as a person
would see it, stop it."""
from __future__ import annotations

import os
import shlex
import subprocess
import uuid
from typing import Sequence

EXITED = "[program exited with"


class TmuxPane:
    """One detached tmux session running ``argv`` in a ``width`` x ``height`` terminal."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], width: int = 200, height: int = 80) -> None:
        self.socket = f"kvbus-test-{uuid.uuid4().hex[:8]}"
        self.env = {**env, "TERM": "xterm-256color"}
        self.env.pop("TMUX", None)  # a test run inside tmux must not talk to the developer's server
        for size in ("COLUMNS", "LINES"):  # the pane's size is the terminal's (pytest-xdist's workers set 80x24)
            self.env.pop(size, None)
        cmd = " ".join(shlex.quote(a) for a in argv)
        # the pane outlives the program, so a crash stays readable (and says so)
        shell = f'{cmd}; echo "{EXITED} $?]"; exec sleep 3600'
        self._tmux("new-session", "-d", "-s", "top", "-x", str(width), "-y", str(height), shell)

    def _tmux(self, *args: str) -> str:
        out = subprocess.run(["tmux", "-L", self.socket, *args], env=self.env, capture_output=True, text=True,
                             timeout=10)
        assert out.returncode == 0, f"tmux {' '.join(args)}: {out.stderr}"
        return out.stdout

    def screen(self) -> str:
        """What the pane shows now (``capture-pane -p``), one line per terminal row."""
        return self._tmux("capture-pane", "-p", "-t", "top")

    def send_keys(self, *keys: str) -> None:
        """Type ``keys`` into the pane (tmux key names: ``C-c``, ``q``, ``Enter``)."""
        self._tmux("send-keys", "-t", "top", *keys)

    def exited(self, screen: str | None = None) -> bool:
        """True when the program exited (the pane then shows ``[program exited with <code>]``), judged on
        ``screen`` when given: a test that reads the screen and then asks must ask about what it read, or a
        second capture may differ from the first (the program exiting in between)."""
        return EXITED in (self.screen() if screen is None else screen)

    def close(self) -> None:
        """Stop the program and this test's tmux server."""
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], env=self.env, capture_output=True, timeout=10)
        try:
            os.unlink(f"/tmp/tmux-{os.getuid()}/{self.socket}")
        except OSError:
            pass

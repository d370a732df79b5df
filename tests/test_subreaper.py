"""The subreaper ends only what it adopted: never a child this process is starting.

``bench train`` launches several configurations' ranks in one process. When one ends (its
rank crashed) while another is starting its ranks, ``end_adopted`` looked for children that
carry this launcher's identity and were not noted as started. A rank between its exec and its
note matched: it was killed and reaped there, its own ``Popen.wait()`` then read exit code 0,
and the bench waited for it until the test's timeout (stop 25, seen once in a full run).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from scaleout.launch.lifeline import launcher_env
from scaleout.launch.subreaper import become_subreaper, end_adopted, note_started, starting


@pytest.mark.timeout(60)
def test_a_child_between_its_start_and_its_note_is_not_taken_for_an_adopted_one() -> None:
    if not become_subreaper():
        pytest.skip("no prctl(PR_SET_CHILD_SUBREAPER) here")
    ended: list[int] = []
    with starting():
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                                env={**os.environ, **launcher_env()},
                                start_new_session=True)  # (as a rank: its own group)
        try:
            ending = threading.Thread(target=lambda: ended.extend(end_adopted()))
            ending.start()
            ending.join(0.5)
            assert ending.is_alive()  # it waits until the child is noted
            note_started(proc.pid)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    ending.join(10.0)
    try:
        assert not ending.is_alive()
        assert proc.pid not in ended and proc.poll() is None
    finally:
        proc.kill()
        proc.wait()

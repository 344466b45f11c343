"""Find a test job's processes: everything in one session, read from /proc."""

import os

__all__ = ["session_procs"]


def session_procs(session_id, what):
    """Yield (pid, contents of /proc/PID/<what>) for the live processes of session_id."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) != session_id:
                continue
            with open(f"/proc/{entry}/{what}", "rb") as fh:
                data = fh.read()
        except (OSError, ProcessLookupError):
            continue  # exited while we looked
        yield int(entry), data

"""Progress on rank 0: a tqdm bar on a terminal, plain log lines otherwise."""

from __future__ import annotations

import sys

__all__ = ["Progress"]


class Progress:
    """Show loss and throughput; silent on every rank but 0."""

    def __init__(self, total: int, enabled: bool, mode: str = "auto", log_every: int = 10,
                 unit: str = "samples", start: int = 0):
        self.enabled = enabled
        self.log_every = log_every
        self.unit = unit
        self.total = total
        self._bar = None
        use_bar = mode == "on" or (mode == "auto" and sys.stderr.isatty())
        if enabled and use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc="train", unit="step",
                             dynamic_ncols=True, file=_CurrentStderr())

    def update(self, step: int, loss: float, rate: float) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss:.4f}", **{f"{self.unit}/s": f"{rate:,.0f}"})
            self._bar.update(1)
        elif step == 0 or (step + 1) % self.log_every == 0 or step + 1 == self.total:
            print(f"step {step + 1:>6}/{self.total}  loss {loss:.4f}  {rate:,.0f} {self.unit}/s",
                  flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _CurrentStderr:
    """sys.stderr as it is at each write: after SIGTERM the pre-emption handler's proxy
    (train/stdio.py), which drops what a launcher that stopped reading would block on."""

    def write(self, text):
        return sys.stderr.write(text)

    def flush(self):
        sys.stderr.flush()

    def __getattr__(self, name):
        return getattr(sys.stderr, name)

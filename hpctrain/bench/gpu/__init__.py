"""The prepared GPU check (``python -m hpctrain bench gpu --out DIR``).

One command, every part time-boxed in its own process, a JSON and a markdown report written
even when a part fails or hangs: the check a GPU machine runs whenever one is available, and
that the CPU suite runs with ``--device cpu --tiny`` so it cannot rot in between.

Parts (one module each; ``common.PARTS`` is the order):

* ``facts``   - what the machine has: torch, CUDA, GPU, MPI library and launcher, Horovod.
* ``speed``   - the built-in GPT trained by hpctrain vs a plain torch loop: overhead, MFU.
* ``plans``   - every plan on the device equal to single (world 1 and 2 ranks), checkpoints
  written on one device load on the other.
* ``memory``  - peak device memory of the sharded plans vs the formula; deferred init.
* ``watchdog``- a collective queued behind a long kernel is reported; a GPU behind is not.
* ``overlap`` - exposed communication per step with gradient reduction and fsdp prefetch.
"""

"""Write SLURM/PBS job scripts from the templates in hpctrain/jobscripts/ (no MPI, no torch).

The scripts in the repository's jobs/ are this module's output for PRESETS (a test checks
they agree), so what ``python -m hpctrain jobgen`` writes and what users copy from jobs/
come from one source.

Template syntax, deliberately tiny: ``{{NAME}}`` is a value; a line starting with
``{{?flag}}`` is kept only when the flag is on; ``{{?flag}}text{{/flag}}`` inside a line
is a span kept only when the flag is on. Flags: gpu, preempt.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields
from importlib import resources

__all__ = ["JobSpec", "PRESETS", "render", "write_presets", "TEMPLATES"]

TEMPLATES = {"slurm": "slurm.sbatch.in", "pbs": "pbs.pbs.in"}
EXTENSIONS = {"slurm": ".sbatch", "pbs": ".pbs"}
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
_TIME = re.compile(r"^(\d+-)?\d{1,3}:\d{2}:\d{2}$")
_VALUE = re.compile(r"\{\{([A-Z_]+)\}\}")
_SPAN = re.compile(r"\{\{\?([a-z]+)\}\}(.*?)\{\{/\1\}\}")
_LINE_FLAG = re.compile(r"^\{\{\?([a-z]+)\}\}")


@dataclass
class JobSpec:
    """What a job script asks for. Zero/empty fields take the defaults in ``resolved()``."""

    scheduler: str = "slurm"
    nodes: int = 1
    gpus_per_node: int = 0
    ranks_per_node: int = 4             # CPU jobs; GPU jobs run one rank per GPU
    cpus_per_task: int = 0              # 0: 1 on CPU nodes, 8 per GPU rank
    time: str = "00:30:00"
    partition: str = ""                 # SLURM partition / PBS queue
    account: str = ""
    preemptible: bool = False
    job_name: str = ""
    strategy: str = "ddp"
    model: str = "gpt"
    steps: int = 200
    checkpoint_dir: str = "checkpoints"
    checkpoint_every: int = 50

    def resolved(self) -> "JobSpec":
        """Return a validated copy with defaults filled in; ValueError names the bad field."""
        from hpctrain.config import STRATEGIES

        s = JobSpec(**{f.name: getattr(self, f.name) for f in fields(self)})
        if s.scheduler not in TEMPLATES:
            raise ValueError(f"--scheduler {s.scheduler!r}: expected one of {', '.join(TEMPLATES)}")
        for name in ("nodes", "ranks_per_node", "steps", "checkpoint_every"):
            if getattr(s, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)}: must be >= 1")
        for name in ("gpus_per_node", "cpus_per_task"):
            if getattr(s, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(s, name)}: must be >= 0")
        if not _TIME.match(s.time):
            raise ValueError(f"--time {s.time!r}: expected HH:MM:SS or D-HH:MM:SS, e.g. 01:30:00")
        if s.strategy not in STRATEGIES or s.strategy == "single":
            raise ValueError(f"--strategy {s.strategy!r}: expected one of "
                             f"{', '.join(x for x in STRATEGIES if x != 'single')}")
        kind = "gpu" if s.gpus_per_node else "cpu"
        s.job_name = s.job_name or ("hpctrain-preempt" if s.preemptible else f"hpctrain-{kind}")
        s.cpus_per_task = s.cpus_per_task or (8 if s.gpus_per_node else 1)
        for name in ("job_name", "partition", "account", "model", "checkpoint_dir"):
            value = getattr(s, name)
            if value and not _NAME.match(value.replace("/", "").replace(":", "")):
                raise ValueError(f"--{name.replace('_', '-')} {value!r}: use letters, digits and "
                                 "_ . + - only (it goes into a shell script)")
        return s

    @property
    def tasks_per_node(self) -> int:
        return self.gpus_per_node or self.ranks_per_node

    def args(self) -> str:
        """The jobgen flags that reproduce this (resolved) spec; defaults left out."""
        base = JobSpec(scheduler=self.scheduler, gpus_per_node=self.gpus_per_node,
                       preemptible=self.preemptible).resolved()
        out = [f"--scheduler {self.scheduler}"]
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("scheduler", "preemptible") or (
                    f.name == "ranks_per_node" and self.gpus_per_node):
                continue
            if value != getattr(base, f.name) or (f.name == "gpus_per_node" and value):
                flag = "queue" if f.name == "partition" and self.scheduler == "pbs" else f.name
                out.append(f"--{flag.replace('_', '-')} {value}")
        if self.preemptible:
            out.append("--preemptible")
        return " ".join(out)


def _values(s: JobSpec, filename: str) -> dict[str, str]:
    kind = f"{s.nodes} node(s) x {s.gpus_per_node} GPU(s)" if s.gpus_per_node else \
        f"{s.nodes} node(s) x {s.ranks_per_node} CPU rank(s)"
    title = f"{s.strategy} on {kind}" + (", pre-emptible (checkpoint, requeue, resume)"
                                          if s.preemptible else "")
    slurm = s.scheduler == "slurm"
    select = (f"{s.nodes}:ncpus={s.tasks_per_node * s.cpus_per_task}:mpiprocs={s.tasks_per_node}"
              + (f":ngpus={s.gpus_per_node}" if s.gpus_per_node else ""))

    def directive(key: str, value: str, example: str, site: str) -> str:
        if slurm:
            line = f"#SBATCH --{key}={value or example}"
        else:
            line = f"#PBS -{key} {value or example}"
        return line if value else f"#{line:<36} # SITE: {site}"

    return {
        "TITLE": title,
        "JOBGEN_ARGS": s.args(),
        "FILE": filename,
        "JOB_NAME": s.job_name,
        "NODES": str(s.nodes),
        "TASKS_PER_NODE": str(s.tasks_per_node),
        "CPUS_PER_TASK": str(s.cpus_per_task),
        "TIME": s.time,
        "SELECT": select,
        "PARTITION": directive("partition", s.partition, "gpu" if s.gpus_per_node else "cpu",
                               "your partition"),
        "QUEUE": directive("q", s.partition, "workq", "your queue"),
        "ACCOUNT": directive("account" if slurm else "A", s.account, "myproject",
                             "your allocation"),
        "STRATEGY": s.strategy,
        "MODEL": s.model,
        "STEPS": str(s.steps),
        "CHECKPOINT_DIR": s.checkpoint_dir,
        "CHECKPOINT_EVERY": str(s.checkpoint_every),
    }


def template_text(scheduler: str) -> str:
    return resources.files("hpctrain.jobscripts").joinpath(TEMPLATES[scheduler]).read_text()


def render(spec: JobSpec, filename: str = "") -> str:
    """Return the job script text for spec (validated first)."""
    s = spec.resolved()
    filename = filename or s.job_name + EXTENSIONS[s.scheduler]
    flags = {"gpu": s.gpus_per_node > 0, "preempt": s.preemptible}
    values = _values(s, os.path.basename(filename))
    out = []
    for line in template_text(s.scheduler).splitlines():
        m = _LINE_FLAG.match(line)
        if m and f"{{{{/{m.group(1)}}}}}" not in line:
            if not flags[m.group(1)]:
                continue
            line = line[m.end():]
        line = _SPAN.sub(lambda sm: sm.group(2) if flags[sm.group(1)] else "", line)
        line = _VALUE.sub(lambda vm: values[vm.group(1)], line)
        if "{{" in line:
            raise RuntimeError(f"unrendered template syntax in {TEMPLATES[s.scheduler]}: {line!r}")
        out.append(line.rstrip())
    return "\n".join(out) + "\n"


# The scripts shipped in jobs/: file name -> spec.
PRESETS = {
    "slurm-cpu.sbatch": JobSpec("slurm"),
    "slurm-gpu.sbatch": JobSpec("slurm", nodes=2, gpus_per_node=4, time="02:00:00"),
    "slurm-preempt.sbatch": JobSpec("slurm", preemptible=True, time="04:00:00"),
    "pbs-cpu.pbs": JobSpec("pbs"),
    "pbs-gpu.pbs": JobSpec("pbs", nodes=2, gpus_per_node=4, time="02:00:00"),
    "pbs-preempt.pbs": JobSpec("pbs", preemptible=True, time="04:00:00"),
}


def write_presets(directory: str) -> list[str]:
    """(Re)write every preset into directory (the repository's jobs/); return the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, spec in PRESETS.items():
        path = os.path.join(directory, name)
        with open(path, "w") as fh:
            fh.write(render(spec, name))
        os.chmod(path, 0o755)
        paths.append(path)
    return paths

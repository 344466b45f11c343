"""Imports point downward: every module under hpctrain/, read with ast (nothing imported).

The layers, top first, as the code has them (DESIGN.md's picture, with the two places where
the tree differs from its list of the layers written out):

  entry       the package's API (hpctrain/__init__.py), __main__, cli, cli_train, doctor,
              jobgen, bench/ (which times the CLI's own path, so bench and cli are peers)
  plan        plan/: estimates plans from the config, the registry and the models' shapes,
              so it sits above train (train/plan_options.py maps the config onto the options),
              not below the models; only the entry layer imports it
  train       train/
  config      config.py: reads the options tables and ParallelPlan from parallel/; train
              reads it
  parallel    parallel/
  components  checkpoint/, data/, models/ (peers)
  runtime     runtime/
  base        errors.py, units.py, version.py, jobscripts/, registry.py (the parallelisms,
              declared once), option.py (the options tables' field helper): pure, they
              import nothing of ours

Every import counts, function-local ones included (an import inside a function that dodges
the layering is still an upward import). A module may import its own layer and any below.
A new top-level module or package fails until it is given a layer here.
"""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "hpctrain")

LAYERS = (
    ("entry", ("", "__main__", "cli", "cli_train", "doctor", "jobgen", "bench")),
    ("plan", ("plan",)),
    ("train", ("train",)),
    ("config", ("config",)),
    ("parallel", ("parallel",)),
    ("components", ("checkpoint", "data", "models")),
    ("runtime", ("runtime",)),
    ("base", ("errors", "units", "version", "jobscripts", "registry", "option")),
)
RANK = {top: (i, name) for i, (name, tops) in enumerate(LAYERS) for top in tops}

# Upward imports that exist today, each named ("importer", "imported module"), so the list
# can only shrink: an entry that no longer occurs fails too, to be removed. Empty: none.
ALLOWED: set[tuple[str, str]] = set()


def _modules():
    """(dotted name, path, is a package's __init__) of every module under hpctrain/."""
    for folder, _dirs, files in os.walk(PACKAGE):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                dotted = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                is_init = f == "__init__.py"
                yield dotted.removesuffix(".__init__") if is_init else dotted, path, is_init


def _is_module(dotted: str) -> bool:
    path = os.path.join(ROOT, *dotted.split("."))
    return os.path.isfile(path + ".py") or os.path.isdir(path)


def _imports(module: str, path: str, is_init: bool):
    """(line, imported hpctrain module) of every import in the file, at any depth."""
    with open(path) as fh:
        tree = ast.parse(fh.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hpctrain":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[:len(module.split(".")) - node.level + is_init]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "hpctrain":
                continue
            for alias in node.names:  # `from hpctrain.x import y`: y may be a module itself
                sub = f"{target}.{alias.name}"
                yield node.lineno, sub if _is_module(sub) else target


def _top(dotted: str) -> str:
    """The part right under hpctrain ('' for the package itself)."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else ""


def _upward_imports() -> tuple[list[str], set[tuple[str, str]], list[str]]:
    lines, pairs, unplaced = [], set(), set()
    for module, path, is_init in _modules():
        top = _top(module)
        if top not in RANK:
            unplaced.add(top)
            continue
        for lineno, target in _imports(module, path, is_init):
            if _top(target) not in RANK:
                unplaced.add(_top(target))
                continue
            (mine, my_layer), (theirs, their_layer) = RANK[top], RANK[_top(target)]
            if theirs < mine:
                pairs.add((module, target))
                if (module, target) not in ALLOWED:
                    lines.append(f"{os.path.relpath(path, ROOT)}:{lineno}: {module} ({my_layer}) "
                                 f"imports {target} ({their_layer}), a higher layer")
    return lines, pairs, sorted(unplaced)


def test_every_top_level_module_has_a_layer():
    _, _, unplaced = _upward_imports()
    assert not unplaced, (f"hpctrain/{unplaced} is in no layer: add it to LAYERS in "
                          f"tests/test_layering.py where its imports put it")


def test_no_import_runs_upward():
    upward, _, _ = _upward_imports()
    assert not upward, ("imports must point downward (" + " > ".join(n for n, _ in LAYERS)
                        + "); move the shared code down, or pass it in:\n" + "\n".join(upward))


def test_the_allow_list_names_only_imports_that_still_exist():
    _, pairs, _ = _upward_imports()
    stale = sorted(ALLOWED - pairs)
    assert not stale, f"remove from ALLOWED, these imports are gone: {stale}"


def test_the_checker_sees_upward_and_function_local_imports(tmp_path):
    """The parser finds what the tests above rely on: a function-local import, a relative
    one, and a `from package import submodule`; and ranks an upward one as such."""
    src = ("import hpctrain.units\n"
           "from . import report\n"
           "def f():\n"
           "    from hpctrain import cli\n"
           "    from ..parallel import plan\n")
    path = tmp_path / "probe.py"
    path.write_text(src)
    found = sorted(_imports("hpctrain.train.probe", str(path), False))
    assert found == [(1, "hpctrain.units"), (2, "hpctrain.train.report"), (4, "hpctrain.cli"),
                     (5, "hpctrain.parallel.plan")], found
    assert RANK[_top("hpctrain.cli")][0] < RANK["train"][0] < RANK[_top("hpctrain.units")][0]

"""The modulefiles load with the OS's Lmod in a clean login shell and give a working hpctrain.

A site's modulefile depends_on the MPI and HDF5 modules named at install time; here those are
tiny stub modulefiles in a temp MODULEPATH (test fixtures only: they set one variable each).
The unfilled modulefile of a checkout depends on no module (`make setup` takes MPI and HDF5
from the OS) and loads with nothing else on MODULEPATH. No modulefile sets PYTHONPATH: the
install's bin/ on PATH gives its python.
"""

import os
import shutil
import subprocess
import sys

import pytest

from tests.hpc.conftest import LMOD_INIT
from tests.mpirun import ROOT

VERSION = __import__("hpctrain").__version__
VENV = sys.prefix


def _stubs(base, tcl=False):
    for name, var in (("openmpi/4.1", "STUB_MPI_LOADED"), ("hdf5/1.12", "STUB_HDF5_LOADED")):
        path = base / (name if tcl else name + ".lua")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"#%Module1.0\nsetenv {var} 1\n" if tcl else f'setenv("{var}", "1")\n')
    return base


def _clean_shell(script, cwd):
    """Run script in `bash -lc` with an empty environment (what a new login gets)."""
    if not os.path.exists(LMOD_INIT):
        pytest.skip("Lmod is not installed (`make setup` as root installs the lmod package)")
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": "/usr/local/bin:/usr/bin:/bin",
           "USER": "root", "LMOD_ALLOW_ROOT_USE": "yes"}
    return subprocess.run(["bash", "-lc", f"source {LMOD_INIT}\n{script}"], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=180)


def test_lmod_site_install_runs_doctor(tmp_path):
    """write-modulefile.sh PREFIX DIR, then module load hpctrain: doctor passes."""
    subprocess.run(["bash", os.path.join(ROOT, "modules", "write-modulefile.sh"), VENV,
                    str(tmp_path / "site"), "openmpi", "hdf5"], check=True, capture_output=True,
                   timeout=60)
    stubs = _stubs(tmp_path / "stubs")
    proc = _clean_shell(f"""
        module use {stubs} && module use {tmp_path}/site && module load hpctrain || exit 9
        echo "ROOT=$HPCTRAIN_ROOT MPI=$STUB_MPI_LOADED HDF5=$STUB_HDF5_LOADED"
        echo "PY=$(command -v python) PYTHONPATH=${{PYTHONPATH-unset}}"
        module list 2>&1
        python -m hpctrain doctor || exit 8
        module unload hpctrain && echo "AFTER=${{HPCTRAIN_ROOT:-unset}} ${{STUB_MPI_LOADED:-unset}}"
        """, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"ROOT={VENV} MPI=1 HDF5=1" in out
    assert f"PY={VENV}/bin/python PYTHONPATH=unset" in out
    assert f"hpctrain/{VERSION}" in out and "openmpi/4.1" in out and "hdf5/1.12" in out
    assert "doctor: all" in out and "checks passed" in out
    assert "AFTER=unset unset" in out  # depends_on unloads what it loaded


def test_lmod_checkout_loads_as_the_readme_says_and_doctor_passes(tmp_path):
    """Unfilled, modules/hpctrain/<v>.lua loads the .venv of the checkout holding it, with no
    MPI/HDF5 module on MODULEPATH (they came from the OS): the README's commands, then
    doctor. Python and hpctrain come through PATH alone (PYTHONPATH stays unset)."""
    checkout = tmp_path / "checkout"
    shutil.copytree(os.path.join(ROOT, "modules"), checkout / "modules")
    (checkout / ".venv").symlink_to(VENV)
    proc = _clean_shell(f"""
        cd {checkout} && module use modules && module load hpctrain || exit 9
        echo "ROOT=$HPCTRAIN_ROOT PYTHONPATH=${{PYTHONPATH-unset}} PY=$(command -v python)"
        module -t list 2>&1 | sed 's/^/LOADED /'
        python -c 'import hpctrain, sys; print("IMPORT", sys.prefix)' || exit 7
        python -m hpctrain doctor || exit 8
        """, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"ROOT={checkout}/.venv PYTHONPATH=unset PY={checkout}/.venv/bin/python" in out, out
    assert [ln for ln in out.splitlines() if ln.startswith("LOADED ")] == \
        [f"LOADED hpctrain/{VERSION}"], out  # depends on nothing
    assert f"IMPORT {checkout}/.venv" in out
    assert "doctor: all" in out and "FAIL" not in out, out


def test_lmod_missing_prefix_is_a_clear_error(tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copytree(os.path.join(ROOT, "modules"), checkout / "modules")  # no .venv
    proc = _clean_shell(f"module use {checkout}/modules && module load hpctrain",
                        cwd=str(tmp_path))
    assert proc.returncode != 0
    said = " ".join(proc.stderr.split())  # Lmod wraps its message at the terminal's width
    assert "install prefix" in said and "does not exist" in said, proc.stderr


def test_tcl_modulefile_loads_through_lmod(tmp_path):
    """Lmod reads Tcl modulefiles too (its tcl2lua runs the file in a real tclsh)."""
    env = dict(os.environ, HPCTRAIN_TCL_MODULEFILES=str(tmp_path / "tcl"))
    subprocess.run(["bash", os.path.join(ROOT, "modules", "write-modulefile.sh"), VENV,
                    str(tmp_path / "lua"), "openmpi", "hdf5"], check=True, env=env,
                   capture_output=True, timeout=60)
    stubs = _stubs(tmp_path / "stubs", tcl=True)
    proc = _clean_shell(f"""
        module use {stubs} && module use {tmp_path}/tcl && module load hpctrain || exit 9
        echo "ROOT=$HPCTRAIN_ROOT MPI=$STUB_MPI_LOADED PYTHONPATH=${{PYTHONPATH-unset}}"
        python -m hpctrain --version
        """, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"ROOT={VENV} MPI=1 PYTHONPATH=unset" in out
    assert f"hpctrain {VERSION}" in out


# Environment Modules' commands, recorded: enough to run a modulefile in plain tclsh.
TCL_HARNESS = r"""
set ModulesCurrentModulefile [lindex $argv 0]
set env_out [dict create]
set loaded {}
proc module-whatis {args} { puts "WHATIS [join $args]" }
proc setenv {k v} { puts "SETENV $k=$v" }
proc prepend-path {k v} { puts "PREPEND $k=$v" }
proc prereq {args} { puts "PREREQ [join $args]" }
proc conflict {args} { puts "CONFLICT [join $args]" }
proc is-loaded {m} { global loaded; expr {[lsearch $loaded $m] >= 0} }
proc module {cmd args} { global loaded; puts "MODULE $cmd [join $args]"; lappend loaded {*}$args }
proc module-info {what args} {
    if {$what eq "mode"} { return [expr {[lindex $args 0] eq "load"}] }
    return ""
}
source $ModulesCurrentModulefile
if {[info procs ModulesHelp] ne ""} { ModulesHelp }
"""


def test_tcl_modulefile_parses_in_tclsh(tmp_path):
    tclsh = shutil.which("tclsh")
    if tclsh is None:
        pytest.skip("tclsh not installed (the tcl package; Lmod depends on it)")
    env = dict(os.environ, HPCTRAIN_TCL_MODULEFILES=str(tmp_path / "tcl"))
    subprocess.run(["bash", os.path.join(ROOT, "modules", "write-modulefile.sh"), VENV,
                    str(tmp_path / "lua"), "mpi/openmpi-4", "hdf5-parallel", "cuda/12.4"],
                   check=True, env=env, capture_output=True, timeout=60)
    harness = tmp_path / "harness.tcl"
    harness.write_text(TCL_HARNESS)
    proc = subprocess.run([tclsh, str(harness), str(tmp_path / "tcl" / "hpctrain" / VERSION)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for line in (f"SETENV HPCTRAIN_ROOT={VENV}", f"PREPEND PATH={VENV}/bin",
                 "MODULE load mpi/openmpi-4", "PREREQ hdf5-parallel", "PREREQ cuda/12.4",
                 "WHATIS Name: hpctrain"):
        assert line in out, out
    assert "PYTHONPATH" not in out
    assert f"hpctrain {VERSION}" in proc.stderr  # ModulesHelp
    # unfilled (a checkout's): its .venv, no module loaded or required
    checkout = tmp_path / "checkout"
    shutil.copytree(os.path.join(ROOT, "modules"), checkout / "modules")
    (checkout / ".venv").symlink_to(VENV)
    unfilled = subprocess.run([tclsh, str(harness), str(checkout / "modules" / "tcl" /
                                                         "hpctrain" / VERSION)],
                              capture_output=True, text=True, timeout=60)
    assert unfilled.returncode == 0, unfilled.stderr
    assert f"PREPEND PATH={checkout}/.venv/bin" in unfilled.stdout, unfilled.stdout
    assert "MODULE" not in unfilled.stdout and "PREREQ" not in unfilled.stdout, unfilled.stdout


# A stand-in interpreter for install.sh's steps: prints each pip command it is given.
FAKE_PYTHON = "#!/bin/sh\necho \"PIP $*\"\n"


@pytest.mark.parametrize("editable", ["1", "0"])
def test_install_sh_puts_test_extras_only_in_a_development_install(tmp_path, editable):
    """HPCTRAIN_EDITABLE=1 (`make setup`, `make test`): pytest and transformers; 0 (a site
    prefix on users' PATH): neither, and h5py's build tools removed after the build."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(FAKE_PYTHON)
    (venv / "bin" / "python").chmod(0o755)
    env = dict(os.environ, HPCTRAIN_VENV=str(venv), HPCTRAIN_EDITABLE=editable)
    proc = subprocess.run(["bash", "-c", f"source {ROOT}/modules/install.sh && make_venv && "
                                         "remove_build_tools"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    pip = [ln.split() for ln in proc.stdout.splitlines() if ln.startswith("PIP ")]
    installed = {w.split("=")[0].split(">")[0] for ln in pip if "install" in ln for w in ln}
    assert {"torch", "mpi4py", "numpy", "Cython", "pkgconfig"} <= installed
    assert ({"pytest", "transformers"} <= installed) == (editable == "1"), pip
    removed = [ln for ln in pip if "uninstall" in ln]
    if editable == "1":
        assert removed == [], pip
    else:
        assert len(removed) == 1 and {"Cython", "pkgconfig"} <= set(removed[0]), pip

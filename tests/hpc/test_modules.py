"""The modulefiles load with the OS's Lmod in a clean login shell and give a working hpctrain.

The real modulefiles depend_on the site's MPI and HDF5 modules; here those are tiny stub
modulefiles in a temp MODULEPATH (test fixtures only: they set one variable each).
"""

import os
import shutil
import subprocess
import sys

import pytest

from tests.mpirun import ROOT

LMOD_INIT = "/usr/share/lmod/lmod/init/bash"
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
                    str(tmp_path / "site")], check=True, capture_output=True, timeout=60)
    stubs = _stubs(tmp_path / "stubs")
    proc = _clean_shell(f"""
        module use {stubs} && module use {tmp_path}/site && module load hpctrain || exit 9
        echo "ROOT=$HPCTRAIN_ROOT MPI=$STUB_MPI_LOADED HDF5=$STUB_HDF5_LOADED"
        echo "PY=$(command -v python)"
        module list 2>&1
        python -m hpctrain doctor || exit 8
        module unload hpctrain && echo "AFTER=${{HPCTRAIN_ROOT:-unset}} ${{STUB_MPI_LOADED:-unset}}"
        """, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"ROOT={VENV} MPI=1 HDF5=1" in out
    assert f"PY={VENV}/bin/python" in out
    assert f"hpctrain/{VERSION}" in out and "openmpi/4.1" in out and "hdf5/1.12" in out
    assert "doctor: all" in out and "checks passed" in out
    assert "AFTER=unset unset" in out  # depends_on unloads what it loaded


def test_lmod_checkout_default_prefix(tmp_path):
    """Unfilled, modules/hpctrain/<v>.lua points at the .venv of the checkout holding it."""
    checkout = tmp_path / "checkout"
    shutil.copytree(os.path.join(ROOT, "modules"), checkout / "modules")
    (checkout / ".venv").symlink_to(VENV)
    stubs = _stubs(tmp_path / "stubs")
    proc = _clean_shell(f"""
        module use {stubs} && module use {checkout}/modules && module load hpctrain || exit 9
        echo "ROOT=$HPCTRAIN_ROOT"
        python -c 'import hpctrain, sys; print("IMPORT", sys.prefix)'
        """, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert f"ROOT={checkout}/.venv" in out
    assert "IMPORT" in out


def test_lmod_missing_prefix_is_a_clear_error(tmp_path):
    checkout = tmp_path / "checkout"
    shutil.copytree(os.path.join(ROOT, "modules"), checkout / "modules")  # no .venv
    stubs = _stubs(tmp_path / "stubs")
    proc = _clean_shell(f"module use {stubs} {checkout}/modules && module load hpctrain",
                        cwd=str(tmp_path))
    assert proc.returncode != 0
    assert "install prefix" in proc.stderr and "does not exist" in proc.stderr, proc.stderr


def test_tcl_modulefile_loads_through_lmod(tmp_path):
    """Lmod reads Tcl modulefiles too (its tcl2lua runs the file in a real tclsh)."""
    env = dict(os.environ, HPCTRAIN_TCL_MODULEFILES=str(tmp_path / "tcl"))
    subprocess.run(["bash", os.path.join(ROOT, "modules", "write-modulefile.sh"), VENV,
                    str(tmp_path / "lua")], check=True, env=env, capture_output=True, timeout=60)
    stubs = _stubs(tmp_path / "stubs", tcl=True)
    proc = _clean_shell(f"""
        module use {stubs} && module use {tmp_path}/tcl && module load hpctrain || exit 9
        echo "ROOT=$HPCTRAIN_ROOT MPI=$STUB_MPI_LOADED PYTHONPATH=$PYTHONPATH"
        python -m hpctrain --version
        """, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    pyver = "%d.%d" % sys.version_info[:2]
    assert f"ROOT={VENV} MPI=1 PYTHONPATH={VENV}/lib/python{pyver}/site-packages" in out
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
    assert f"hpctrain {VERSION}" in proc.stderr  # ModulesHelp

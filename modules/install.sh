#!/usr/bin/env bash
# Install hpctrain and its real stack into a virtualenv, idempotently:
#   Open MPI + MPI-enabled HDF5 (OS packages, or the site's modules), torch (CPU wheel or
#   the site's), mpi4py, h5py BUILT against parallel HDF5, Horovod 0.28.1 BUILT from its
#   PyPI source (C++17 fix, MPI controller), and hpctrain itself.
#
# Built wheels are cached outside the clone, keyed by Python, torch and the MPI/HDF5 build,
# so a second run (or a second clone) installs in seconds; nothing depends on the cache.
#
# Variables (all optional):
#   HPCTRAIN_VENV       virtualenv to create or update     (default: <repo>/.venv)
#                       a site install points it at a prefix, e.g. /sw/hpctrain/0.1
#   HPCTRAIN_EDITABLE   1: editable install of this clone, with the test extras (pytest,
#                       transformers) for `make test`   (default 1)
#                       0: a site install: no test extras, and the build-only tools (Cython,
#                       pkgconfig, a venv cmake) removed once h5py and Horovod are built
#   HPCTRAIN_CACHE      built-wheel cache                   (default: ~/.cache/hpctrain)
#   PYTHON              interpreter for a new virtualenv    (default: python3)
#   TORCH_SPEC          torch requirement                   (default: torch==2.13.0)
#   HPCTRAIN_SKIP_OS_PACKAGES=1   never call apt-get (no root; MPI/HDF5 come from modules)
#   MPICC               MPI C compiler wrapper              (default: mpicc on PATH)
#   HDF5_DIR            prefix of the MPI-enabled HDF5      (default: Debian's openmpi flavour)
#   HOROVOD_GPU_OPERATIONS=NCCL   on GPU sites (set it with the CUDA module loaded)
#   HPCTRAIN_MODULEFILES  write an Lmod modulefile for this install into DIR/hpctrain/
#                         (HPCTRAIN_TCL_MODULEFILES: a Tcl one too; HPCTRAIN_MPI_MODULE,
#                         HPCTRAIN_HDF5_MODULE, HPCTRAIN_CUDA_MODULE: what it depends on)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HPCTRAIN_VENV:-$REPO/.venv}
EDITABLE=${HPCTRAIN_EDITABLE:-1}
CACHE=${HPCTRAIN_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpctrain}
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
HOROVOD_VERSION=0.28.1
H5PY_VERSION=3.16.0
OS_PACKAGES=(openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools g++ make cmake pkg-config)
# The HPC integration tests start a real one-node SLURM and load the modulefiles with Lmod
# (Lmod also reads the Tcl modulefile; Environment Modules conflicts with it in Debian).
OS_PACKAGES+=(slurm-wlm munge lmod tcl)
JOBS=$(nproc 2>/dev/null || echo 2)
BUILD_TOOLS=("Cython>=3" pkgconfig)  # h5py's build; removed again from a site install

log() { printf '[install] %s\n' "$*" >&2; }
die() { printf '[install] ERROR: %s\n' "$*" >&2; exit 1; }

# --- 1. OS packages: only as root on Debian/Ubuntu, only what is missing -------------------
install_os_packages() {
    if [ "${HPCTRAIN_SKIP_OS_PACKAGES:-0}" = 1 ]; then log "skipping OS packages (HPCTRAIN_SKIP_OS_PACKAGES=1)"; return; fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        log "not root or no apt-get: expecting MPI and parallel HDF5 from the site (module load ...)"
        return
    fi
    local missing=()
    for p in "${OS_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "apt-get install ${missing[*]}"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

# --- 2. Locate MPI and HDF5 ------------------------------------------------------------------
locate_toolchain() {
    MPICC=${MPICC:-$(command -v mpicc || true)}
    [ -n "$MPICC" ] && [ -x "$MPICC" ] || die "no MPI C compiler found. Install Open MPI (apt-get install openmpi-bin libopenmpi-dev) or 'module load' your site's MPI, or set MPICC=/path/to/mpicc"
    if [ -z "${HDF5_DIR:-}" ]; then
        for d in /usr/lib/x86_64-linux-gnu/hdf5/openmpi /usr/lib/aarch64-linux-gnu/hdf5/openmpi; do
            [ -d "$d" ] && HDF5_DIR=$d && break
        done
    fi
    [ -n "${HDF5_DIR:-}" ] && [ -d "$HDF5_DIR/include" ] || die "no MPI-enabled HDF5 found. Install libhdf5-openmpi-dev, or 'module load' your site's parallel HDF5 and set HDF5_DIR to its prefix"
    grep -q "H5_HAVE_PARALLEL 1" "$HDF5_DIR"/include/H5pubconf*.h 2>/dev/null || die "HDF5 at $HDF5_DIR is not built with MPI (H5_HAVE_PARALLEL missing): point HDF5_DIR at a parallel HDF5"
    export MPICC HDF5_DIR
}

# --- 3. The virtualenv and the wheels pip can fetch -----------------------------------------
make_venv() {
    [ -x "$VENV/bin/python" ] || { log "creating virtualenv $VENV"; "$PYTHON" -m venv "$VENV"; }
    PY=$VENV/bin/python
    PIP=("$PY" -m pip --disable-pip-version-check -q)
    # The test extras only for a development install: a site prefix is on users' PATH.
    # transformers: the tests pipeline Hugging Face GPT-2 and Llama; installed next to the pinned
    # torch, which it does not replace (torch is an optional dependency of transformers).
    local extras=()
    [ "$EDITABLE" = 1 ] && extras=(pytest transformers)
    log "installing $TORCH_SPEC, numpy, mpi4py, build tools${extras:+ and the test extras (${extras[*]})}"
    # tensorboard: torch's SummaryWriter needs it for the run's event files; psutil, pyyaml,
    # cloudpickle, packaging: Horovod's; Cython, pkgconfig: h5py's build.
    "${PIP[@]}" install "$TORCH_SPEC" numpy mpi4py tqdm tensorboard "${extras[@]}" \
        "${BUILD_TOOLS[@]}" setuptools wheel packaging psutil pyyaml cloudpickle matplotlib \
        2> >(grep -v "is ignored" >&2)
    # Horovod needs cmake 3.13..3.x: cmake 4 refuses its bundled gloo.
    local cv
    cv=$(cmake --version 2>/dev/null | head -1 | grep -oE '[0-9]+\.[0-9]+' | head -1 || true)
    case "$cv" in 3.*) ;; *) log "cmake '${cv:-none}' unusable for Horovod; installing cmake<4 into the venv"
        "${PIP[@]}" install "cmake>=3.13,<4" ;; esac
}

# A site install keeps only what runs: the tools that built h5py and Horovod go.
remove_build_tools() {
    [ "$EDITABLE" = 1 ] && return
    local present=()
    for p in Cython pkgconfig cmake; do
        "${PIP[@]}" show "$p" >/dev/null 2>&1 && present+=("$p")
    done
    [ ${#present[@]} -eq 0 ] && return
    log "site install: removing the build-only tools ${present[*]}"
    "${PIP[@]}" uninstall -y "${present[@]}"
}

# The cache key: anything that changes the ABI of the built wheels.
cache_dir() {
    local pytag torchv key
    pytag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
    torchv=$("$PY" -c 'import torch; print(torch.__version__)')
    key=$( { "$MPICC" -show 2>/dev/null; mpirun --version 2>/dev/null | head -1; echo "$HDF5_DIR";
             grep -h "H5_VERSION " "$HDF5_DIR"/include/H5pubconf*.h 2>/dev/null;
             echo "${HOROVOD_GPU_OPERATIONS:-}"; } | md5sum | cut -c1-10)
    echo "$CACHE/wheels/$pytag-torch$torchv-$key"
}

# --- 4. h5py against parallel HDF5 -----------------------------------------------------------
install_h5py() {
    if "$PY" -c 'import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)' 2>/dev/null; then
        log "h5py with MPI already installed"; return
    fi
    local whl
    whl=$(ls "$WHEELS"/h5py-"$H5PY_VERSION"-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$whl" ]; then
        log "building h5py $H5PY_VERSION against parallel HDF5 ($HDF5_DIR)"
        # No build isolation: with it pip compiles mpi4py from source (over 20 GB of memory).
        CC=$MPICC HDF5_MPI=ON HDF5_DIR=$HDF5_DIR "${PIP[@]}" wheel --no-binary=h5py --no-build-isolation \
            --no-deps -w "$WHEELS" "h5py==$H5PY_VERSION"
        whl=$(ls "$WHEELS"/h5py-"$H5PY_VERSION"-*.whl | head -1)
    else
        log "h5py from cache: $whl"
    fi
    "${PIP[@]}" install --force-reinstall --no-deps "$whl"
    "$PY" -c 'import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)' || die "h5py installed but h5py.get_config().mpi is False"
}

# --- 5. Horovod from its sdist with the C++17 fix --------------------------------------------
install_horovod() {
    if "$PY" -c "import horovod, horovod.torch as h, sys; sys.exit(0 if horovod.__version__ == '$HOROVOD_VERSION' and h.mpi_built() else 1)" 2>/dev/null; then
        log "Horovod $HOROVOD_VERSION with MPI already installed"; return
    fi
    local whl
    whl=$(ls "$WHEELS"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$whl" ]; then
        local src
        src=$(mktemp -d)
        log "building Horovod $HOROVOD_VERSION from source (a few minutes)"
        "${PIP[@]}" download --no-deps --no-binary :all: --no-build-isolation -d "$src" "horovod==$HOROVOD_VERSION"
        tar xzf "$src"/horovod-"$HOROVOD_VERSION".tar.gz -C "$src"
        # torch >= 2.1 headers need C++17; the 0.28.1 release forces C++14 (fixed upstream on master only).
        sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
            "$src/horovod-$HOROVOD_VERSION/CMakeLists.txt" "$src/horovod-$HOROVOD_VERSION/horovod/torch/CMakeLists.txt"
        ( cd "$src/horovod-$HOROVOD_VERSION" &&
          PATH=$VENV/bin:$PATH MAKEFLAGS=-j$JOBS HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 \
          HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
          "${PIP[@]}" wheel --no-build-isolation --no-deps -w "$WHEELS" . )
        rm -rf "$src"
        whl=$(ls "$WHEELS"/horovod-"$HOROVOD_VERSION"-*.whl | head -1)
    else
        log "Horovod from cache: $whl"
    fi
    "${PIP[@]}" install --force-reinstall --no-deps "$whl"
    "$PY" -c 'import horovod.torch as h, sys; sys.exit(0 if h.mpi_built() else 1)' || die "Horovod installed but built without MPI"
}

install_hpctrain() {
    # --no-deps: pip must not replace the MPI-enabled h5py with a serial binary wheel.
    if [ "$EDITABLE" = 1 ]; then
        "${PIP[@]}" install --no-deps --no-build-isolation -e "$REPO"
    else
        "${PIP[@]}" install --no-deps --no-build-isolation "$REPO"
    fi
}

main() {
    install_os_packages
    locate_toolchain
    make_venv
    WHEELS=$(cache_dir)
    mkdir -p "$WHEELS"
    install_h5py
    install_horovod
    install_hpctrain
    remove_build_tools
    if [ -n "${HPCTRAIN_MODULEFILES:-}" ]; then
        bash "$REPO/modules/write-modulefile.sh" "$VENV" "$HPCTRAIN_MODULEFILES" \
            "${HPCTRAIN_MPI_MODULE-}" "${HPCTRAIN_HDF5_MODULE-}" "${HPCTRAIN_CUDA_MODULE-}" >&2
    fi
    log "done: $VENV (activate with: source $VENV/bin/activate)"
}

# Sourced (tests/hpc/test_modules.py), it only defines the steps.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    main
fi

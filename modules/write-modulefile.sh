#!/usr/bin/env bash
# Write site modulefiles for an hpctrain install (Lmod .lua and Environment Modules Tcl):
#   modules/write-modulefile.sh PREFIX DIR [MPI_MODULE] [HDF5_MODULE] [CUDA_MODULE]
# PREFIX is the install (HPCTRAIN_VENV of modules/install.sh); DIR is a directory on the
# site's MODULEPATH: this writes DIR/hpctrain/<version>.lua (Lmod) and, when
# HPCTRAIN_TCL_MODULEFILES=TCL_DIR is set, TCL_DIR/hpctrain/<version> (Environment Modules).
# The modulefile depends on the modules named here and on nothing else (none named: MPI and
# HDF5 came from the OS packages, as with `make setup`).
set -euo pipefail
[ $# -ge 2 ] || { echo "usage: $0 PREFIX DIR [MPI_MODULE] [HDF5_MODULE] [CUDA_MODULE]" >&2; exit 2; }
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PREFIX=$(cd "$1" && pwd) || { echo "$0: install prefix $1 does not exist" >&2; exit 2; }
DIR=$2
MPI=${3-}
HDF5=${4-}
CUDA=${5-}
[ -x "$PREFIX/bin/python" ] || { echo "$0: $PREFIX/bin/python missing: install first (modules/install.sh)" >&2; exit 2; }
for v in "$PREFIX" "$MPI" "$HDF5" "$CUDA"; do
    case "$v" in *[\"\\\;\$\`]*) echo "$0: refusing value with quotes or shell characters: $v" >&2; exit 2;; esac
done

fill() {  # fill the SITE values of one modulefile: $1 template, $2 output, $3 assignment syntax
    local q='"'
    sed -e "s|^\(${3}site_prefix *\)[= ]*\"\"|\1${4}${q}${PREFIX}${q}|" \
        -e "s|^\(${3}mpi_module *\)[= ]*\"[^\"]*\"|\1${4}${q}${MPI}${q}|" \
        -e "s|^\(${3}hdf5_module *\)[= ]*\"[^\"]*\"|\1${4}${q}${HDF5}${q}|" \
        -e "s|^\(${3}cuda_module *\)[= ]*\"[^\"]*\"|\1${4}${q}${CUDA}${q}|" "$1" > "$2"
    grep -q "${PREFIX}" "$2" || { echo "$0: could not fill $2" >&2; exit 1; }
}

for lua in "$HERE"/hpctrain/*.lua; do
    mkdir -p "$DIR/hpctrain"
    fill "$lua" "$DIR/hpctrain/$(basename "$lua")" "local " "= "
    echo "wrote $DIR/hpctrain/$(basename "$lua")"
done
if [ -n "${HPCTRAIN_TCL_MODULEFILES:-}" ]; then
    for tcl in "$HERE"/tcl/hpctrain/*; do
        mkdir -p "$HPCTRAIN_TCL_MODULEFILES/hpctrain"
        fill "$tcl" "$HPCTRAIN_TCL_MODULEFILES/hpctrain/$(basename "$tcl")" "set " ""
        echo "wrote $HPCTRAIN_TCL_MODULEFILES/hpctrain/$(basename "$tcl")"
    done
fi

#!/usr/bin/env bash
# The GPU check's one command on the GPU machine:  tests/gpu/run.sh OUTDIR [bench gpu args]
#
# 1. prints what the machine has (python, torch, GPUs);
# 2. makes MPI work: if mpi4py finds no MPI library, or there is no mpiexec, or a 2-rank hello
#    through it fails, it installs the wheels in <repo>/.whl (or $HPCTRAIN_WHEELS): the
#    `mpich` wheel (libmpi + hydra's mpiexec) and a matching `mpi4py` wheel, then checks again;
# 3. runs `python3 -m hpctrain bench gpu --out OUTDIR "$@"`.
#
# Why MPICH goes in with --prefix and not --target: pip --target drops a wheel's data files
# under lib/ (it skips them as overlapping its own lib/python), and libmpi.so.12 is one.
# mpi4py 4.x picks its extension by the MPI ABI of the libmpi it dlopens; MPI4PY_LIBMPI names
# that file, so no other MPI on the loader's path can be taken instead.
set -u
out=${1:?usage: tests/gpu/run.sh OUTDIR [bench gpu args]}
shift
mkdir -p "$out" && out=$(cd "$out" && pwd) || exit 2
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root" || exit 2
PY=${HPCTRAIN_PYTHON:-python3}
wheels=${HPCTRAIN_WHEELS:-$root/.whl}
site=/tmp/hpctrain-site
mpich=/tmp/hpctrain-mpich
export PYTHONUNBUFFERED=1
# An Open MPI found on the machine refuses root and more ranks than cores without these.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

echo "== machine"
echo "python: $(command -v "$PY") $("$PY" -c 'import sys; print(sys.version.split()[0])' 2>&1)"
"$PY" -c 'import torch; print("torch:", torch.__version__, "cuda", torch.version.cuda,
  "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())' 2>&1 | tail -3
nvidia-smi -L 2>&1 | head -8
echo "cores: $(nproc --all)  root: $root"

# torch (and CUDA) first, as in hpctrain's ranks: the MPI library must live beside them.
hello='import torch; torch.ones(1, device="cuda" if torch.cuda.is_available() else "cpu")
from mpi4py import MPI; c = MPI.COMM_WORLD
s = c.allreduce(c.Get_rank() + 1)
assert (c.Get_size(), s) == (2, 3), (c.Get_size(), s)
c.Get_rank() or print("2-rank hello (torch imported): ok")'

# mpi_ok: mpi4py loads an MPI library, mpiexec answers, and 2 ranks all-reduce through it.
mpi_ok() {
    local text rc
    text=$("$PY" -c 'from mpi4py import MPI, __version__ as v
print("mpi4py", v, "->", MPI.Get_library_version().strip("\0 \n").splitlines()[0])' 2>&1)
    rc=$?
    echo "$text" | tail -4
    [ $rc = 0 ] || return 1
    command -v mpiexec >/dev/null || { echo "mpiexec: not on PATH"; return 1; }
    echo "mpiexec: $(command -v mpiexec): $(mpiexec --version 2>&1 | head -3 | tr -s ' \n' ' ')"
    text=$(timeout 30 mpiexec -n 2 "$PY" -c "$hello" 2>&1)
    rc=$?
    echo "$text" | tail -6
    [ $rc = 0 ]
}

echo "== MPI as found"
if mpi_ok; then
    echo "MPI: the machine's own"
elif ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "MPI: not working and no wheels in $wheels: the multi-rank items will fail"
else
    echo "== MPI from $wheels: $(cd "$wheels" && ls -- *.whl | tr '\n' ' ')"
    pipi() { "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --disable-pip-version-check --upgrade "$@"; }
    others=$(ls "$wheels"/*.whl | grep -v '/mpich-')
    mpich_whl=$(ls "$wheels"/mpich-*.whl 2>/dev/null)
    if "$PY" -m pip --version >/dev/null 2>&1 \
            && { [ -z "$others" ] || pipi --target "$site" $others; } \
            && { [ -z "$mpich_whl" ] || pipi --prefix "$mpich" $mpich_whl; }; then
        echo "installed with pip"
    else
        echo "no pip, or it failed: unzipping the wheels (packages to $site, data files to $mpich)"
        "$PY" - "$site" "$mpich" "$wheels"/*.whl <<'EOF' || echo "unzipping failed"
import os, sys, zipfile
site, prefix, *wheels = sys.argv[1:]
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.is_dir():
                continue
            parts = info.filename.split("/")
            if parts[0].endswith(".data") and len(parts) > 2:  # NAME.data/SCHEME/...
                base = {"data": prefix, "scripts": os.path.join(prefix, "bin")}.get(parts[1], site)
                dest = os.path.join(base, *parts[2:])
            else:
                dest = os.path.join(site, *parts)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with z.open(info) as src, open(dest, "wb") as out:
                out.write(src.read())
            if (info.external_attr >> 16) & 0o111:
                os.chmod(dest, 0o755)
EOF
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    lib=$(find "$mpich" -name 'libmpi.so.12' -type f 2>/dev/null | head -1)
    bin=$(find "$mpich" -name 'mpiexec.hydra' -type f 2>/dev/null | head -1)
    if [ -n "$lib" ] && [ -n "$bin" ]; then
        bin=$(dirname "$bin")
        export MPI4PY_LIBMPI="$lib" HPCTRAIN_MPIEXEC="$bin/mpiexec"
        export LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export PATH="$bin:$PATH"
        echo "MPICH: libmpi $lib, mpiexec $bin/mpiexec"
    else
        echo "MPICH: libmpi.so.12 or mpiexec.hydra not found under $mpich"
    fi
    if mpi_ok; then
        echo "MPI: from the wheels"
    else
        # MPICH's default netmod is UCX; OFI's tcp provider needs nothing but a socket.
        export MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp
        echo "== MPI again with MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp"
        mpi_ok && echo "MPI: from the wheels (ofi tcp)" \
            || echo "MPI: still not working: the multi-rank items will fail"
    fi
fi

echo "== hpctrain bench gpu --out $out $*"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m hpctrain bench gpu --out "$out" "$@"

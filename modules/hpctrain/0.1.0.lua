-- -*- lua -*-
-- Lmod modulefile for hpctrain 0.1.0.
-- A site install writes a copy with the SITE values filled in:
--     modules/write-modulefile.sh PREFIX MODULEFILES_DIR [MPI_MODULE] [HDF5_MODULE] [CUDA_MODULE]
-- (modules/install.sh does it when HPCTRAIN_MODULEFILES is set). Unfilled, this file loads
-- the .venv of the checkout it lives in (`make setup`): `module use modules; module load hpctrain`,
-- and depends on no other module (`make setup` takes MPI and HDF5 from the OS packages).

local version     = "0.1.0"
local site_prefix = ""          -- SITE: install prefix (HPCTRAIN_VENV given to modules/install.sh)
local mpi_module  = ""          -- SITE: the MPI module hpctrain was built against ("": none)
local hdf5_module = ""          -- SITE: the parallel HDF5 module h5py was built against ("": none)
local cuda_module = ""          -- SITE: the CUDA module on GPU sites ("" on CPU-only installs)

local checkout = myFileName():match("^(.*)/modules/hpctrain/[^/]+$")
local prefix = site_prefix ~= "" and site_prefix or pathJoin(checkout or "", ".venv")

local loads = {}
for _, m in ipairs({mpi_module, hdf5_module, cuda_module}) do
    if m ~= "" then table.insert(loads, m) end
end

whatis("Name: hpctrain")
whatis("Version: " .. version)
whatis("Description: train PyTorch models on supercomputers (MPI ranks, Horovod DDP, ZeRO, parallel HDF5 checkpoints)")
whatis("URL: https://github.com/hpctrain/hpctrain")

help([[
hpctrain ]] .. version .. [[ -- training toolkit for PyTorch on supercomputers.

  srun python -m hpctrain train --strategy ddp      # under SLURM
  mpiexec -n 8 --ppn 4 python -m hpctrain train     # PBS / Cray PALS
  python -m hpctrain doctor                         # check MPI, Horovod, parallel HDF5
  python -m hpctrain jobgen --scheduler slurm --nodes 2 --gpus-per-node 4 -o job.sbatch

Loads: ]] .. (#loads > 0 and table.concat(loads, " ") or "no other module (MPI and HDF5 of the OS)") .. [[

Install prefix: ]] .. prefix .. [[
]])

-- The MPI/HDF5/CUDA that mpi4py, h5py and Horovod were built against must be loaded too
-- (only those named at install time): depends_on loads them if needed and unloads them with
-- hpctrain only if it loaded them.
for _, m in ipairs(loads) do
    depends_on(m)
end

if not isDir(prefix) and mode() == "load" then
    LmodError("hpctrain: install prefix " .. prefix .. " does not exist; run `make setup` in the " ..
              "checkout, or write a site modulefile with modules/write-modulefile.sh PREFIX DIR")
end

setenv("HPCTRAIN_ROOT", prefix)
setenv("HPCTRAIN_VERSION", version)
-- Only the install's bin/ (its python, the hpctrain command): `python -m hpctrain` runs the
-- install's interpreter with its own site-packages. No PYTHONPATH: that would put this
-- install's torch into every other Python environment of the user.
prepend_path("PATH", pathJoin(prefix, "bin"))
family("hpctrain")

-- -*- lua -*-
-- Lmod modulefile for hpctrain 0.1.0.
-- A site install writes a copy with the SITE values filled in:
--     modules/write-modulefile.sh PREFIX MODULEFILES_DIR [MPI_MODULE] [HDF5_MODULE] [CUDA_MODULE]
-- (modules/install.sh does it when HPCTRAIN_MODULEFILES is set). Unfilled, this file loads
-- the .venv of the checkout it lives in (`make setup`): `module use modules; module load hpctrain`.

local version     = "0.1.0"
local site_prefix = ""          -- SITE: install prefix (HPCTRAIN_VENV given to modules/install.sh)
local mpi_module  = "openmpi"   -- SITE: the MPI module hpctrain was built against ("" for none)
local hdf5_module = "hdf5"      -- SITE: the parallel HDF5 module h5py was built against ("" for none)
local cuda_module = ""          -- SITE: the CUDA module on GPU sites ("" on CPU-only installs)
local pyver       = ""          -- SITE: python X.Y of the install ("" asks its python at load time)

local checkout = myFileName():match("^(.*)/modules/hpctrain/[^/]+$")
local prefix = site_prefix ~= "" and site_prefix or pathJoin(checkout or "", ".venv")

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

Loads: ]] .. table.concat({mpi_module, hdf5_module, cuda_module}, " ") .. [[

Install prefix: ]] .. prefix .. [[
]])

-- The MPI/HDF5/CUDA that mpi4py, h5py and Horovod were built against must be loaded too;
-- depends_on loads them if needed and unloads them with hpctrain only if it loaded them.
for _, m in ipairs({mpi_module, hdf5_module, cuda_module}) do
    if m ~= "" then depends_on(m) end
end

if not isDir(prefix) and mode() == "load" then
    LmodError("hpctrain: install prefix " .. prefix .. " does not exist; run `make setup` in the " ..
              "checkout, or write a site modulefile with modules/write-modulefile.sh PREFIX DIR")
end

if pyver == "" and isFile(pathJoin(prefix, "bin", "python")) then
    pyver = capture(pathJoin(prefix, "bin", "python") ..
                    " -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'"):gsub("%s+", "")
end

setenv("HPCTRAIN_ROOT", prefix)
setenv("HPCTRAIN_VERSION", version)
prepend_path("PATH", pathJoin(prefix, "bin"))
if pyver ~= "" then
    prepend_path("PYTHONPATH", pathJoin(prefix, "lib", "python" .. pyver, "site-packages"))
end
family("hpctrain")

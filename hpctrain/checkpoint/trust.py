"""A checkpoint file is untrusted input: it may hold only its own data, of sizes it can hold.

HDF5 lets a dataset live elsewhere: an external link or a soft link in place of it, raw
files as its storage (``external=``), a virtual dataset mapping another HDF5 file. Reading
such a checkpoint would load (or `ckpt export` would copy) some other file's data. And a
dataset's shape is only a claim: one of 1e12 elements in a 1 MB file makes a reader allocate
terabytes before any checksum is looked at. ``problems`` refuses both by the file's metadata
alone, before anything is read. The one thing allowed to point elsewhere is the serial
fallback's master (serial_fallback.py): virtual datasets whose sources are its own rank files,
by their exact names inside its own parts directory (no symbolic link on the way); those
files are checked the same way, and every block read through them is verified against the
master's CRCs. A virtual dataset over the file's own datasets reads the file itself: allowed.
"""

from __future__ import annotations

import os
import re

import h5py
import numpy as np

__all__ = ["problems", "MAX_GZIP_RATIO"]

# zlib's deflate cannot compress better than about 1032:1: a gzip-compressed dataset cannot
# hold more than this many bytes per stored byte.
MAX_GZIP_RATIO = 1032
# Filters that keep the data's size (shuffle, fletcher32) or bound it (deflate).
_FILTERS = {h5py.h5z.FILTER_DEFLATE: MAX_GZIP_RATIO, h5py.h5z.FILTER_SHUFFLE: 1,
            h5py.h5z.FILTER_FLETCHER32: 1}
# The serial fallback's parts directory (NAME.parts next to the master NAME, with a token
# subdirectory, or none in older masters) and its rank files, relative to the master's
# directory. NAME is the master's name when it was written: a renamed copy still reads them.
_PARTS = re.compile(r"^[^/]+\.parts(/[0-9a-f]+)?$")
_RANK_FILE = re.compile(r"^rank-\d{5,}\.h5$")

_FIX = "a checkpoint may hold only its own data: use one as hpctrain wrote it"


def _links(f: h5py.File) -> list[str]:
    """Soft, external and user-defined links anywhere in f (hpctrain writes only hard links)."""
    out = []

    def visit(name: bytes, info):
        if info.type == h5py.h5l.TYPE_HARD:
            return None
        name = name.decode("utf-8", "replace")
        link = f.get(name, getlink=True)
        if isinstance(link, h5py.ExternalLink):
            out.append(f"{name!r} is an external link to {link.path!r} in the file "
                       f"{link.filename!r}; {_FIX}")
        elif isinstance(link, h5py.SoftLink):
            out.append(f"{name!r} is a soft link to {link.path!r}; hpctrain writes no links "
                       f"(through one a name loads another object's data): use the checkpoint "
                       f"as hpctrain wrote it")
        else:
            out.append(f"{name!r} is a user-defined link (type {info.type}); {_FIX}")
        return None

    f.id.links.visit(visit, info=True)
    return out


def _elements(d: h5py.Dataset) -> int:
    """Elements d's shape claims (Python ints: an absurd shape must not overflow)."""
    return int(np.prod(d.shape, dtype=object)) if d.shape else 1


# HDF5 refuses compact data over 64 KiB (it lives in the object header).
_COMPACT_MAX = 65536


def _size_problem(name: str, d: h5py.Dataset, dcpl, file_size: int) -> str | None:
    """Why d's claimed size is not backed by bytes of the file, or None."""
    claim = _elements(d) * d.id.get_type().get_size()  # bytes as stored, not as numpy's
    layout = dcpl.get_layout()
    if claim == 0:
        return None
    stored = d.id.get_storage_size()
    if layout == h5py.h5d.COMPACT:
        if stored == claim <= _COMPACT_MAX:
            return None
        where = f"{stored:,d} bytes in its object header"
    elif layout == h5py.h5d.CONTIGUOUS:
        offset = d.id.get_offset()
        if offset is not None and stored == claim and offset + stored <= file_size:
            return None
        where = "none" if offset is None else f"{stored:,d} bytes at offset {offset:,d}"
    elif layout == h5py.h5d.CHUNKED:
        filters = [dcpl.get_filter(i) for i in range(dcpl.get_nfilters())]
        unknown = [f"{code} ({fname.decode(errors='replace')})"
                   for code, _, _, fname in filters if code not in _FILTERS]
        if unknown:
            return (f"dataset {name!r} is stored with the HDF5 filter {unknown[0]}, whose "
                    f"decoded size cannot be bounded; a checkpoint may be compressed only "
                    f"with gzip, shuffle or fletcher32 (h5repack -f GZIP=N)")
        ratio = max([_FILTERS[code] for code, *_ in filters] + [1])
        if stored <= file_size and claim <= stored * ratio:
            return None
        where = f"{stored:,d} bytes in chunks" + (f" (at most {ratio}x that decoded)"
                                                   if ratio > 1 else "")
    else:
        return None  # virtual: bounded by its sources (_virtual_problems)
    return (f"dataset {name!r} claims shape {tuple(d.shape)} of {d.dtype} "
            f"({claim:,d} bytes) but the file stores {where} for it (file size "
            f"{file_size:,d} bytes); the file is damaged or forged: resume from an older "
            f"checkpoint")


class _Sources:
    """The files a checkpoint's virtual datasets may map: itself ('.') and the serial
    fallback's own rank files, each checked once; per file, its datasets' (elements, dtype)."""

    def __init__(self, f: h5py.File, path: str):
        parts = f.attrs.get("parts") if f.attrs.get("layout") == "virtual" else None
        parts = parts.decode() if isinstance(parts, bytes) else parts
        self.parts = parts if isinstance(parts, str) and _PARTS.match(parts) else None
        self.base = os.path.dirname(os.path.abspath(path))
        self.files: dict[str, dict | str] = {}  # name -> its datasets, or why it is refused

    def allowed(self, fname: str) -> bool:
        """Whether fname (as a virtual mapping names it) is the file itself ('.') or one of
        the serial fallback's own rank files."""
        return fname == "." or (self.parts is not None and os.path.dirname(fname) == self.parts
                                and bool(_RANK_FILE.match(os.path.basename(fname))))

    def datasets(self, fname: str) -> dict | str:
        """{name: (elements, dtype)} of the file fname, or why it cannot be used."""
        if fname not in self.files:
            self.files[fname] = self._check(fname)
        return self.files[fname]

    def _check(self, fname: str) -> dict | str:
        full = os.path.join(self.base, fname)
        # Through a symbolic link it would be a file elsewhere: none on the way is allowed.
        if (os.path.realpath(full) != os.path.join(os.path.realpath(self.base), fname)
                or not os.path.isfile(full)):
            return (f"its rank file {fname!r} is missing or not a plain file (a symbolic link "
                    f"leads elsewhere); keep the directory {self.parts.split('/')[0]!r} next "
                    f"to the master as hpctrain wrote it, or resume from an older checkpoint")
        try:
            with h5py.File(full, "r", locking=False) as src:
                table: dict = {}
                found = _file_problems(src, full, None, table)
        except OSError as exc:
            return (f"its rank file {fname!r} cannot be read ({exc}); resume from an older "
                    f"checkpoint")
        return f"its rank file {fname!r}: {found[0]}" if found else table


def _virtual_problems(name: str, d: h5py.Dataset, dcpl, sources: _Sources | None) -> list[str]:
    """Why the virtual dataset d reads something other than its own file's (or its serial
    master's rank files') data, or claims more elements than its sources hold."""
    mapped, used = 0, {}
    for i in range(dcpl.get_virtual_count()):
        fname, dname = dcpl.get_virtual_filename(i), dcpl.get_virtual_dsetname(i).lstrip("/")
        npoints = dcpl.get_virtual_vspace(i).get_select_npoints()
        mapped += npoints
        # A rank file's dataset has the master's dataset's name.
        if sources is None or not sources.allowed(fname) or (fname != "." and dname != name):
            return [f"dataset {name!r} is a virtual dataset reading {dname!r} in the file "
                    f"{fname!r}; {_FIX}"]
        table = sources.datasets(fname)
        if isinstance(table, str):  # the same words for every dataset: reported once
            return [table]
        size, dtype = table.get(dname, (0, None))
        if dtype != d.dtype:
            return [f"dataset {name!r} maps {dname!r} in the file {fname!r}, which holds no "
                    f"{d.dtype} dataset of that name; the file is damaged"]
        used[fname, dname] = used.get((fname, dname), 0) + npoints
        if used[fname, dname] > size:
            return [f"dataset {name!r} maps {used[fname, dname]:,d} elements of {dname!r} in "
                    f"the file {fname!r}, which holds {size:,d}; the file is damaged or "
                    f"forged"]
    claim = _elements(d)
    if mapped < claim:
        return [f"dataset {name!r} claims shape {tuple(d.shape)} ({claim:,d} elements) but "
                f"its virtual mappings cover {mapped:,d}; the file is damaged or forged"]
    return []


def _file_problems(f: h5py.File, path: str, sources: _Sources | None,
                   table: dict | None = None) -> list[str]:
    """problems() of f; sources: the files its virtual datasets may map (None: none);
    table: filled with {name: (elements, dtype)} of its datasets."""
    out = _links(f)
    file_size = os.path.getsize(path)
    datasets = []
    f.visititems(lambda n, o: datasets.append((n, o)) if isinstance(o, h5py.Dataset) else None)
    table = {} if table is None else table
    table.update({name: (_elements(d), d.dtype) for name, d in datasets})
    if sources is not None:
        sources.files["."] = table
    for name, d in datasets:
        dcpl = d.id.get_create_plist()
        if dcpl.get_external_count():
            raw, offset, size = dcpl.get_external(0)
            out.append(f"dataset {name!r} keeps its data in the external raw file "
                       f"{raw.decode(errors='replace')!r} (offset {offset}, {size} bytes); "
                       f"{_FIX}")
        elif dcpl.get_layout() == h5py.h5d.VIRTUAL:
            out += _virtual_problems(name, d, dcpl, sources)
        elif (why := _size_problem(name, d, dcpl, file_size)) is not None:
            out.append(why)
    return out


def problems(f: h5py.File, path: str) -> list[str]:
    """What makes the checkpoint f (opened from path) read data outside itself, or claim
    more data than it can hold; an empty list: neither. Reads metadata only."""
    try:
        return _file_problems(f, path, _Sources(f, path))
    except (OSError, ValueError, RuntimeError) as exc:
        return [f"its layout cannot be read ({exc}); the file is damaged: resume from an older "
                f"checkpoint"]

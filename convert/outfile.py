"""Where a converter's GGUF goes, checked before anything is written.

The file is written as `<target>.partial` and renamed over `<target>` when whole. So that the rename can never
destroy something the user did not mean to replace, the path is checked first: a symlink is written through
(its target is replaced, the link stays), an existing destination must be a regular file (a device, a FIFO or a
socket is refused, never renamed over), its folder must exist, and it must not be one of the files the
conversion reads (a shard, the index, config.json, the tokenizer files ...).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterable

import gguf

from pydflash.errors import ConversionError

# suffixes of the files a conversion reads from a checkpoint folder (weights, configs, tokenizer, model card,
# chat template, sentencepiece model)
_INPUT_SUFFIXES = (".safetensors", ".json", ".txt", ".jinja", ".md", ".model")


def checkpoint_inputs(folder: Path | None) -> list[Path]:
    """The files of a checkpoint folder a conversion may read, with those of its sub-folders (sentence-transformers
    keeps its pooling config in one)."""
    if folder is None:
        return []
    found: list[Path] = []
    try:
        for p in Path(folder).iterdir():
            if p.is_file() and p.suffix in _INPUT_SUFFIXES:
                found.append(p)
            elif p.is_dir():
                found.extend(q for q in p.iterdir() if q.is_file() and q.suffix == ".json")
    except OSError:
        pass  # an unreadable folder fails later with its own error; there is nothing here to protect
    return found


def output_path(given: str | Path | None, model_dir: Path, default_name: str, ftype: str) -> Path:
    """The GGUF path meant by --outfile `given` (llama.cpp's rules): a folder gets `default_name` inside it, '{ftype}'
    in a file name is filled in, None writes into the checkpoint folder."""
    raw = os.fspath(given) if given is not None else os.fspath(model_dir)
    out = Path(raw)
    if out.is_dir():
        return out / default_name
    # Path() drops a trailing separator: without this check 'newdir/' would silently become a file named 'newdir'
    if raw.endswith(os.sep) or (os.altsep is not None and raw.endswith(os.altsep)):
        raise ConversionError(f"--outfile {raw}: no such folder")
    return out.parent / gguf.fill_templated_filename(out.name, ftype)


def _stat(path: Path, shown: Path) -> os.stat_result | None:
    try:
        return os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ConversionError(f"{shown}: cannot check the output path: {e.strerror or e}") from e


def checked_target(out: Path, inputs: Iterable[Path] = ()) -> Path:
    """The file to write for the output path `out` (a symlink resolved to the file it points to), after the checks
    in the module docstring; every error names `out`, the path the user gave."""
    target = Path(os.path.realpath(out))
    parent = target.parent
    if not parent.exists():
        raise ConversionError(f"{out}: cannot write the GGUF there: folder {out.parent} does not exist")
    if not parent.is_dir():
        raise ConversionError(f"{out}: cannot write the GGUF there: {out.parent} is not a folder")
    st = _stat(target, out)
    if st is not None:
        if not stat.S_ISREG(st.st_mode):
            raise ConversionError(f"{out}: exists and is not a regular file; refusing to replace it with the GGUF")
        for p in inputs:
            try:
                same = os.path.samefile(p, target)
            except OSError:
                continue
            if same:
                raise ConversionError(f"{out}: is {p}, an input of the conversion; refusing to overwrite it "
                                      "(choose another --outfile)")
    partial = target.with_name(target.name + ".partial")
    if (pst := _stat(partial, out)) is not None and not stat.S_ISREG(pst.st_mode):
        raise ConversionError(f"{out}: the temporary file {partial} exists and is not a regular file; "
                              "refusing to write through it")
    return target

"""Copies of GGUF files with metadata or tensors changed, for the bad-input tests and the fuzzer."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np


def rewrite(src, dst, *, drop_keys=(), set_keys=None, drop_tensors=(), reshape=None, arch=None,
            add_tensors=None) -> Path:
    """Copy the GGUF `src` to `dst` with keys dropped or set, tensors dropped or cut to a new shape, or added
    (add_tensors: {name: f32 numpy array in numpy's order, i.e. ggml's shape reversed}, after the others).

    set_keys: {name: (value, type)} or {name: (value, ARRAY, element type)}; a STRING value may be bytes (kept
    as they are, valid UTF-8 or not). arch (str or bytes) replaces general.architecture; keys keep their names.
    """
    reader = gguf.GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dst, old_arch)
    if arch is not None:
        writer.kv_data[0]["general.architecture"] = gguf.GGUFValue(arch, gguf.GGUFValueType.STRING)
    set_keys = dict(set_keys or {})
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop_keys or name in set_keys:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, f.contents(), vtype, sub_type=sub)
    for name, (value, vtype, *sub) in set_keys.items():
        writer.add_key_value(name, value, vtype, sub_type=sub[0] if sub else None)
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        data = np.array(t.data)
        if reshape and t.name in reshape:
            data = data.reshape(-1)[: int(np.prod(reshape[t.name]))].reshape(reshape[t.name])
        writer.add_tensor(t.name, data, raw_dtype=t.tensor_type)
    for name, data in (add_tensors or {}).items():
        writer.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return Path(dst)


def scrambled(src, dst, tensor: str, seed: int = 0) -> Path:
    """A copy of the GGUF `src` whose `tensor` (2-D) is random: a drafter or head whose drafts are not accepted."""
    shape = next(t.shape for t in gguf.GGUFReader(src).tensors if t.name == tensor)
    noise = np.random.default_rng(seed).normal(0.0, 0.5, (int(shape[1]), int(shape[0])))
    return rewrite(src, dst, drop_tensors=[tensor], add_tensors={tensor: noise})


def patch_tensor_info(src, dst, name: str, *, ggml_type: int | None = None, dim: tuple[int, int] | None = None) -> Path:
    """Copy `src` to `dst` with tensor `name`'s info changed in place (its type id, or dim = (i, ne[i])); the
    tensor data stays as it was, so the file says one thing and holds another."""
    reader = gguf.GGUFReader(src)
    t = next(t for t in reader.tensors if t.name == name)
    # the info's parts: name length, name, n_dims, dims (u64 each), type (u32), data offset
    sizes = [p.nbytes for p in t.field.parts]
    at = [t.field.offset + sum(sizes[:i]) for i in range(len(sizes))]
    buf = bytearray(Path(src).read_bytes())
    if dim is not None:
        struct.pack_into("<Q", buf, at[3] + 8 * dim[0], dim[1])
    if ggml_type is not None:
        struct.pack_into("<I", buf, at[4], ggml_type)
    Path(dst).write_bytes(bytes(buf))
    return Path(dst)


def dflash_to_dflash2(src, dst, *, kernel: int = 4, group: int = 16, rank: int = 8, top_k: int = 8,
                      noise: float = 0.0, seed: int = 0) -> Path:
    """A DFlash2 drafter made from the DFlash drafter `src`: each added convolution is the identity (a base tap of 1
    on the row itself, every other tap and the dynamic projection 0) and the selector's codebooks are 0, so it
    drafts as `src` does; noise > 0 adds N(0, noise) to all of them, so that the convolutions and the selector
    change the drafts while the trained drafter still drafts well."""
    reader = gguf.GGUFReader(src)
    E = int(reader.fields["dflash.embedding_length"].contents())
    n_layer = int(reader.fields["dflash.block_count"].contents())
    V = _target_vocab(reader)
    rng = np.random.default_rng(seed)

    def noisy(shape, base=None):
        a = np.zeros(shape, dtype=np.float32) if base is None else base
        return a + (noise * rng.standard_normal(shape).astype(np.float32) if noise else 0)

    identity = np.zeros((2, kernel, E), dtype=np.float32)
    identity[:, 0, :] = 1.0
    tensors = {}
    for il in range(n_layer):
        for side in ("attn", "ffn"):
            tensors[f"blk.{il}.{side}_conv_base"] = noisy((2, kernel, E), identity.copy())
            tensors[f"blk.{il}.{side}_conv_proj.weight"] = noisy((2 * kernel * (E // group), E))
    tensors["selector_predecessor.weight"] = noisy((V, rank))
    tensors["selector_successor.weight"] = noisy((V, rank))
    tensors["selector_hidden.weight"] = noisy((rank, E))
    U32 = gguf.GGUFValueType.UINT32
    return rewrite(src, dst, add_tensors=tensors, set_keys={
        "dflash.conv_kernel_size": (kernel, U32), "dflash.conv_group_size": (group, U32),
        "dflash.selector_rank": (rank, U32), "dflash.selector_top_k": (top_k, U32)})


def _target_vocab(reader) -> int:
    """The vocabulary a drafter's tokenizer lists (the target's)."""
    return len(reader.fields["tokenizer.ggml.tokens"].contents())

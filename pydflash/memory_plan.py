"""Memory plans: what a configuration of target, drafter and session needs on each device, before anything is
loaded.

A plan builds the model, a session and the drafter exactly as `Model(...)` does, from the GGUFs' metadata alone
(their tensor data may be absent), in buffers that reserve address space only (csrc/core/planned_buffer.h). So
the weights, KV cache, recurrent state, feature ring and the drafter's window are the sizes the same code
allocates, in the buffer types a load would use (the CPU's repacking types included), and the compute buffers
are ggml's graph allocator measuring the largest graphs the configuration runs (a prefill micro-batch, the
widest verify, chain and tree, and the drafter's round) over the whole context. Layers placed on a GPU this
machine lacks are sized by CUDA's rules (128-byte alignment, quantized matrices padded by up to 512 elements of
one row); their compute buffer is measured with the CPU's allocator over the same graph and counted on the GPU.

    from pydflash import plan
    p = plan("Qwen3.5-27B-Q4_K_M.gguf", "dflash.gguf", n_ctx=131072, kv_type="q4_0", n_gpu_layers=-1,
             spec_mode="tree", tree_budget=22, vram="22GiB")
    print(p.table()); p.fits; p.as_dict()
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from . import _core, rpc
from ._arguments import choice_arg, int_arg, optional_int_arg, proportions_arg
from .errors import ModelLoadError

__all__ = ["plan", "MemoryPlan", "parse_bytes", "engine_options", "engine_config", "by_category"]

KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl")
SPEC_MODES = ("auto", "tree", "chain")
DELTA_NET_FORMS = ("auto", "fused", "chunked")
# the engine's bounds (decode/engine_params.h): the largest context, drafted block and tree budget (draft nodes
# one verify may hold)
MAX_CTX, MAX_BLOCK_SIZE, MAX_TREE_BUDGET = _core.MAX_CTX, _core.MAX_BLOCK_SIZE, _core.MAX_TREE_BUDGET
# what a plan counts, per device
CATEGORIES = ("weights", "kv", "recurrent", "ring", "draft", "compute")
# A GPU backend's own memory, which none of those holds: a CUDA context with lazy module loading (the default from
# CUDA 12.2 on Linux; measured: 527 MiB of an H200 in use once ggml's CUDA backend had started, CUDA 13.0, driver
# 580, before any buffer; PyTorch measured 287 MB on smaller cards, pytorch/pytorch#86509) and cuBLAS's workspace
# (32 MiB on Hopper). A plan counts the measured one against a GPU budget given as vram=, the card's size; the
# free memory measured on this machine is what is left after this process's context already exists.
GPU_BACKEND_OVERHEAD = 560 * 2**20


PROPOSERS = ("dflash", "ngram", "mtp")


def proposers_arg(proposers, draft_model_path) -> tuple[str, ...] | None:
    """What drafts each round: `proposers` checked: ("dflash",), ("ngram",), ("mtp",) (the target's own MTP head),
    or two or all three of them (their candidates merged into one tree; auto mode). None: the DFlash drafter when
    draft_model_path is given, else None (the engine's default: the MTP head where the target file has one, else
    plain decoding)."""
    if proposers is None:
        return ("dflash",) if draft_model_path is not None else None
    if isinstance(proposers, str) or not isinstance(proposers, (list, tuple)):
        raise TypeError(f"proposers must be a tuple of names such as ('ngram',), got {type(proposers).__name__} "
                        f"{proposers!r}")
    for name in proposers:
        choice_arg("proposers entry", name, PROPOSERS)
    chosen = tuple(p for p in PROPOSERS if p in proposers)
    if "dflash" in chosen and draft_model_path is None:
        raise ValueError(f"proposers={chosen!r} needs a DFlash drafter: draft_model_path")
    if chosen and "dflash" not in chosen and draft_model_path is not None:
        how = {("ngram",): "by n-gram lookup", ("mtp",): "with the model's own MTP head"}.get(
            chosen, "with the model's own MTP head and n-gram lookup")
        raise ValueError(f"proposers={chosen!r} drafts {how}, without the drafter {draft_model_path}: give one or "
                         f"the other")
    return chosen


def context_size(n_ctx, model_path):
    """n_ctx as given, or for 0 (llama.cpp's -c 0, llama-cpp-python's n_ctx=0: "from the model") the context the
    model was trained for (its GGUF's context_length, at most MAX_CTX)."""
    if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and n_ctx <= 0:
        if n_ctx < 0:
            raise ValueError(f"n_ctx = {n_ctx}, expected 0 (the model's trained context) or a value in [1, {MAX_CTX}]")
        path, _ = checked_paths(model_path, None)
        return min(_core.Model(path, plan_only=True).n_ctx_train, MAX_CTX)
    return n_ctx


def engine_options(*, n_ctx, kv_type, n_gpu_layers, n_cpu_moe, n_ubatch, spec_mode, block_size, tree_budget,
                   draft_window, delta_net, tensor_split=None, proposers=()) -> dict:
    """The engine's options as `Model(...)` and `plan(...)` take them, each checked once, here (a TypeError or
    ValueError naming it); n_ubatch "auto" is 0 (the engine sizes for the largest micro-batch it may choose)."""
    return dict(n_ctx=int_arg("n_ctx", n_ctx, 1, MAX_CTX), kv_type=choice_arg("kv_type", kv_type, KV_TYPES),
                n_gpu_layers=int_arg("n_gpu_layers", n_gpu_layers, -1),
                n_cpu_moe=int_arg("n_cpu_moe", n_cpu_moe, -1),
                tensor_split=proportions_arg("tensor_split", tensor_split),
                n_ubatch=0 if n_ubatch == "auto" else int_arg("n_ubatch", n_ubatch, 1, MAX_CTX),
                spec_mode=choice_arg("spec_mode", spec_mode, SPEC_MODES),
                block_size=optional_int_arg("block_size", block_size, 2, MAX_BLOCK_SIZE),
                tree_budget=optional_int_arg("tree_budget", tree_budget, 1, MAX_TREE_BUDGET),
                draft_window=int_arg("draft_window", draft_window, 1),
                delta_net=choice_arg("delta_net", delta_net, DELTA_NET_FORMS),
                proposers=None if proposers is None else tuple(proposers))


@dataclass(frozen=True)
class EngineConfig:
    """What the engine resolves from a Model's options (decode/engine_params.h): the session's arguments, the
    drafter's (None without one), the tree budget and block, and (n_ubatch "auto") the micro-batches to time.
    `Model(...)` and `plan(...)` both take it from engine_config, so a plan is of the session a load opens."""

    session: dict
    draft: dict | None
    tree_budget: int | None
    block: int | None
    ubatch_candidates: tuple[int, ...] = ()
    ngram: dict | None = None  # NgramDrafter's arguments ("ngram" among the proposers)
    mtp: dict | None = None  # MtpDrafter's arguments (the target's MTP head drafts)


def engine_config(core_model, core_draft, options: dict) -> EngineConfig:
    """The engine's parameters for a target (`_core.Model`) and drafter (`_core.DraftModel` or None) from the
    options engine_options checked."""
    proposers = options["proposers"]
    p = _core.engine_params(core_model, core_draft, n_ctx=options["n_ctx"], kv_type=options["kv_type"],
                            n_ubatch=options["n_ubatch"], block_size=options["block_size"] or 0,
                            tree_budget=options["tree_budget"] or 0, draft_window=options["draft_window"],
                            spec_mode=options["spec_mode"], ngram="ngram" in (proposers or ()),
                            mtp="if_present" if proposers is None else "on" if "mtp" in proposers else "off")
    return EngineConfig(p["session"], p["draft"], p["tree_budget"], p["block"], tuple(p["ubatch_candidates"]),
                        p["ngram"], p["mtp"])


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value, name: str = "vram") -> int:
    """Bytes from an int or a string such as '24GiB', '22.5 GB', '8000MiB' (GiB/MiB: powers of 2; GB/MB: of 10)."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a byte count or a string such as '24GiB', got bool")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"{name} = {value}, expected a positive byte count")
        return value
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a byte count or a string such as '24GiB', got {type(value).__name__}")
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name} = {value!r}: expected a size such as '24GiB', '22.5GB' or '8000MiB'")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"{name} = {value!r}, expected a positive size")
    return n


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass
class MemoryPlan:
    """Bytes per category and device ('cpu', 'gpu'), the budgets they were checked against and the verdict.
    `fits` is None when a device holds bytes but has no known budget (a GPU plan without vram= on a machine
    without that GPU). `suggestions`: what would fit instead, when it does not (largest n_ctx, kv_type,
    n_gpu_layers, tree_budget; each one change alone, searched on the whole context's graphs, n_ctx confirmed
    with the windows' sweep)."""

    config: dict
    bytes: dict  # category -> {"cpu": n, "gpu": n}
    budget: dict  # device -> bytes available (None: unknown)
    graphs: dict = field(default_factory=dict)  # graph -> compute bytes measured
    suggestions: dict = field(default_factory=dict)
    experts: dict = field(default_factory=lambda: {"cpu": 0, "gpu": 0})  # the MoE experts' part of the weights
    # with largest=True: the largest n_ctx and (hybrid drafter trees) tree_budget that still fit, each alone
    largest: dict = field(default_factory=dict)

    def total(self, device: str | None = None) -> int:
        devices = (device,) if device else ("cpu", "gpu")
        return sum(self.bytes[c][d] for c in CATEGORIES for d in devices)

    def overhead(self, device: str) -> int:
        """The backend's own bytes on `device` that the budget must also hold (GPU_BACKEND_OVERHEAD where the GPU
        holds anything and its budget was given), besides total(device)."""
        return self.budget.get(f"{device}_overhead", 0) if self.total(device) else 0

    def needed(self, device: str) -> int:
        return self.total(device) + self.overhead(device)

    @property
    def fits(self) -> bool | None:
        unknown = False
        for d in ("cpu", "gpu"):
            if self.total(d) == 0:
                continue
            if self.budget.get(d) is None:
                unknown = True
            elif self.needed(d) > self.budget[d]:
                return False
        return None if unknown else True

    def shortfall(self) -> dict:
        """device -> bytes missing (only devices that are short)."""
        return {d: self.needed(d) - self.budget[d] for d in ("cpu", "gpu")
                if self.budget.get(d) is not None and self.needed(d) > self.budget[d]}

    def as_dict(self) -> dict:
        out = {f"{c}_bytes": self.bytes[c]["cpu"] + self.bytes[c]["gpu"] for c in CATEGORIES}
        out["total_bytes"] = self.total()
        out["devices"] = {d: {**{f"{c}_bytes": self.bytes[c][d] for c in CATEGORIES},
                              "expert_bytes": self.experts[d], "total_bytes": self.total(d),
                              "backend_overhead_bytes": self.overhead(d), "budget_bytes": self.budget.get(d)}
                          for d in ("cpu", "gpu") if self.total(d) or d == "cpu"}
        out["fits"] = self.fits
        out["config"] = dict(self.config)
        out["compute_graphs"] = dict(self.graphs)
        if self.suggestions:
            out["suggestions"] = dict(self.suggestions)
        if self.largest:
            out["largest"] = dict(self.largest)
        return out

    def table(self) -> str:
        devices = [d for d in ("cpu", "gpu") if self.total(d) or d == "cpu"]
        lines = [f"{'':12}" + "".join(f"{d.upper():>14}" for d in devices)]
        for c in CATEGORIES:
            lines.append(f"{c:12}" + "".join(f"{_gib(self.bytes[c][d]):>14}" for d in devices))
            if c == "weights" and any(self.experts.values()):
                lines.append(f"{'  experts':12}" + "".join(f"{_gib(self.experts[d]):>14}" for d in devices))
        lines.append(f"{'total':12}" + "".join(f"{_gib(self.total(d)):>14}" for d in devices))
        if any(self.overhead(d) for d in devices):
            lines.append(f"{'+ backend':12}" + "".join(f"{_gib(self.overhead(d)):>14}" for d in devices))
        lines.append(f"{'budget':12}" + "".join(
            f"{(_gib(self.budget[d]) if self.budget.get(d) is not None else 'unknown'):>14}" for d in devices))
        verdict = {True: "fits", False: "does NOT fit", None: "unknown (no budget for a device: pass vram=)"}
        lines.append(f"verdict: {verdict[self.fits]}")
        for d, n in self.shortfall().items():
            lines.append(f"  {d.upper()} short by {_gib(n)}")
        for k, v in self.suggestions.items():
            lines.append(f"  would fit: {k} = {v}")
        for k, v in self.largest.items():
            lines.append(f"  largest that fits: {k} = {v}")
        return "\n".join(lines)


def _verify_shapes(core_model, session, draft_session, cfg: EngineConfig, spec_mode: str) -> list[tuple[int, list]]:
    """The widest verify this configuration runs, (width, []), and on a hybrid target's trees the deepest and the
    widest tree of that width, (width, nodes per depth); none without a proposer."""
    if draft_session is None and cfg.ngram is None and cfg.mtp is None:
        return []
    width = cfg.block if spec_mode == "chain" else 1 + cfg.tree_budget
    # a verify never holds more than the ring's rows, the context, or (hybrid) the states kept
    ring_rows = draft_session.ring_capacity if draft_session is not None else width
    width = min(width, ring_rows, cfg.session["n_ctx"], session.n_rollback if core_model.is_recurrent else width)
    shapes = [(width, [])]
    if spec_mode != "chain" and core_model.is_recurrent and width >= 3:
        # a hybrid target runs trees depth by depth: the deepest tree and the widest (all nodes at depth 1)
        shapes += [(width, levels) for levels in (_tree_levels(width, cfg.block), [1, width - 1])]
    return shapes


def _measure_batch(core_model, session, draft_session, mtp, cfg: EngineConfig, spec_mode: str, n: int) -> dict:
    """Compute bytes of the graphs of the Model's batcher (state/eval_batcher.h) with n sessions generating at once
    (`pydflash serve --parallel n`), over the whole context: a step holds every decoding session's part (at most
    the widest verify, or one token) and prompt micro-batches up to two (eval_batcher::next_step), so each mix of
    0, 1 or 2 micro-batches and verifies; the drafter's, every session's block in one graph; and the MTP head's,
    every session's step in one graph."""
    n_ubatch = cfg.session["n_ubatch"]
    shapes = _verify_shapes(core_model, session, draft_session, cfg, spec_mode) or [(1, [])]
    graphs = {}
    for prompts in range(min(2, n) + 1):
        for width, levels in shapes:
            label = f"batch: {prompts} x prefill {n_ubatch} + {n - prompts} x " + \
                (f"tree {width} over {len(levels)} depths" if levels else f"verify {width}")
            graphs[label] = session.measure_batch(prompts, n - prompts, n_ubatch=n_ubatch, width=width,
                                                  tree_levels=levels, draft=draft_session)
    if draft_session is not None:
        graphs[f"draft batch: {n} blocks"] = max(
            draft_session.measure_batch(n, rows, draft_session.block_size, draft_session.n_slots)
            for rows in draft_session.append_row_counts)
    if mtp is not None:
        graphs[f"mtp batch: {n} steps"] = mtp.measure_batch(n, cfg.session["n_ctx"])
    return graphs


def by_category(core_model, session, core_draft, draft_session, compute: dict, mtp=None, sessions: int = 1) -> dict:
    """{category: {"cpu": bytes, "gpu": bytes}} from the buffers of a target (`_core.Model`), its `_core.Session`,
    the drafter (`_core.DraftModel`, `_core.DraftSession`, or None) and the target's MTP head (`_core.MtpDrafter`
    or None: its cache counts as the draft's, its trunk-state ring as the ring); `compute` as given (a plan
    measures it, a load reports what it allocated). What `MemoryPlan.bytes` and `Model.memory()` hold. sessions:
    how many sessions of this configuration (`pydflash serve --parallel`): each has caches, rings and a recurrent
    state of its own over the one copy of the weights."""

    def add(*pairs, times: int = 1) -> dict:
        return {"cpu": times * sum(p[0] for p in pairs), "gpu": times * sum(p[1] for p in pairs)}

    ring = ([draft_session.ring_memory] if draft_session is not None else []) + ([mtp.ring_memory] if mtp else [])
    caches = add(*([draft_session.kv_memory] if draft_session is not None else []) +
                 ([mtp.kv_memory] if mtp else []), times=sessions)
    weights = add(core_draft.weight_memory) if draft_session is not None else add()
    return {"weights": add(core_model.weight_memory), "kv": add(session.kv_memory, times=sessions),
            "recurrent": add(session.recurrent_memory, times=sessions), "ring": add(*ring, times=sessions),
            "draft": {d: weights[d] + caches[d] for d in ("cpu", "gpu")}, "compute": compute}


def _tree_levels(width: int, block: int) -> list[int]:
    """Nodes per depth of the deepest tree of `width` nodes a verify runs: a spine as deep as a block allows,
    the other nodes siblings along it (the shape auto calibrates with; most depths, so the most levels)."""
    spine = min(width - 2, block - 1)
    depth = []
    for i in range(width):
        parent = i - 1 if i <= spine else (i - spine - 1) % spine
        depth.append(0 if parent < 0 else depth[parent] + 1)
    return [depth.count(d) for d in range(max(depth) + 1)]


MAX_SWEPT_WINDOWS = 4096  # (262,144 tokens at the 64-slot step, the largest trained context of the targets here)


def _windows(n_tokens: int, n_ctx: int, step: int, sweep: bool) -> list[int]:
    """The attended windows an evaluation of n_tokens can run over: multiples of `step` from the first that
    holds it (of a wider stride where there would be more than MAX_SWEPT_WINDOWS), and n_ctx (sweep=False: n_ctx
    only)."""
    if not sweep:
        return [n_ctx]
    first = -(-n_tokens // step) * step
    # past MAX_SWEPT_WINDOWS of them, every k-th (a plan of 2**30 tokens swept 16 million windows, ~45 min)
    stride = step * max(1, -(-(n_ctx - first) // (step * MAX_SWEPT_WINDOWS)))
    return list(range(first, n_ctx, stride)) + [n_ctx]


def _measure(core_model, session, draft_session, cfg: EngineConfig, spec_mode: str, sweep: bool) -> dict:
    """Compute bytes of each graph kind this configuration runs, the largest over its windows, by name.
    ggml's allocator packs each window's graph differently (a wider window's need can be smaller), so every
    window the engine can build is measured (sweep=False: the whole context's only)."""
    n_ctx, step = cfg.session["n_ctx"], session.kv_window_step

    def target(n, **kw):
        return max(session.measure_eval(n, n_kv=w, draft=draft_session, **kw)
                   for w in _windows(n, n_ctx, step, sweep))

    graphs = {}
    n_ubatch = cfg.session["n_ubatch"]
    graphs[f"prefill {n_ubatch}"] = target(n_ubatch, whole=True, all_rows=False)
    for width, levels in _verify_shapes(core_model, session, draft_session, cfg, spec_mode):
        label = f"tree {width} over {len(levels)} depths" if levels else f"verify {width}"
        graphs[label] = target(width, tree_levels=levels)
    if draft_session is None:
        graphs["decode 1"] = target(1)
        return graphs
    # the drafter: rows appended alone, or before a block drafted over its window
    block, n_slots = draft_session.block_size, draft_session.n_slots
    graphs["draft round"] = max(
        [draft_session.measure_compute(rows, 0, 0) for rows in draft_session.append_row_counts] +
        [draft_session.measure_compute(rows, block, w) for rows in draft_session.append_row_counts
         for w in _windows(block, n_slots, draft_session.window_step, sweep)])
    return graphs


def plan(model_path, draft_model_path=None, *, n_ctx: int = 4096, kv_type: str = "f16", n_gpu_layers: int = 0,
         n_cpu_moe: int = 0, tensor_split=None, rpc_servers=None, n_ubatch: int | str = "auto", spec_mode: str = "auto",
         block_size: int | None = None, tree_budget: int | None = None, draft_window: int = 4096, vram=None, ram=None,
         suggest: bool = True, sweep: bool = True, delta_net: str = "auto", proposers=None,
         largest: bool = False, parallel: int = 1) -> MemoryPlan:
    """The memory plan of `Model(model_path, draft_model_path=..., ...)` with these arguments (the same names and
    defaults). vram / ram: the budgets to check against (bytes or '24GiB'); by default the GPU's free memory when
    this machine has the GPU, and the system's available memory. suggest: when it does not fit, also find the
    largest n_ctx, a kv_type, the n_gpu_layers and (hybrid targets) the tree_budget that would. sweep: measure
    each graph over every attended window the engine can build (ggml's allocator packs each differently; ~1-2 ms
    per graph for a 27B model, 2048 windows at 128K), else over the whole context only (a few percent of the
    compute buffer may be missed). largest: when it fits, also find the largest n_ctx (up to the model's trained
    context) and tree_budget (speculative trees) that would, each alone (plan.largest). parallel: sessions
    generating at once over the one copy of the weights (`pydflash serve --parallel`, llama-server's -np): each
    has its own caches, rings, recurrent state and compute buffers, and the Model's batcher (one evaluation per
    step over all of them) its own compute buffers, measured over its largest steps at the whole context."""
    paths = checked_paths(model_path, draft_model_path)
    rpc.add_servers(rpc_servers)  # the device its layers are placed on and whose memory is the budget
    args = engine_options(n_ctx=context_size(n_ctx, model_path), kv_type=kv_type, n_gpu_layers=n_gpu_layers,
                          n_cpu_moe=n_cpu_moe, tensor_split=tensor_split, n_ubatch=n_ubatch, spec_mode=spec_mode,
                          block_size=block_size, tree_budget=tree_budget, draft_window=draft_window,
                          delta_net=delta_net, proposers=proposers_arg(proposers, draft_model_path))
    args["parallel"] = int_arg("parallel", parallel, 1, 1024)
    return plan_checked(paths, args, device_budget(vram, ram), suggest=suggest, sweep=sweep, largest=largest)


def checked_paths(model_path, draft_model_path) -> tuple[str, str | None]:
    """The target's and the drafter's paths (None: no drafter) as str, each an existing file."""
    for name, path in (("model_path", model_path), ("draft_model_path", draft_model_path)):
        if (path is not None or name == "model_path") and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"{name} must be a str or os.PathLike, got {type(path).__name__}")
        if path is not None and not os.path.exists(path):
            raise ModelLoadError(f"{os.fspath(path)}: no such file")
    return os.fspath(model_path), None if draft_model_path is None else os.fspath(draft_model_path)


def device_budget(vram=None, ram=None) -> dict:
    """{"cpu": bytes, "gpu": bytes or None, "gpu_overhead": bytes}: the given budgets, by default the system's
    available memory and the GPU's free memory (None without a GPU); a given vram also holds the GPU backend's
    own memory (GPU_BACKEND_OVERHEAD), which the free memory measured here has already lost."""
    devices = _core.device_memory()
    return {"cpu": parse_bytes(ram, "ram") if ram is not None else devices["cpu_free"],
            "gpu": parse_bytes(vram, "vram") if vram is not None else devices.get("gpu_free"),
            "gpu_overhead": GPU_BACKEND_OVERHEAD if vram is not None else 0}


def plan_checked(paths: tuple[str, str | None], options: dict, budget: dict, *, suggest: bool = True,
                 sweep: bool = True, largest: bool = False) -> MemoryPlan:
    """plan() of paths and options already checked (checked_paths, engine_options), against `budget`."""
    result = _plan_once(paths, options, budget, sweep)
    if suggest and result.fits is False:
        result.suggestions = _suggest(paths, options, budget, result, sweep)
    if largest and result.fits is True:
        result.largest = _largest_that_fit(paths, options, budget, result)
    return result


def _largest_that_fit(paths, args: dict, budget: dict, fitting: MemoryPlan) -> dict:
    """The largest n_ctx (steps of 256, up to the trained context) and, where the plan verifies trees, the largest
    tree_budget that still fit, each changed alone; searched on the whole context's graphs."""
    def fits_with(**change) -> bool:
        return _plan_once(paths, {**args, **change}, budget, False).fits is True

    out = {}
    n_ctx_train = min(_core.Model(paths[0], plan_only=True).n_ctx_train, MAX_CTX)
    steps = _largest(args["n_ctx"] // 256, n_ctx_train // 256, lambda k: fits_with(n_ctx=256 * k))
    if steps:
        out["n_ctx"] = max(256 * steps, args["n_ctx"])
    budget_nodes = fitting.config["tree_budget"]
    if fitting.config["proposers"] and args["spec_mode"] != "chain" and budget_nodes:
        out["tree_budget"] = _largest(budget_nodes, MAX_TREE_BUDGET, lambda b: fits_with(tree_budget=b))
    return out


def plan_for_load(paths: tuple[str, str | None], options: dict, budget: dict) -> tuple[MemoryPlan, object, object]:
    """The plan a load checks before it reads any weight (the whole context's graphs only: sweep=False), with
    the plan's target and drafter (`_core.Model` made plan_only, `_core.DraftModel` or None). The load takes
    them over (their load_weights), so it builds its model once."""
    core_model, core_draft = _planned_models(paths, options)
    result = _plan_of(core_model, core_draft, paths, options, budget, sweep=False)
    if result.fits is False:
        result.suggestions = _suggest(paths, options, budget, result, sweep=False)
    return result, core_model, core_draft


def _planned_models(paths, args: dict) -> tuple:
    core_model = _core.Model(paths[0], n_gpu_layers=args["n_gpu_layers"], n_cpu_moe=args["n_cpu_moe"],
                             tensor_split=args["tensor_split"], n_threads=1, plan_only=True,
                             delta_net=args["delta_net"])
    return core_model, None if paths[1] is None else _core.DraftModel(core_model, paths[1])


def _plan_once(paths, args: dict, budget: dict, sweep: bool = True) -> MemoryPlan:
    return _plan_of(*_planned_models(paths, args), paths, args, budget, sweep)


def _plan_of(core_model, core_draft, paths, args: dict, budget: dict, sweep: bool) -> MemoryPlan:
    """The plan of the planned target and drafter: its session and the drafter's (gone when this returns) and
    the largest graphs they run."""
    cfg = engine_config(core_model, core_draft, args)
    session = _core.Session(core_model, **cfg.session)
    draft_session = None if core_draft is None else _core.DraftSession(session, core_draft, **cfg.draft)
    mtp = None if cfg.mtp is None else _core.MtpDrafter(session, **cfg.mtp)
    graphs = _measure(core_model, session, draft_session, cfg, args["spec_mode"], sweep)
    if mtp is not None:
        graphs["mtp round"] = max(mtp.measure_compute(w) for w in _windows(1, cfg.session["n_ctx"],
                                                                           mtp.window_step, sweep))
    if core_model.is_recurrent:
        graphs["state commit"] = session.measure_commit()
    n = args.get("parallel", 1)
    batch = _measure_batch(core_model, session, draft_session, mtp, cfg, args["spec_mode"], n) if n > 1 else {}
    # each session's target graphs share one compute buffer; the drafter's (or the MTP head's) and a hybrid's commit
    # graphs have one each: each the size of its largest graph; with sessions in parallel, the batcher's target,
    # drafter and MTP head graphs one each too
    own_buffers = ("draft round", "mtp round", "state commit")
    target_compute = max(v for k, v in graphs.items() if k not in own_buffers)
    compute = n * (target_compute + sum(graphs.get(k, 0) for k in own_buffers))
    compute += max((v for k, v in batch.items() if k.startswith("batch")), default=0)
    compute += max((v for k, v in batch.items() if k.startswith("draft batch")), default=0)
    compute += batch.get(f"mtp batch: {n} steps", 0)
    graphs.update(batch)
    # measured with the CPU's allocator; counted where the layers are
    on_gpu = core_model.n_gpu_layers > 0
    compute_bytes = {"cpu": 0 if on_gpu else compute, "gpu": compute if on_gpu else 0}
    config = dict(args, model_path=paths[0], draft_model_path=paths[1], n_ubatch=cfg.session["n_ubatch"],
                  n_rollback=cfg.session["n_rollback"], tree_budget=cfg.tree_budget, block_size=cfg.block,
                  n_layer=core_model.n_layer, parallel=n,
                  proposers=args["proposers"] or (("mtp",) if mtp and args["proposers"] is None else ()))
    cpu_experts, gpu_experts = core_model.expert_memory
    return MemoryPlan(config=config,
                      bytes=by_category(core_model, session, core_draft, draft_session, compute_bytes, mtp, n),
                      budget=dict(budget), graphs=graphs, experts={"cpu": cpu_experts, "gpu": gpu_experts})


def _largest(lo: int, hi: int, fits) -> int | None:
    """The largest n in [lo, hi] with fits(n) (fits is monotone: true up to some n), or None."""
    if not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _smallest(lo: int, hi: int, fits) -> int | None:
    """The smallest n in [lo, hi] with fits(n) (fits is monotone: false up to some n), or None."""
    if lo > hi or not fits(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _suggest(paths, args: dict, budget: dict, failed: MemoryPlan, sweep: bool) -> dict:
    # searched on the whole context's graphs (fast), the n_ctx found confirmed with the sweep
    def fits_with(sweep=False, **change) -> bool:
        return _plan_once(paths, {**args, **change}, budget, sweep).fits is not False

    def gpu_fits_with(**change) -> bool:  # monotone in n_gpu_layers, where fitting as a whole is not (the CPU)
        return "gpu" not in _plan_once(paths, {**args, **change}, budget, False).shortfall()

    def ctx(k: int) -> dict:
        return dict(n_ctx=256 * k)

    out = {}
    # n_ctx in steps of 256
    steps = _largest(1, args["n_ctx"] // 256, lambda k: fits_with(**ctx(k)))
    while sweep and steps and not fits_with(sweep=True, **ctx(steps)):
        steps -= 1
    if steps and 256 * steps < args["n_ctx"]:
        out["n_ctx"] = 256 * steps
    for kv in ("q8_0", "q4_0"):
        if KV_TYPES.index(kv) > KV_TYPES.index(args["kv_type"]) and fits_with(kv_type=kv):
            out["kv_type"] = kv
            break
    n_layer = failed.config["n_layer"]
    if args["n_gpu_layers"] != 0 and failed.shortfall().get("gpu"):
        asked = n_layer + 1 if args["n_gpu_layers"] < 0 else min(args["n_gpu_layers"], n_layer + 1)
        # the most layers the GPU holds, if the CPU then holds the rest
        layers = _largest(0, asked - 1, lambda n: gpu_fits_with(n_gpu_layers=n)) if asked > 0 else None
        if layers is not None and fits_with(n_gpu_layers=layers):
            out["n_gpu_layers"] = layers
        if any(failed.experts.values()) and args["n_cpu_moe"] >= 0:
            # a MoE target's experts in system memory, the rest of each layer on the GPU (llama.cpp's advice)
            kept = _smallest(args["n_cpu_moe"] + 1, n_layer, lambda n: fits_with(n_cpu_moe=n))
            if kept is not None:
                out["n_cpu_moe"] = kept
    if paths[1] is not None and args["spec_mode"] != "chain" and (failed.config["tree_budget"] or 0) > 1:
        budget_nodes = _largest(1, failed.config["tree_budget"] - 1, lambda b: fits_with(tree_budget=b))
        if budget_nodes is not None:
            out["tree_budget"] = budget_nodes
    return out

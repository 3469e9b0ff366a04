"""The model rows of `suite bench gpu`: SD-1.5's UNet, Gemini vs FSDP2 vs DDP, the AlphaFold model's chunking."""

from __future__ import annotations

import json
from typing import Any

from .gpu_stages import StageContext

__all__ = ["fold", "gemini", "sd"]

# ---- SD-1.5 ---------------------------------------------------------------------------------------------------

SD_TITLE = ("SD-1.5 UNet (859.5M, random weights), 512 px, random latents and text states (no VAE, CLIP): `suite "
            "bench diffusion --encoders none --mixed_precision bf16 --gemini_offload cpu`'s sides; "
            "peak = max_memory_allocated over warm-up and steps; step = median of synchronised steps; batches "
            "doubled until one does not fit")
DOUBLING = [1, 2, 4, 8, 16, 32, 64, 128]


def card(ctx: StageContext, cap: float | None) -> str:
    """How a row's card reads in the table."""
    if not cap:
        return f"whole {ctx.device}"
    return f"{cap:g} GiB (emulated)" if ctx.device == "cuda" else f"{cap:g} GiB (no cap on {ctx.device})"


def _sd_rows(ctx: StageContext, child, cap: float | None = None) -> list[dict]:
    return ctx.rec.take("sd", child, f"sd ({card(ctx, cap)})", {"card": card(ctx, cap)}, cap_gib=cap)


def _largest(rows: list[dict], variant: str, cap: float | None) -> int | None:
    ok = [r["batch"] for r in rows if r.get("outcome") == "ok" and r["variant"] == variant and r["cap_gib"] == cap]
    return max(ok) if ok else None


def sd(ctx: StageContext) -> None:
    """Batch 1 on both sides, whole card and 8 GiB, first; then the larger batches: the plain loop's batch is
    doubled until one does not fit, ours tries the plain loop's largest and then doubles on the 8 GiB card."""
    ctx.rec.table("sd", SD_TITLE)
    steps = {"steps": 1 if ctx.smoke else 3, "warmup": 1}
    if ctx.smoke:
        child = ctx.run_worker("sd", want=120, what="sd plain+ours", variants=["plain", "ours"], batches=[1, 2],
                               **steps)
        _sd_rows(ctx, child)
        _sd_targets(ctx)
        return
    rows = _sd_rows(ctx, ctx.run_worker("sd", want=35, reserve=60, what="sd plain", variants=["plain"],
                                        batches=DOUBLING, **steps))
    _sd_rows(ctx, ctx.run_worker("sd", want=30, reserve=35, what="sd ours", variants=["ours"], batches=[1], **steps))
    _sd_rows(ctx, ctx.run_worker("sd", want=25, reserve=12, what="sd ours 8 GiB", variants=["ours"], cap_gib=8,
                                 batches=DOUBLING, **steps), 8)
    _sd_rows(ctx, ctx.run_worker("sd", want=15, what="sd plain 8 GiB", variants=["plain"], cap_gib=8, batches=[1],
                                 **steps), 8)
    plain_max = _largest(rows, "plain", None)
    if plain_max and plain_max > 1:
        _sd_rows(ctx, ctx.run_worker("sd", want=60, what=f"sd ours at batch {plain_max}", variants=["ours"],
                                     batches=[plain_max, 2 * plain_max], **steps))
    _sd_targets(ctx)


def _sd_targets(ctx: StageContext) -> None:
    rows = [r for r in ctx.rec.rows("sd") if r.get("outcome") == "ok"]
    by = {(r["variant"], r["batch"]): r for r in rows if not r["cap_gib"]}
    pairs = sorted(b for v, b in by if v == "ours" and ("plain", b) in by)
    cuda = ctx.device == "cuda"
    if pairs:
        ratios = {b: by[("ours", b)]["peak_mib"] / by[("plain", b)]["peak_mib"] for b in pairs}
        speed = {b: by[("ours", b)]["images_per_s"] / by[("plain", b)]["images_per_s"] for b in pairs}
        measured = ", ".join(f"batch {b}: {ratios[b]:.3f} (images/s {speed[b]:.2f}x)" for b in pairs)
        ctx.rec.target("SD-1.5 512 px: ours' peak <= 1/5.6 (0.179) of the plain loop's at the same batch", measured,
                       all(v <= 1 / 5.6 for v in ratios.values()) if cuda else None)
    else:
        ctx.rec.target("SD-1.5 512 px: ours' peak <= 1/5.6 (0.179) of the plain loop's at the same batch",
                       "not measured (no batch ran on both sides)", None)
    capped = [r for r in ctx.rec.rows("sd") if r["cap_gib"]]
    ours8 = [r for r in capped if r["variant"] == "ours"]
    plain8 = [r for r in capped if r["variant"] == "plain"]
    largest = max((r["batch"] for r in ours8 if r.get("outcome") == "ok"), default=None)
    ctx.rec.target("SD-1.5 512 px trains in 8 GiB (ours)", "not measured" if not ours8 else (
        f"largest batch {largest}" if largest else f"no: {ours8[0].get('outcome')}"),
        (largest is not None) if cuda and ours8 else None)
    if plain8:
        ctx.rec.target("plain loop in 8 GiB (reported, no target)", str(plain8[0].get("outcome")), None)


# ---- Gemini ---------------------------------------------------------------------------------------------------


def _gemini_sizes(ctx: StageContext) -> dict[str, Any]:
    if ctx.smoke:  # DDP's row is the same code path: two ranks to spawn instead of three
        return {"params": "2M", "width": 256, "batch": 4, "steps": 1, "tier_params": "1M",
                "strategies": ("gemini", "fsdp2")}
    return {"params": "1B", "width": 4096, "batch": 16, "steps": 3, "tier_params": "2B",
            "strategies": ("gemini", "fsdp2", "ddp")}


def _gemini_run(ctx: StageContext, key: str, size: dict, want: float, reserve: float, *flags: str) -> list[dict]:
    """`suite bench gemini --ranks 1` of `size` and `flags` within the stage's time, its rows into table `key`."""
    path = ctx.work / f"{key}.json"
    limit = ctx.limit(want, reserve) or 15
    strategies = flags[flags.index("--strategies") + 1].split(",")
    argv = ctx.suite("bench", "gemini", "--ranks", "1", "--params", size["params"], "--width", str(size["width"]),
                     "--batch", str(size["batch"]), "--steps", str(size["steps"]), *flags,
                     "--timeout", str(max(5, int(limit / len(strategies)) - 3)), "--json", str(path))
    child = ctx.run(argv, want, reserve, what=f"{key}: {' '.join(flags)}")
    rows = []
    for row in json.loads(path.read_text())["rows"] if child and path.exists() else []:
        if "note" in row:
            ctx.rec.note(f"{key} {row['strategy']}: {row['note']}")
            continue
        rows.append(row)
        ctx.rec.add(key, {k: v for k, v in row.items() if not k.endswith("_vs_fsdp2")})
    if child is not None and not path.exists():
        ctx.rec.note(f"{key}: {child.outcome()}, no results written")
    return rows


def gemini(ctx: StageContext) -> None:
    """`suite bench gemini --ranks 1` at 1B parameters (Gemini, FSDP2, DDP, each in its own spawned rank with
    the bench's own per-run limit); a memory snapshot of Gemini's run when its peak is above FSDP2's; Gemini's CPU
    tier on a model whose states exceed 24 GiB."""
    rec, size = ctx.rec, _gemini_sizes(ctx)
    rec.table("gemini", f"suite bench gemini --ranks 1 --params {size['params']} --width {size['width']} --batch "
                        f"{size['batch']} --steps {size['steps']} (one device; fused Adam on every side, DDP "
                        "gradient_as_bucket_view; peak = max_memory_allocated over the steps on CUDA)")
    strategies = ",".join(size["strategies"])
    want, reserve = 40 * len(size["strategies"]), min(75.0, 0.4 * ctx.rec.left())  # the snapshot and the CPU tier
    results = {r["strategy"]: r for r in _gemini_run(ctx, "gemini", size, want, reserve, "--strategies", strategies)}
    _gemini_targets(ctx, results)
    g, f = results.get("gemini"), results.get("fsdp2")
    if g and f and (g["train_peak_MiB"] > f["train_peak_MiB"] or ctx.smoke):  # the smoke run goes through it
        rec.table("gemini_detail", "Gemini's run again, alone (torch.cuda.memory history recorded; snapshot for "
                                   "https://pytorch.org/memory_viz)")
        _gemini_run(ctx, "gemini_detail", size, 40, 35, "--strategies", "gemini", "--memory_snapshot",
                    str(ctx.out / "gemini_snapshot.pickle"))
    else:
        rec.note("no memory snapshot: " + ("Gemini's peak is not above FSDP2's" if g and f else
                                           "Gemini or FSDP2 did not run"))
    rec.table("gemini_tier", f"Gemini, master weights and Adam state in the CPU tier, {size['tier_params']} "
                             "parameters (fp32 Adam states 16 B/parameter) on an emulated 24 GiB card")
    rows = _gemini_run(ctx, "gemini_tier", {**size, "params": size["tier_params"], "steps": 1}, 90, 0,
                       "--strategies", "gemini", "--offload_tier", "cpu", "--cap_gib", "24")
    measured = (f"{rows[0]['states_GiB']:.1f} GiB of states, {rows[0]['samples_per_s']:.1f} samples/s, step "
                f"{rows[0]['step_s']:.2f} s" if rows else "not measured")
    ctx.rec.target("Gemini's CPU tier trains a model whose states do not fit a 24 GiB card (throughput reported)",
                   measured, (bool(rows) and rows[0]["states_GiB"] > 24) if ctx.device == "cuda" else None)


def _gemini_targets(ctx: StageContext, results: dict[str, dict]) -> None:
    cuda = ctx.device == "cuda"
    if "gemini" in results and "fsdp2" in results:
        g, f = results["gemini"], results["fsdp2"]
        peak, step = g["train_peak_MiB"] / f["train_peak_MiB"], g["step_s"] / f["step_s"]
        ctx.rec.target("Gemini vs FSDP2 on one device: peak <= 1.0x", f"{peak:.3f}", peak <= 1.0 if cuda else None)
        ctx.rec.target("Gemini vs FSDP2 on one device: step <= 1.1x", f"{step:.3f}", step <= 1.1 if cuda else None)
    else:
        ctx.rec.target("Gemini vs FSDP2 on one device: peak <= 1.0x, step <= 1.1x", "not measured", None)
    if "gemini" in results and "ddp" in results:
        d = results["ddp"]
        ctx.rec.target("Gemini vs DDP on one device (reported, no target)",
                       f"peak {results['gemini']['train_peak_MiB'] / d['train_peak_MiB']:.3f}, step "
                       f"{results['gemini']['step_s'] / d['step_s']:.3f}", None)


# ---- AlphaFold model ------------------------------------------------------------------------------------------


def _fold_plan(ctx: StageContext) -> list[tuple[int, str, float | None, int, int, float]]:
    """(n_res, chunks, emulated card GiB, warm-up passes, timed passes, seconds wanted), most important first."""
    if ctx.smoke:
        return [(16, "none", None, 0, 1, 60), (16, "auto", None, 0, 1, 60), (16, "4", None, 0, 1, 60),
                (24, "auto", 24, 0, 1, 60)]
    plan = [(512, "none", None, 1, 3, 15), (512, "auto", None, 1, 3, 15), (1024, "none", None, 1, 2, 25),
            (1024, "auto", None, 1, 2, 25), (2048, "auto", 24, 0, 1, 45), (512, "4", None, 1, 3, 25),
            (1024, "4", None, 1, 2, 40), (2048, "none", None, 0, 1, 30), (2048, "auto", None, 0, 1, 40),
            (3072, "auto", 24, 0, 1, 60), (2048, "4", None, 0, 1, 60), (4096, "auto", 24, 0, 1, 90)]
    return plan


def fold(ctx: StageContext) -> None:
    """`suite bench fold-model`'s one-pass child per (N_res, chunking): unchunked, `chunk_size=auto` with the
    device-aware budget, chunk 4; then the largest N_res that fits an emulated 24 GiB card with auto chunks (the
    first N_res that does not fit ends that search)."""
    small = ctx.smoke
    shape = ["--blocks", "1" if small else "4", "--extra_blocks", "1", "--n_seq", "4" if small else "128",
             "--n_extra", "8" if small else "256", "--dtype", "float32", "--device", ctx.device]
    ctx.rec.table("fold", f"AlphaFold2 pass, model_3_ptm's stack (released channel widths; no template stack), "
                          f"{shape[1]} Evoformer + 1 extra-MSA blocks, {shape[5]} MSA rows, {shape[7]} extra rows, "
                          "float32, no recycling; auto = fastfold's device-aware budget (a quarter of the free "
                          "device memory); peak = max_memory_allocated growth over the passes")
    runs = []
    for n, chunks, cap, warmup, repeat, want in _fold_plan(ctx):
        variant, size = ("unchunked", "auto") if chunks == "none" else ("chunked", chunks)
        argv = ["bench", "fold-model", "--_child", f"{n}:{variant}", *shape, "--chunk_size", size, "--warmup",
                str(warmup), "--repeat", str(repeat)]
        runs.append(((n, chunks, cap, want), {"argv": argv, "cap_gib": cap, "auto_budget": chunks == "auto"}))
    if small:  # one process for the tiny runs: interpreter starts would be most of the smoke run's time
        child = ctx.run_worker("suite", want=120, what="fold children", runs=[spec for _, spec in runs])
        parts: list[list[dict]] = []
        for row in child.json_lines() if child else []:
            if set(row) == {"run"}:
                parts.append([])
            elif parts:
                parts[-1].append(row)
        for ((n, chunks, cap, _), _), lines in zip(runs, parts):
            _fold_row(ctx, n, chunks, cap, lines, child.outcome())
        return _fold_targets(ctx)
    failed_capped = False
    for (n, chunks, cap, want), spec in runs:
        if cap and failed_capped:
            continue
        child = ctx.run_worker("suite", want=want, what=f"fold {n} {chunks} {card(ctx, cap)}", **spec)
        fitted = child and _fold_row(ctx, n, chunks, cap, child.json_lines(), child.outcome())
        failed_capped = failed_capped or bool(cap and fitted is False)
    _fold_targets(ctx)


def _fold_row(ctx: StageContext, n: int, chunks: str, cap: float | None, lines: list[dict], outcome: str) -> bool:
    """Record one pass from its child's JSON lines (`outcome`: the child's, where the pass left no result);
    whether it ran."""
    result = next((r for r in reversed(lines) if "n_res" in r), None)
    row = {"n_res": n, "chunks": chunks, "card": card(ctx, cap), "cap_gib": cap,
           "outcome": outcome if result is None else "ok"}
    if result is not None:
        row.update(seconds=result["seconds"], peak_mib=result["peak_bytes"] / 2**20)
    row.update({k: v for r in lines for k, v in r.items() if k == "memory_budget_mb"})
    ctx.rec.add("fold", row)
    return result is not None


def _fold_targets(ctx: StageContext) -> None:
    rows = [r for r in ctx.rec.rows("fold") if r["outcome"] == "ok"]
    full = {(r["n_res"], r["chunks"]): r for r in rows if not r["cap_gib"]}
    ratios = {n: full[(n, "auto")]["seconds"] / full[(n, "none")]["seconds"] for n, c in full
              if c == "auto" and (n, "none") in full}
    cuda = ctx.device == "cuda"
    ctx.rec.target("fold: auto chunks within 1.3x of unchunked time where unchunked fits",
                   ", ".join(f"{v:.2f} (N_res {n})" for n, v in sorted(ratios.items())) or "not measured",
                   all(v <= 1.3 for v in ratios.values()) if cuda and ratios else None)
    capped = [r["n_res"] for r in rows if r["cap_gib"]]
    target = 16 if ctx.smoke else 2048
    ctx.rec.target(f"fold: N_res {target} fits an emulated 24 GiB card with auto chunks",
                   f"largest that fit: {max(capped)}" if capped else "none fit (or not run)",
                   (max(capped, default=0) >= target) if cuda else None)

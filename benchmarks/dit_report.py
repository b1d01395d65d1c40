"""The markdown report of bench_dit_gpu.py: the result dict (machine, software, command, the
FLUX and GLM step tables, the served-shape sequence, end to end, notes) as the tables printed
and written to dit_gpu.md.
"""

from __future__ import annotations


# ---- report --------------------------------------------------------------------------------
def fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(result: dict) -> str:
    lines = [
        f"Machine: {result['machine']}; {result['software']}; command: `{result['command']}`",
        "",
    ]
    for key, title in (("flux", "FLUX.1-dev-size step"), ("glm", "GLM-Image DiT step, CFG")):
        sec = result.get(key)
        if not sec:
            continue
        info = sec["info"]
        lines += [
            f"{title}, {info['size']}x{info['size']}: "
            + ", ".join(
                f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items()
            ),
            "",
            "| variant | median ms | min ms | TFLOP/s | set-up s | first call s | 2nd call s "
            "| rel err vs bf16 eager | vs fp32 | peak GiB |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sec["rows"]:
            lines.append(
                f"| {r['variant']} | {r['median_ms']:.1f} | {r['min_ms']:.1f} | {r['tflops']:.0f} "
                f"| {r['setup_s']:.1f} | {r['first_call_s']:.1f} | {r['second_call_s']:.2f} "
                f"| {r['rel_err_vs_bf16_eager']:.1e} | {fmt(r['rel_err_vs_fp32'], '.1e')} "
                f"| {fmt(r['peak_gib'], '.1f')} |"
            )
        lines.append("")
    if result.get("served_sequence"):
        lines += [
            "Served-shape sequence (GLM DiT, regional compile), per call:",
            "",
            "| policy | request | step | batch | glyph len | call s | graphs compiled |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result["served_sequence"]:
            lines.append(
                f"| {r['policy']} | {r['request']} | {r['step']} | {r['batch']} | {r['glyph_len']} "
                f"| {r['call_s']:.3f} | {r['graphs_compiled']} |"
            )
        lines.append("")
    if result.get("end_to_end"):
        lines += [
            "End to end, FLUX.1-dev size:",
            "",
            "| system | warm-up (2 steps) s | per image s | pixel diff vs diffusers "
            "| pixel diff / SSIM vs ours bf16 | host syncs per step |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["end_to_end"]:
            per = ", ".join(
                f"{k.split('_')[0]} steps {v:.2f}"
                for k, v in r.items()
                if k.endswith("steps_s") and not k.startswith("warmup")
            )
            lines.append(
                f"| {r['system']} | {r['warmup_2_steps_s']:.1f} | {per} "
                f"| {fmt(r.get('mean_pixel_diff_vs_diffusers_eager'), '.2f')} "
                f"| {fmt(r.get('mean_pixel_diff_vs_ours_bf16'), '.2f')} / "
                f"{fmt(r.get('ssim_vs_ours_bf16'), '.4f')} "
                f"| {fmt(r.get('host_syncs_per_step'), '.2f')} |"
            )
        lines.append("")
    if result["notes"]:
        lines += ["Notes:", *[f"- {n}" for n in result["notes"]]]
    return "\n".join(lines)

"""docs/benchmarks.md's section of ``bench_steps_per_execution.py``, from the file it writes."""

from __future__ import annotations

from typing import Any

BACKENDS = ("torch", "jax")
HEADING = "## steps_per_execution: a Trainer against model.fit"
MODELS = {"small": "the small model", "convnet": "the guide's convnet"}


def section(document: dict[str, Any], source: str) -> str:
    """The page's section from ``document`` (what ``--output`` holds)."""
    lines = [
        HEADING,
        "",
        f"Written by `benchmarks/bench_steps_per_execution.py` into `{source}`. One device on each side (a",
        "Trainer of one replica against `model.fit`, the same work), at a global batch of "
        f"{document['setup']['global_batch_size']} (steps an epoch: {document['setup']['steps_per_epoch']}),",
        f"medians over interleaved rounds ({_rounds(document)}) of each run's median epoch after the first.",
        *_malloc(document),
        "Ratio: `model.fit`'s time per step over the Trainer's (at least 1: the Trainer is as fast or faster).",
        "",
        "| backend (Keras) | model | N | model.fit ms/step | Trainer ms/step | Trainer samples/s | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for backend in BACKENDS:
        if backend not in document:
            continue
        part = document[backend]
        label = f"{backend} ({part['keras']}; model.fit N: {part['keras_steps_per_execution']})"
        for key, measured in part["results"].items():
            name, size = key.split("/")
            ms = measured["ms_per_step"]
            lines.append(
                f"| {label} | {MODELS[name]} | {size} | {ms['keras']:.3f} | {ms['trainer']:.3f} | "
                f"{measured['samples_per_s']['trainer']:.0f} | {measured['median_ratio']:.2f}x |"
            )
    cores = ", ".join(
        f"{backend} {document[backend]['usable_cores_before']:.2f}" for backend in BACKENDS if backend in document
    )
    lines += [
        "",
        f"Usable cores of 2 before each backend's runs (`benchmarks/machine.py`): {cores}.",
        *_below_one(document),
        *_keras_slower_grouped(document),
        *_glibc_defaults(document),
    ]
    return "\n".join(lines) + "\n"


def _rounds(document: dict[str, Any]) -> str:
    return ", ".join(
        f"{backend} {document[backend]['rounds']} in {document[backend].get('processes', 1)} fresh process(es)"
        for backend in BACKENDS
        if backend in document
    )


def _malloc(document: dict[str, Any]) -> list[str]:
    settings = document["setup"].get("malloc")
    if not settings:
        return []
    pairs = " ".join(f"`{name}={value}`" for name, value in settings.items())
    return [f"Every run's process, both sides alike, holds glibc's malloc to {pairs} (below: why)."]


def _glibc_defaults(document: dict[str, Any]) -> list[str]:
    """Each backend's setting run again under glibc's defaults, against the same setting above."""

    def spread(values: list[float], digits: int) -> str:
        return f"{min(values):.{digits}f}-{max(values):.{digits}f}"

    lines = []
    for backend in BACKENDS:
        defaults = document.get(backend, {}).get("glibc_defaults")
        if defaults is None:
            continue
        setting = defaults["setting"]
        name, size = setting.split("/")
        held = document[backend]["results"][setting]
        lines.append(
            f"- glibc's defaults: {backend}, {MODELS[name]}, N={size}, run again in one more process of "
            f"{len(defaults['ratios'])} rounds with glibc's malloc as it comes: ms per step model.fit "
            f"{spread(defaults['rounds_ms_per_step']['keras'], 1)}, the Trainer "
            f"{spread(defaults['rounds_ms_per_step']['trainer'], 1)}, with "
            f"{spread(defaults['faults_per_step']['keras'] + defaults['faults_per_step']['trainer'], 0)} page faults "
            "a step (each a page the kernel zeroes: buffers glibc mapped on their own and gave back when freed), "
            f"ratios {', '.join(f'{ratio:.2f}' for ratio in defaults['ratios'])}; with the settings above the same "
            f"setting took {spread(held['rounds_ms_per_step']['keras'] + held['rounds_ms_per_step']['trainer'], 1)} "
            f"ms with at most {max(held['faults_per_step']['keras'] + held['faults_per_step']['trainer']):.0f} page "
            "faults a step."
        )
    return ["", *lines] if lines else []


def _keras_slower_grouped(document: dict[str, Any]) -> list[str]:
    """A line on each setting where ``model.fit`` itself is over twice as slow per step grouped as at N = 1:
    the ratio there is Keras's loop's, not the Trainer's gain."""
    lines = []
    for backend in BACKENDS:
        results = document.get(backend, {}).get("results", {})
        for key, measured in results.items():
            name, size = key.split("/")
            alone, grouped = results[f"{name}/1"]["ms_per_step"], measured["ms_per_step"]
            if size == "1" or grouped["keras"] < 2 * alone["keras"]:
                continue
            lines.append(
                f"- model.fit slower grouped: {backend}, {MODELS[name]}, N={size}: model.fit's time per step goes "
                f"from {alone['keras']:.3f} ms at N=1 to {grouped['keras']:.3f} (Keras's own loop, measured as it "
                f"is; the Trainer's from {alone['trainer']:.3f} to {grouped['trainer']:.3f}), so its "
                f"{measured['median_ratio']:.2f}x is not the Trainer's gain."
            )
    return ["", *lines] if lines else []


def _below_one(document: dict[str, Any]) -> list[str]:
    """A line on each setting below 1.0x, with what the same file says of it: whether N = 1 is below
    too (the Trainer's own work per step, which grouping does not remove)."""
    lines = []
    for backend in BACKENDS:
        results = document.get(backend, {}).get("results", {})
        for key, measured in results.items():
            name, size = key.split("/")
            if measured["median_ratio"] >= 1.0:
                continue
            alone = results[f"{name}/1"]
            rounds = ", ".join(f"{ratio:.2f}" for ratio in measured["ratios"])
            if size == "1":
                lines.append(
                    f"- Shortfall: {backend}, {MODELS[name]}, N=1: {measured['median_ratio']:.2f}x ({rounds}"
                    f"{_spread(measured['ratios'])})."
                )
                continue
            lines.append(
                f"- Shortfall: {backend}, {MODELS[name]}, N={size}: {measured['median_ratio']:.2f}x ({rounds}"
                f"{_spread(measured['ratios'])}). "
                f"At N=1 the same model is {alone['median_ratio']:.2f}x and the Trainer's time per step goes "
                f"from {alone['ms_per_step']['trainer']:.3f} to {measured['ms_per_step']['trainer']:.3f} ms "
                f"at N={size} "
                f"(model.fit's from {alone['ms_per_step']['keras']:.3f} to {measured['ms_per_step']['keras']:.3f})."
            )
    return ["", *lines] if lines else []


def _spread(ratios: list[float]) -> str:
    """Said when some round reached 1.0x: the median's shortfall is within the rounds' spread."""
    return "; some rounds at 1.0x or above: within the spread between rounds" if max(ratios) >= 1.0 else ""

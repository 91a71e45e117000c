"""What ptxas made of the CUDA C++ walks, on a machine without a GPU: registers, spills and wgmma
notes from NVRTC's ptxas (`--ptxas-options=-v`), and the SASS from cuobjdump (with nvdisasm), for
the prefill attention cubin (executor/numba_cuda/flash_wgmma.cu: attention_wgmma.source()) or the
wgmma experiments (bench/flash_wgmma.cu: `--source bench`).

For each kernel it prints the ptxas report and, from the SASS, its wgmma issue (HGMMA) and waits
(WARPGROUP.DEPBAR.LE gsb0, N) and the softmax's exponentials (MUFU.EX2) found between a "wait
until one group is left" and the next wait: where the warps work while a wgmma still runs
(`overlap_windows`). Session 33 found that ptxas moves a plain `wgmma.wait_group 0` written after
the softmax to before it (a WARPGROUP.DEPBAR reads no register, so nothing holds it back), which
the PTX does not show and only the SASS does; attention_wgmma.LOOKAHEAD_KERNEL pins its wait
(flash_wgmma.cu: wg_wait0_after), and tests/bench/test_sass.py checks it stays pinned.

Needs cuda-bindings with NVRTC (the `sass` extra: pip install -e '.[sass]', part of dev) and, for
the SASS, cuobjdump and nvdisasm (the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels, or a
CUDA toolkit on PATH). The `sass` extra pins NVRTC 13.0.88 (the GPU machine reports 13.0, and this
build reproduced its SASS): the GPU's own build (attention_wgmma.module) is the one that runs, and
ptxas versions differ. NVRTC 13.5's ptxas kept the lookahead walk's P V operands apart where 13.0's
merged them with the next P and serialized every wgmma (C7513; bench/RESULTS.md, session 35). The
table ends with the NVRTC that ran (`nvrtc_version`).

Usage: python -m bench.sass [--source attention|bench] [--kernels NAME,...] [--dump DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs

NOTE = re.compile(r"\(C7\d\d\d\)")
"""ptxas' numbered performance notes: C7513/C7514/C7518 wgmma serialized, C7517 a wait injected."""


@attrs.frozen
class KernelReport:
    """ptxas' `-v` lines for one entry function: registers a thread, stack frame and spill bytes
    a thread, and its numbered notes (wgmma serialized or a wait injected: NOTE)."""

    registers: int
    stack_bytes: int
    spill_stores: int
    spill_loads: int
    notes: tuple[str, ...]


def ptxas_report(log: str) -> dict[str, KernelReport]:
    """NVRTC's log (compiled with --ptxas-options=-v) -> {entry function: KernelReport}. A note names
    its function in the text (`... in the function 'name'`); the properties follow the line
    "Compiling entry function 'name'". A note that names no function goes to the entry "" (so a
    check that no entry has notes, or that the entries are these, sees it). Raises ValueError when
    an entry has no "Used N registers"."""
    entries: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        match = re.search(r"Compiling entry function '([^']+)'", line)
        if match:
            current = match.group(1)
            entries.setdefault(current, {"notes": []})
            continue
        if NOTE.search(line):
            match = re.search(r"function '([^']+)'", line)
            owner = match.group(1) if match else ""
            entries.setdefault(owner, {"notes": []})["notes"].append(line.split(":", 1)[-1].strip())
            continue
        if current is None:
            continue
        match = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if match:
            entries[current]["stack"], entries[current]["stores"], entries[current]["loads"] = map(int, match.groups())
        match = re.search(r"Used (\d+) registers", line)
        if match:
            entries[current]["registers"] = int(match.group(1))
    reports = {}
    for name, e in entries.items():
        if "registers" not in e:
            if name == "":
                reports[name] = KernelReport(0, 0, 0, 0, tuple(e["notes"]))
                continue
            raise ValueError(f"ptxas log: no 'Used N registers' for {name!r}")
        reports[name] = KernelReport(e["registers"], e.get("stack", 0), e.get("stores", 0), e.get("loads", 0),
                                     tuple(e["notes"]))
    return reports


def tool(name: str) -> str | None:
    """The path of CUDA tool `name` (cuobjdump, nvdisasm): on PATH, else in the nvidia-cuda-* wheels'
    nvidia/cu*/bin; None when neither has it."""
    found = shutil.which(name)
    if found:
        return found
    for entry in sys.path:  # every entry, not `nvidia.__path__`: a `pip install --target` folder on
        # PYTHONPATH holds a namespace part of `nvidia` that another site's regular package shadows
        for candidate in sorted(Path(entry or ".").glob(f"nvidia/cu*/bin/{name}"), reverse=True):
            if os.access(candidate, os.X_OK):
                return str(candidate)
    return None


def nvrtc_version() -> str:
    """The loaded NVRTC's "major.minor" (its ptxas is the one `build` runs)."""
    from cuda.bindings import nvrtc

    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


def sass_unavailable() -> str | None:
    """Why `sass` cannot run here (None when it can)."""
    missing = [n for n in ("cuobjdump", "nvdisasm") if tool(n) is None]
    if missing:
        return (f"{' and '.join(missing)} not found (pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm, "
                "or a CUDA toolkit on PATH)")
    return None


def sass(cubin: bytes, kernel: str) -> list[str]:
    """The SASS instructions of `kernel` in `cubin`, one string each without address or encoding
    ("HGMMA.64x32x16.F32.BF16 R24, R168, gdesc[UR4], RZ, !UPT ;"). Raises RuntimeError naming the
    tool that is missing or failed."""
    why = sass_unavailable()
    if why is not None:
        raise RuntimeError(why)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        env = dict(os.environ, PATH=f"{Path(tool('nvdisasm')).parent}{os.pathsep}{os.environ.get('PATH', '')}")
        done = subprocess.run([tool("cuobjdump"), "-sass", "-fun", kernel, str(path)], capture_output=True,
                              text=True, env=env)
    if done.returncode:
        raise RuntimeError(f"cuobjdump -sass -fun {kernel}: {done.stderr.strip()[-500:]}")
    out = []
    for line in done.stdout.splitlines():
        match = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?)\s*(?:/\*.*)?$", line)
        if match and match.group(1):
            out.append(re.sub(r"\s+", " ", match.group(1)))
    if not out:
        raise RuntimeError(f"cuobjdump found no SASS for {kernel!r}")
    return out


def overlap_windows(instructions: list[str]) -> list[int]:
    """For each `WARPGROUP.DEPBAR.LE gsb0, 0x1` (wait until one wgmma group is left in flight), the
    number of MUFU.EX2 (the softmax's 2^x) before the next WARPGROUP.DEPBAR: work the warps do while
    that group still runs. An empty list: no such wait (every wait drains the pipe)."""
    windows, count = [], None
    for ins in instructions:
        if ins.startswith("WARPGROUP.DEPBAR"):
            if count is not None:
                windows.append(count)
            count = 0 if "gsb0, 0x1" in ins else None
        elif count is not None and ins.startswith("MUFU.EX2"):
            count += 1
    if count is not None:
        windows.append(count)
    return windows


def hgmma_gaps(instructions: list[str], shape: str) -> list[int]:
    """The number of instructions between consecutive `HGMMA.<shape>` (e.g. "64x32x16", S = Q K^T
    of the 256-dim walks' 32-key blocks), in order: what a warpgroup issues between two of its
    products. The backend walk works each block's descriptors out once (`wg_desc_plus`), so
    between S's 16 products it only adds an offset and moves the descriptor to uniform registers
    (4 instructions; 7 when each was built from its address, session 36)."""
    at = [i for i, ins in enumerate(instructions) if ins.startswith(f"HGMMA.{shape}.")]
    return [b - a - 1 for a, b in zip(at, at[1:])]


STEPS = (("cp.async wait 1", "DEPBAR.LE SB0, 0x1"), ("proxy fence", "FENCE.VIEW.ASYNC"), ("barrier", "BAR.SYNC"),
         ("copy", "LDGSTS"), ("wgmma", "HGMMA"))
"""`loop_top`'s steps: (name, how its SASS instruction starts, after any predicate)."""


def loop_top(instructions: list[str]) -> list[str]:
    """The order of STEPS in a walk's loop, from its first wait for all but one cp.async group
    (DEPBAR.LE SB0, 0x1) to the first wgmma wait (WARPGROUP.DEPBAR) after it, each step named once
    where it first appears. The lookahead walk's: cp.async wait 1, proxy fence, barrier, wgmma, copy
    (block b's copies in, visible to the async proxy, every warpgroup past the barrier, S and P V
    issued, then the next copies under them). Empty when there is no such wait."""
    names = []
    started = False
    for ins in instructions:
        op = ins.split(" ", 1)[1] if ins.startswith("@") else ins
        if not started:
            started = op.startswith(STEPS[0][1])
            if started:
                names.append(STEPS[0][0])
            continue
        if op.startswith("WARPGROUP.DEPBAR"):
            break
        for name, prefix in STEPS[1:]:
            if op.startswith(prefix) and name not in names:
                names.append(name)
    return names


LOOKAHEAD_LOOP_TOP = ["cp.async wait 1", "proxy fence", "barrier", "wgmma", "copy"]
"""attention_wgmma.LOOKAHEAD_KERNEL's loop top (`loop_top`): block b's copies in, visible to wgmma,
every warpgroup past the barrier (done with the slots the next copies overwrite), S and P V issued,
then the next copies under them (tests/bench/test_sass.py on the CPU, test_gpu_flash_attention.py on
the GPU's own build)."""


def summary(instructions: list[str]) -> dict:
    """Counts in a kernel's SASS: HGMMA by shape, WARPGROUP.DEPBAR by level, spill traffic (STL,
    LDL), CTA barriers, and `overlap_windows`."""
    shapes: dict[str, int] = {}
    for ins in instructions:
        if ins.startswith("HGMMA."):
            shape = ins.split(".")[1]
            shapes[shape] = shapes.get(shape, 0) + 1
    waits = {}
    for ins in instructions:
        match = re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, (0x[0-9a-f]+)", ins)
        if match:
            waits[int(match.group(1), 16)] = waits.get(int(match.group(1), 16), 0) + 1
    return {"hgmma": shapes, "waits": waits, "stl": sum(i.startswith("STL") for i in instructions),
            "ldl": sum(i.startswith("LDL") for i in instructions),
            "bar_sync": sum(i.startswith("BAR.SYNC") for i in instructions),
            "overlap_windows": overlap_windows(instructions), "loop_top": loop_top(instructions)}


def build(which: str = "attention", replace: tuple[tuple[str, str], ...] = ()) -> tuple[bytes, str]:
    """(cubin, NVRTC log) of the attention walks (`which` "attention": attention_wgmma.source()) or
    the experiments ("bench": bench.flash_wgmma.source()) for sm_90a, each (text, replacement) of
    `replace` applied first (a planted change; ValueError when its text is not in the source).
    Raises RuntimeError from NVRTC (nvrtc.compile_cubin)."""
    from executor.numba_cuda import attention_wgmma
    from executor.numba_cuda.nvrtc import compile_cubin

    if which == "attention":
        text = attention_wgmma.source()
    elif which == "bench":
        from bench.flash_wgmma import source

        text = source()
    else:
        raise ValueError(f"source {which!r}: attention or bench")
    for old, new in replace:
        if old not in text:
            raise ValueError(f"planted change: {old!r} is not in the source")
        text = text.replace(old, new)
    return compile_cubin(text, "flash_wgmma.cu")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sass", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="attention", choices=("attention", "bench"),
                        help="the backend's walks (attention) or bench/flash_wgmma.cu's experiments (bench)")
    parser.add_argument("--kernels", default="", help="comma-separated entry functions (default: every one)")
    parser.add_argument("--dump", type=Path, default=None, metavar="DIR",
                        help="also write each kernel's SASS to DIR/<kernel>.sass")
    args = parser.parse_args(argv)
    try:
        cubin, log = build(args.source)
    except RuntimeError as exc:
        parser.error(str(exc))
    reports = ptxas_report(log)
    if not reports:  # seen once on the GPU machine (session 35, call A): a table with no rows
        parser.error(f"NVRTC {nvrtc_version()}'s log names no entry function (no ptxas -v lines): {log[:400]!r}")
    names = [k.strip() for k in args.kernels.split(",") if k.strip()] or sorted(reports)
    unknown = [n for n in names if n not in reports]
    if unknown:
        parser.error(f"--kernels: {unknown} not in the cubin ({', '.join(sorted(reports))})")
    why = sass_unavailable()
    print("| kernel | registers | spill stores / loads (bytes) | ptxas notes | HGMMA | waits (level: count) | "
          "STL / LDL | EX2 between wait 1 and the next wait | loop top |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        r = reports[name]
        cells = [name or "(no function named)", r.registers, f"{r.spill_stores} / {r.spill_loads}",
                 "; ".join(n[:100] for n in r.notes) or "-"]
        if why is None:
            ins = sass(cubin, name)
            s = summary(ins)
            if args.dump is not None:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{name}.sass").write_text("\n".join(ins) + "\n")
            cells += [", ".join(f"{k} x{v}" for k, v in sorted(s["hgmma"].items())),
                      ", ".join(f"{k}: {v}" for k, v in sorted(s["waits"].items())), f"{s['stl']} / {s['ldl']}",
                      ", ".join(map(str, s["overlap_windows"])) or "-", " > ".join(s["loop_top"]) or "-"]
        else:
            cells += ["-", "-", "-", "-", "-"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    print(f"\nNVRTC {nvrtc_version()}")
    if why is not None:
        print(f"\nno SASS: {why}")


if __name__ == "__main__":
    main()

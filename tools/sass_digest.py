"""The machine code of every kernel instance, as digests: proof without a GPU that a change to kernels/ leaves
what runs as it was.

    python tools/sass_digest.py [--arch sm_90a] --json FILE         # this checkout's instances
    python tools/sass_digest.py --compare BEFORE.json AFTER.json     # exit status 1 where an instance differs

Every instance the launcher can ask for on the architecture (`configs.all_name_expressions`, `align.KERNEL_NAMES`,
`layer.KERNEL_NAMES`) is compiled with NVRTC, one program per kernels/ file as the compile test does, and
disassembled with cuobjdump. Per instance: the SHA-1 of its SASS (every instruction with its encoding words, so
the scheduling control bits count too), its registers and its spills from the ptxas report. Two checkouts compare
by running the first form in each (PYTHONPATH=<checkout>) and then --compare. Identical SASS means identical
results and speed, so such a change needs no GPU run.

cuobjdump comes with the CUDA toolkit (Triton's wheel carries one too); CUOBJDUMP names it when it is not on PATH.
Needs CuPy with its NVRTC library; no GPU.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cupy_moe import _compile, align, configs, layer

_FUNCTION = re.compile(r"^\s*Function : (\S+)\s*$")
# one SASS line: /*0010*/  INSTRUCTION ;  /* 0x... */   and the second encoding word on a line of its own
_CODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s*(.*?)\s*;?\s*/\* (0x[0-9a-f]+) \*/")
_WORD = re.compile(r"^\s*/\* (0x[0-9a-f]+) \*/\s*$")


def instances(arch: str) -> dict[str, list[str]]:
    """{kernels/ file: the name expressions of its instances on `arch`}."""
    files = {f: configs.all_name_expressions(arch, f) for f in sorted(set(configs.KERNEL_FILES.values()))}
    files["moe_align.cu"] = list(align.KERNEL_NAMES)
    files["moe_layer.cu"] = list(layer.KERNEL_NAMES)
    return {f: names for f, names in files.items() if names}


def sass_by_function(cubin: bytes, cuobjdump: str) -> dict[str, str]:
    """{mangled name: its SASS, the instructions and encoding words without addresses}."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "-sass", f.name], check=True, capture_output=True, text=True).stdout
    out, current = {}, None
    for line in text.splitlines():
        if m := _FUNCTION.match(line):
            current = out.setdefault(m.group(1), [])
        elif current is not None and (m := _CODE.search(line)):
            current.append(f"{m.group(1)} {m.group(2)}")
        elif current is not None and (m := _WORD.match(line)):
            current.append(m.group(1))
    return {name: "\n".join(lines) for name, lines in out.items()}


def digest(arch: str, cuobjdump: str, log=print) -> dict[str, dict]:
    """{"file: name expression": {"sha1", "instructions", "registers", "spill_stores", "spill_loads", "stack"}}."""
    rows = {}
    for filename, names in instances(arch).items():
        cubin, lowered, ptxas = _compile.cubin_for_arch(filename, names, arch)
        sass = sass_by_function(cubin, cuobjdump)
        report = _compile.parse_ptxas_report(ptxas)
        for name in names:
            code = sass.get(lowered[name])
            if code is None:
                raise RuntimeError(f"{filename}: no SASS for {name} ({lowered[name]}) in cuobjdump's output")
            rows[f"{filename}: {name}"] = dict(sha1=hashlib.sha1(code.encode()).hexdigest(),
                                               instructions=sum(1 for line in code.splitlines() if " " in line),
                                               **report.get(lowered[name], {}))
        log(f"{filename}: {len(names)} instances for {arch}")
    return rows


def compare(before: dict, after: dict) -> int:
    """Print each instance that differs or exists in one table only; 1 if any does, else 0."""
    if before.get("arch") != after.get("arch"):
        print(f"arch: the two tables are for {before.get('arch')} and {after.get('arch')}")
        return 1
    a, b = before["instances"], after["instances"]
    differ = 0
    for key in sorted(a.keys() | b.keys()):
        if key not in a or key not in b:
            print(f"only {'after' if key in b else 'before'}: {key}")
            differ += 1
        elif a[key] != b[key]:
            changed = ", ".join(f"{k} {a[key].get(k)} -> {b[key].get(k)}" for k in sorted(a[key].keys() | b[key].keys())
                                if a[key].get(k) != b[key].get(k) and k != "sha1")
            print(f"differs: {key}: SASS {'differs' if a[key]['sha1'] != b[key]['sha1'] else 'same'}"
                  + (f"; {changed}" if changed else ""))
            differ += 1
    same = len(a.keys() & b.keys()) - sum(1 for k in a.keys() & b.keys() if a[k] != b[k])
    print(f"{same} of {len(a.keys() | b.keys())} instances identical for {before['arch']} (SASS with control bits, "
          f"registers, spills)")
    return 1 if differ else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90a", help="NVRTC target (default sm_90a, what an H100/H200 runs)")
    ap.add_argument("--json", help="write the digests here")
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="compare two --json files")
    args = ap.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        return compare(before, after)
    if not args.json:
        ap.error("--json: expected a file to write (or --compare BEFORE AFTER)")
    cuobjdump = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if not cuobjdump:
        ap.error("cuobjdump: not on PATH and CUOBJDUMP not set (it comes with the CUDA toolkit)")
    rows = digest(args.arch, cuobjdump, log=lambda s: print(s, file=sys.stderr))
    Path(args.json).write_text(json.dumps(dict(arch=args.arch, instances=rows), indent=1, sort_keys=True))
    print(f"wrote {len(rows)} instances for {args.arch} to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

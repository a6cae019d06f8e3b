# FlashAttention-4 on the GPU machine, which has no package registry.
#
# Unpacks the packages carried in .whl/ into /tmp/fa4site, checks every unpacked file against the
# sha256 its wheel's RECORD lists, and says whether `flash_attn.cute` imports. .whl/ holds wheels
# (*.whl) or wheels repacked file for file as <wheel name>.tar.xz (the set is over 64 MiB as
# wheels and under it as xz). The python3 that holds torch runs it: no pip, no unzip needed.
#
#   source bench/experiments/fa4_setup.sh    # exports PYTHONPATH for the rest of the command
#                                            # (not through a pipe: that sources it in a subshell)
#   bash bench/experiments/fa4_setup.sh      # prints the export line instead
#
# Exit status 0 when flash_attn.cute imports. FA4_WHEELS and FA4_SITE override the two folders.
#
# A set that imports and runs with torch 2.11 on an H200 (2026-11-28): flash-attn-4 4.0.0b16,
# nvidia-cutlass-dsl 4.5.2 with nvidia-cutlass-dsl-libs-base 4.5.2 (the CuTe DSL's Python sources;
# 74 MB as a wheel, 53 MB repacked as .tar.xz), quack-kernels 0.5.0, apache-tvm-ffi 0.1.15,
# torch-c-dlpack-ext 0.1.5, einops; the machine's own cuda-bindings. Later nvidia-cutlass-dsl
# releases (4.8.1) ship no `cutlass/cute` sources in any of their wheels. Over 64 MiB with the
# tree, the set travels in two calls: the .tar.xz in .whl first, then the rest in an ignored
# folder copied into .whl on the machine (ignored paths stay there between calls).

FA4_WHEELS="${FA4_WHEELS:-.whl}"
FA4_SITE="${FA4_SITE:-/tmp/fa4site}"
# The CuTe DSL keeps its `cutlass` package under nvidia_cutlass_dsl/python_packages (4.5.x) or
# dsl_packages (later) (a .pth file adds it in a site-packages folder; a PYTHONPATH entry reads no
# .pth, so both are named here).
FA4_PYTHONPATH="$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/python_packages:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages"

fa4_setup() {
    python3 - "$FA4_WHEELS" "$FA4_SITE" <<'PY' || return 1
import base64, hashlib, subprocess, sys, tarfile, zipfile
from pathlib import Path

try:
    import lzma  # noqa: F401  (tarfile reads .tar.xz through it)
except ImportError:
    lzma = None

wheels, site = Path(sys.argv[1]), Path(sys.argv[2])
archives = sorted([*wheels.glob("*.whl"), *wheels.glob("*.tar.xz")])
if not archives:
    sys.exit(f"fa4_setup: no *.whl or *.tar.xz in {wheels.resolve()} (name .whl in the call's carry)")
stamp = site / ".fa4_setup_done"
wanted = "\n".join(f"{a.name} {a.stat().st_size}" for a in archives)
if stamp.exists() and stamp.read_text() == wanted:
    print(f"fa4_setup: {site} already holds these {len(archives)} packages")
    sys.exit(0)
site.mkdir(parents=True, exist_ok=True)
for a in archives:
    if a.name.endswith(".whl"):
        with zipfile.ZipFile(a) as z:
            z.extractall(site)
    elif lzma is not None:
        with tarfile.open(a) as t:
            t.extractall(site, filter="data")
    else:  # a python built without lzma: the xz program decompresses
        with subprocess.Popen(["xz", "-dc", str(a)], stdout=subprocess.PIPE) as xz:
            with tarfile.open(fileobj=xz.stdout, mode="r|") as t:
                t.extractall(site, filter="data")
        if xz.returncode:
            sys.exit(f"fa4_setup: xz -dc {a} failed with status {xz.returncode}")
    print(f"fa4_setup: unpacked {a.name} ({a.stat().st_size / 2**20:.1f} MiB)")
# Every file a RECORD names must be there with its sha256: a repacked archive is the wheel's files.
checked, bad = 0, []
for record in site.glob("*.dist-info/RECORD"):
    for line in record.read_text().splitlines():
        path, _, rest = line.partition(",")
        digest = rest.partition(",")[0]
        if not digest.startswith("sha256="):
            continue
        f = site / path
        if not f.is_file():
            bad.append(f"{path}: missing")
            continue
        got = base64.urlsafe_b64encode(hashlib.sha256(f.read_bytes()).digest()).rstrip(b"=").decode()
        if got != digest[len("sha256="):]:
            bad.append(f"{path}: sha256 differs from {record.parent.name}/RECORD")
        checked += 1
if bad:
    sys.exit("fa4_setup: " + "; ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else ""))
print(f"fa4_setup: {checked} files match their RECORD sha256")
stamp.write_text(wanted)
PY
    PYTHONPATH="$FA4_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH}" python3 - <<'PY'
import importlib.metadata as md, sys

for dist in ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-core", "quack-kernels",
             "apache-tvm-ffi", "cuda-bindings", "torch"):
    try:
        print(f"fa4_setup: {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"fa4_setup: {dist} not found")
try:
    import cutlass.cute  # noqa: F401
    import flash_attn.cute
except Exception as exc:
    sys.exit(f"fa4_setup: flash_attn.cute does not import: {type(exc).__name__}: {exc}")
print(f"fa4_setup: flash_attn.cute imports ({flash_attn.cute.flash_attn_func.__module__})")
PY
}

if [ "${BASH_SOURCE[0]}" != "$0" ]; then
    # Sourced: set PYTHONPATH for the commands that follow.
    if fa4_setup; then
        case ":$PYTHONPATH:" in
            *":$FA4_PYTHONPATH:"*) ;;
            *) export PYTHONPATH="$FA4_PYTHONPATH${PYTHONPATH:+:$PYTHONPATH}" ;;
        esac
        echo "fa4_setup: PYTHONPATH=$PYTHONPATH"
    else
        false
    fi
else
    fa4_setup || exit 1
    echo "export PYTHONPATH=$FA4_PYTHONPATH\${PYTHONPATH:+:\$PYTHONPATH}"
fi

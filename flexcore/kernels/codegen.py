"""Turn generated Triton source into importable modules, cached by content.

Triton needs real source files (it reads the source of ``@triton.jit`` functions), so generated
kernels are written to a cache folder and imported from there. The module name is a hash of the
source, so the same source is compiled once per process and changing a captured tensor's values
never reaches this layer.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

from flexcore._runtime import prepare_triton

_TEMPLATES = Path(__file__).parent / "templates"
_lock = threading.Lock()
_modules: dict[str, ModuleType] = {}
#: Number of generated modules imported in this process (tests count recompilations with it).
compile_count = 0

HEADER = (
    "import triton\n"
    "import triton.language as tl\n"
    "from flexcore.lowering.triton_helpers import *  # noqa: F401,F403\n\n"
)


def cache_dir() -> Path:
    """Folder of generated kernel modules: $FLEXLAB_CACHE_DIR, else ~/.cache/flexlab/kernels."""
    root = os.environ.get("FLEXLAB_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "flexlab")
    path = Path(root) / "kernels"
    path.mkdir(parents=True, exist_ok=True)
    return path


def read_template(name: str) -> str:
    return (_TEMPLATES / name).read_text()


def fill_template(template: str, values: dict[str, str]) -> str:
    """Replace each ``{{NAME}}`` in ``template``; a placeholder left unfilled is an error."""
    out = template
    for name, value in values.items():
        out = out.replace("{{" + name + "}}", value)
    if "{{" in out:
        start = out.index("{{")
        raise KeyError(f"template placeholder left unfilled: {out[start:out.index('}}', start) + 2]}")
    return out


def load_module(source: str, name_hint: str = "kernel") -> ModuleType:
    """Import ``source`` (a complete Python module) once per process and return the module."""
    global compile_count
    digest = hashlib.sha256(source.encode()).hexdigest()[:20]
    name = f"flexlab_gen_{name_hint}_{digest}"
    with _lock:
        mod = _modules.get(name)
        if mod is not None:
            return mod
        prepare_triton()
        path = cache_dir() / f"{name}.py"
        if not path.exists() or path.read_text() != source:
            fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                f.write(source)
            os.replace(tmp, path)  # atomic: concurrent processes never see half a file
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        _modules[name] = mod
        compile_count += 1
        return mod


def cap_list(names) -> str:
    """A placeholder's value for captured parameters: `, name, name...` (or empty)."""
    return "".join(", " + n for n in names)


def build_kernel_source(template_name: str, score_mod, mask_mod) -> str:
    """Fill ``template_name`` with two lowered mods (see flexcore/README.md for the placeholders)."""
    values = {
        "MOD_FUNCTIONS": score_mod.source.rstrip() + "\n\n\n" + mask_mod.source.rstrip() + "\n",
        "SCORE_CAPS": cap_list(score_mod.cap_params),
        "MASK_CAPS": cap_list(mask_mod.cap_params),
        "CAPS": cap_list(tuple(score_mod.cap_params) + tuple(mask_mod.cap_params)),
    }
    return HEADER + fill_template(read_template(template_name), values)


_by_key: dict[tuple, ModuleType] = {}


def cached_module(key: tuple, build_source, name_hint: str) -> ModuleType:
    """``load_module(build_source(), name_hint)``, remembered under ``key`` (the template name and
    the lowered mods' sources it is built from): later calls skip filling the template and hashing
    the source (about 0.1 ms of host time). str hashes are cached, so the lookup is cheap."""
    module = _by_key.get(key)
    if module is None:
        module = _by_key[key] = load_module(build_source(), name_hint)
    return module


def load_kernel_module(template_name: str, score_mod, mask_mod) -> ModuleType:
    """The compiled module for ``template_name`` filled with these mods (cached by source)."""
    return cached_module((template_name, score_mod.source, mask_mod.source),
                         lambda: build_kernel_source(template_name, score_mod, mask_mod),
                         template_name.split(".")[0])

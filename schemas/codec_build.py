"""The compiled build of the generated codec: the exact Python source :mod:`kvbus.schemas.codegen`
writes for :mod:`kvbus.schemas.codec`, compiled by Cython into an extension module, and how a
codec finds and loads it.

The generated source stays the one definition of the codec: the compiled module is a build of
it, named after a digest of it (``_codec_<digest>``), and :func:`load` hands it to a codec only
when that digest is the digest of the source the codec would execute now. Anything else (no
build, a build of other schemas, ``KVBUS_COMPILED_CODEC=0``, a build that does not import) leaves
the codec on the reference path, ``exec`` of the source. ``./dev setup`` builds it
(``python -m kvbus.schemas.codec_build``); a failed build warns and leaves the reference path.

Why Cython rather than hand-written C: the generated source is plain Python and Cython compiles
it unchanged (its unknown names are the module's globals, looked up at run time exactly as in
``exec``), so the compiled codec cannot drift from the reference one, and a schema change needs
no C written by hand; Cython is a well-kept compiler that follows CPython's releases, where a C
extension of our own would have to track the C API itself.

Compiled as plain Python, this code gains little (10-15 % of the decoding time): its time goes to
calls and untyped indexing. :func:`declarations` adds C types to the readers, derived from the source by a fixed rule
and kept beside it in an augmenting ``.pxd``, so the source compiled is still the generated one.

Where: ``build/codec/`` of the checkout (git-ignored): the source compiled (``_codec_<digest>.py``,
which Cython's tracebacks name), its declarations (``.pxd``), its C translation (``.c``) and the
module. An installed wheel has no build and runs the reference path.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import re
import shutil
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

BUILD_DIR = Path(__file__).resolve().parent.parent / "build" / "codec"
"""Where :func:`compile_source` writes and :func:`load` looks (the checkout's git-ignored ``build/``)."""
PREFIX = "_codec_"
"""The compiled module's name is this prefix + :func:`digest` of its source."""
DIGEST_CHARS = 20
"""Hex digits of the SHA-256 of the source kept in the module's name (80 bits)."""

_LOADED: dict[str, ModuleType] = {}
"""Module name -> the compiled module loaded in this process (an extension module is made once)."""


TYPED = {
    re.compile(r"^def ((?:r|k|ru|ku)_\w+)\(data, pos\):$", re.M):
        "(bytes data, Py_ssize_t pos)",
    re.compile(r"^def (s_\w+)\(data, start, pos, raw\):$", re.M):
        "(bytes data, Py_ssize_t start, Py_ssize_t pos, raw)",
    re.compile(r"^def (scan_\w+)\(data, pos, raw, shared=None\):$", re.M):
        "(bytes data, Py_ssize_t pos, raw, shared=*)",
}
"""The generated functions that read at an offset (:mod:`kvbus.schemas.codegen`: readers ``r_R`` and
``ru_N``, skippers ``k_R`` and ``ku_N``, the scanner ``scan_R`` and its members ``s_R``), found by their
``def`` line, -> their signature in :func:`declarations`."""


def declarations(source: str) -> str:
    """Cython declarations for the compiled build of ``source`` (an augmenting ``.pxd``: the source
    itself is compiled unchanged), derived from its ``def`` lines: each function of :data:`TYPED` is a
    ``cpdef`` function of ``bytes data`` and ``Py_ssize_t`` offsets, its local ``b`` (the byte at
    ``pos``) a C int. Calls between them are C calls, and ``data[pos]`` reads the byte.

    Why it is safe: the codec reads ``bytes`` (Kafka values, slices of them), and every offset it
    passes is within ``data`` or one past it (each read checks its bounds); the values and the
    exceptions on bad bytes stay those of the reference path (tests/test_compiled_codec.py). A caller
    passing another buffer type (a bytearray) gets a TypeError from the compiled build."""
    lines = ["cimport cython", ""]
    for pattern, signature in TYPED.items():
        for name in pattern.findall(source):
            lines += ["@cython.locals(b=cython.int)", f"cpdef {name}{signature}", ""]
    return "\n".join(lines)


def digest(source: str) -> str:
    """First :data:`DIGEST_CHARS` hex digits of the SHA-256 of ``source`` and its :func:`declarations`
    (UTF-8): what the build is made of."""
    made_of = source + "\0" + declarations(source)
    return hashlib.sha256(made_of.encode("utf-8")).hexdigest()[:DIGEST_CHARS]


def module_name(source: str) -> str:
    """The name of the compiled build of ``source``: ``_codec_<digest>``."""
    return PREFIX + digest(source)


def built_path(source: str, build_dir: Path = BUILD_DIR) -> Optional[Path]:
    """The compiled build of ``source`` in ``build_dir`` for this interpreter (its extension
    suffix, e.g. ``.cpython-311-x86_64-linux-gnu.so``), or None if there is none."""
    name = module_name(source)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = build_dir / (name + suffix)
        if path.is_file():
            return path
    return None


def why_not_built(source: str, build_dir: Path = BUILD_DIR) -> str:
    """Why :func:`built_path` found nothing: a build of another source is there (stale), or none."""
    others = sorted(p.name for p in build_dir.glob(PREFIX + "*") if p.suffix in (".so", ".pyd"))
    if others:
        return f"stale: {build_dir} holds a build of another source ({others[0]}); run ./dev setup"
    return f"not built ({build_dir} has no {module_name(source)}; ./dev setup builds it)"


def load(source: str, namespace: dict[str, Any], build_dir: Path = BUILD_DIR) -> tuple[Optional[dict[str, Any]], str]:
    """The globals of the compiled build of ``source``, run with ``namespace`` (the names the
    generated source refers to: the runtime's primitives and the ``S_*`` structs) set before its
    module-level statements run, as ``exec(source, namespace)`` would; and a line saying which
    path it is. (None, why) when there is no build of exactly this source, or it does not import,
    or it is already in use with other structs (one extension module per process)."""
    path = built_path(source, build_dir)
    if path is None:
        return None, why_not_built(source, build_dir)
    name = path.name.split(".", 1)[0]
    module = _LOADED.get(name)
    if module is not None:
        if any(module.__dict__.get(k) is not v for k, v in namespace.items()):
            return None, f"{path.name} is in use by a codec of other structs"
        return module.__dict__, f"compiled {path}"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)  # created, its statements not run yet
        module.__dict__.update(namespace)
        spec.loader.exec_module(module)
    except Exception as exc:  # e.g. built for another Cython runtime, or a broken file
        return None, f"{path.name} does not load ({type(exc).__name__}: {exc})"
    _LOADED[name] = module
    return module.__dict__, f"compiled {path}"


def compile_source(source: str, build_dir: Path = BUILD_DIR) -> Path:
    """Compile ``source`` with Cython into ``build_dir`` (unless a build of it is there already) and
    return the module's path; builds of other sources in ``build_dir`` are removed. Raises what
    Cython or the C compiler raise (ImportError without Cython: ``pip install cython``)."""
    done = built_path(source, build_dir)
    if done is not None:
        return done
    from Cython.Build import cythonize  # the dev extra: only building needs it
    from Cython.Compiler import Options
    from setuptools import Distribution, Extension

    name = module_name(source)
    build_dir.mkdir(parents=True, exist_ok=True)
    py = build_dir / f"{name}.py"
    py.write_text(source, encoding="utf-8")
    (build_dir / f"{name}.pxd").write_text(declarations(source), encoding="utf-8")
    # The source's free names (runtime primitives, structs) are globals that load() sets before its
    # statements run: Cython looks them up at run time instead of refusing them as undeclared.
    Options.error_on_unknown_names = False
    ext = cythonize([Extension(name, [str(py)])], quiet=True,
                    compiler_directives={"language_level": 3, "binding": True})
    dist = Distribution({"name": name, "ext_modules": ext})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib = str(build_dir)
    cmd.build_temp = str(build_dir / "tmp")
    cmd.ensure_finalized()
    cmd.run()
    path = built_path(source, build_dir)
    if path is None:
        raise RuntimeError(f"Cython built no {name} in {build_dir}")
    _remove_others(build_dir, name)
    return path


def _remove_others(build_dir: Path, keep: str) -> None:
    """Remove the files of builds other than ``keep`` and the C compiler's objects."""
    shutil.rmtree(build_dir / "tmp", ignore_errors=True)
    for p in build_dir.glob(PREFIX + "*"):
        if not p.name.startswith(keep + "."):
            p.unlink()


def main(argv: Optional[list[str]] = None) -> int:
    """``python -m kvbus.schemas.codec_build [--build-dir DIR]``: build the compiled codec of
    ``schemas/avro``. Exit status 0 when built (or already built), 1 with a warning on stderr
    when the build failed: the codec then runs its reference path."""
    ap = argparse.ArgumentParser(description="Compile kvbus's generated Avro codec with Cython")
    ap.add_argument("--build-dir", type=Path, default=BUILD_DIR)
    args = ap.parse_args(argv)
    from kvbus.schemas.codec import CODEC

    source = CODEC.generated
    t = time.monotonic()
    try:
        path = compile_source(source, args.build_dir)
    except Exception as exc:  # no Cython, a Cython CompileError, the C compiler's CompileError
        print(f"warning: the compiled codec was not built ({type(exc).__name__}: {exc}); "
              "kvbus runs the generated Python codec", file=sys.stderr)
        return 1
    print(f"compiled codec: {path} ({time.monotonic() - t:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())

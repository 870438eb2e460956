"""Build script: the packages are found, never listed by hand (metadata: setup.cfg).

``adapters/`` installs as ``mpitree.adapters`` (``package_dir`` in setup.cfg): a
top-level ``adapters`` package would clash with an unrelated PyPI package.

The C extensions (pyproject.toml) compile for a minute or more. Each build is kept
under ``build/mpitree-ext/`` of the checkout (``MPITREE_BUILD_CACHE`` to move it),
named by a hash of everything that decides its bytes: the sources and headers, the
compiler's command line and version, the flags, the target's file name (Python ABI).
A reinstall from unchanged sources copies the kept build instead of compiling.
"""

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def packages():
    """Every package under ``mpitree/``, and ``adapters/``'s under ``mpitree.adapters``."""
    adapters = [f"mpitree.adapters.{name}" for name in find_packages("adapters")]
    return [*find_packages(include=["mpitree", "mpitree.*"]), "mpitree.adapters", *adapters]


def _compiler_version(command):
    """Return what ``command --version`` prints ('' where it cannot run)."""
    try:
        return subprocess.run(
            [command, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


class CachedBuildExt(build_ext):
    """``build_ext`` that reuses an extension built before from the same inputs."""

    def build_extension(self, ext):
        """Copy a kept build of ``ext`` if its inputs are unchanged; else compile and keep it."""
        target = Path(self.get_ext_fullpath(ext.name))
        cache = Path(os.environ.get("MPITREE_BUILD_CACHE") or ROOT / "build" / "mpitree-ext")
        kept = cache / f"{ext.name}-{self._key(ext, target)}{''.join(target.suffixes)}"
        if kept.is_file():
            print(f"mpitree: {ext.name}: sources unchanged, reusing {kept}", flush=True)
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f"{target.name}.{os.getpid()}.tmp")
            shutil.copyfile(kept, partial)
            os.replace(partial, target)  # a new file: a process that loaded the old one keeps it
            return
        sources = ", ".join(Path(s).name for s in ext.sources)
        print(f"mpitree: compiling {ext.name} from {sources} (a minute or two)", flush=True)
        super().build_extension(ext)
        try:
            cache.mkdir(parents=True, exist_ok=True)
            partial = kept.with_name(f"{kept.name}.{os.getpid()}.tmp")
            shutil.copyfile(target, partial)
            os.replace(partial, kept)  # whole or absent, even with builds side by side
        except OSError as exc:  # a read-only checkout: nothing kept, the build stands
            print(f"mpitree: could not keep the build of {ext.name}: {exc}", flush=True)

    def _key(self, ext, target):
        """Return a hash of every input that decides the extension's bytes."""
        digest = hashlib.sha256()
        for name in sorted({*ext.sources, *ext.depends}):
            digest.update(name.encode() + b"\0" + (ROOT / name).read_bytes())
        command = list(getattr(self.compiler, "compiler_so", None) or [])
        parts = [
            command,
            _compiler_version(command[0]) if command else "",
            ext.extra_compile_args,
            ext.extra_link_args,
            ext.define_macros,
            ext.libraries,
            ext.include_dirs,
            self.include_dirs,
            getattr(self.compiler, "linker_so", None),
            target.name,
            os.environ.get("CFLAGS", ""),
            os.environ.get("LDFLAGS", ""),
        ]
        digest.update(repr(parts).encode())
        return digest.hexdigest()[:24]


if __name__ == "__main__":
    setup(packages=packages(), cmdclass={"build_ext": CachedBuildExt})

"""Modules generated from source at run time (flex_attention's variants: each captured
modifier's steps, as Numba or Triton code), imported once per process.

Each module is written to a file named by its source's digest under the kernel cache's
variants folder (``fastpe cache clear`` removes them): Numba keys its disk cache by a kernel's
file, and Triton reads a kernel's source from its file. Where no cache directory is writable, a
module that needs a file gets one in a temporary folder of this process, any other is executed
in memory."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
import types


class GeneratedModules:
    """The modules of one generator: ``package.<prefix><digest>``, from files
    ``<prefix><digest>.py``. ``loaded`` lists the digest of each module this process loaded."""

    def __init__(self, package: str, prefix: str, *, needs_file: bool):
        self.package, self.prefix, self.needs_file = package, prefix, needs_file
        self._modules: dict[str, types.ModuleType] = {}
        self._lock = threading.Lock()
        self.loaded: list[str] = []

    def load(self, source: str) -> types.ModuleType:
        digest = hashlib.sha256(source.encode()).hexdigest()[:20]
        with self._lock:
            module = self._modules.get(digest)
            if module is not None:
                return module
            name = f"{self.package}.{self.prefix}{digest}"
            path = _write(f"{self.prefix}{digest}.py", source, self.needs_file)
            if path is not None:
                spec = importlib.util.spec_from_file_location(name, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                try:
                    spec.loader.exec_module(module)
                except BaseException:
                    del sys.modules[name]
                    raise
            else:
                module = types.ModuleType(name)
                module.__file__ = None
                sys.modules[name] = module
                exec(compile(source, f"<fastpe generated {name}>", "exec"), module.__dict__)
            self._modules[digest] = module
            self.loaded.append(digest)
            return module


def _write(filename: str, source: str, needs_file: bool) -> str | None:
    """The path of the module's file (written atomically if absent or different): under the
    variants folder of the kernel cache, else (``needs_file``) a temporary folder of this
    process, else None."""
    from fastpe.kernels.numba._runtime import variants_directory

    for folder in (variants_directory(), _private_folder() if needs_file else None):
        if folder is None:
            continue
        path = os.path.join(folder, filename)
        try:
            with open(path, encoding="utf-8") as file:
                if file.read() == source:
                    return path
        except OSError:
            pass
        try:
            os.makedirs(folder, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=folder, suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                file.write(source)
            os.replace(temp, path)  # whole or absent for a process reading it concurrently
            return path
        except OSError:
            continue
    if needs_file:
        raise OSError(f"fastpe could not write the generated module {filename} anywhere")
    return None


_private = None


def _private_folder() -> str:
    global _private
    if _private is None:
        _private = tempfile.mkdtemp(prefix="fastpe-generated-")
    return _private
